"""The FastAPI app: OpenAI's /v1 routes over an ``AsyncLLMEngine``, plus /health, /metrics and /version.

The app wires the pieces of :mod:`dspark.server.api` (state, error bodies,
generation routes) and :mod:`dspark.server.tokenizer_routes` together with the
middleware (CORS, body size limit, request counting, observability).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark.host.log import get_logger
from dspark.server.api.completions import add_completion_routes
from dspark.server.api.errors import ERRORS, install_error_handlers
from dspark.server.api.generation import Generation
from dspark.server.api.state import ServerState
from dspark.server.limits import BodySizeLimit, bearer_ok
from dspark.server.metrics import ServerMetrics
from dspark.server.observability import Observability, RequestObservability, start_stats_logger
from dspark.server.protocol.openai_schema import APIError, ModelCard, ModelList, VersionResponse
from dspark.server.tokenizer_routes import add_tokenizer_routes

log = get_logger("dspark.server")


class _CountRequests:
    """Pure ASGI (no BaseHTTPMiddleware: it would get between the handlers and ``receive``)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.http.labels(route, str(status)).inc()


def create_app(state: ServerState, on_shutdown: Callable[[], None] | None = None,
               observability: Observability | None = None) -> FastAPI:
    obs = observability or Observability()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stats = start_stats_logger(state.engine, state.metrics, obs.stats_log_interval_s)  # observability
        yield
        if stats is not None:  # observability
            stats.stop()
        log.info("Shutting down: aborting open requests and stopping the engine.")
        state.engine.shutdown()
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="dspark OpenAI-compatible server", version="1", lifespan=lifespan)
    app.state.dspark = state
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        # Validation failures are 400 here (documented per route), never FastAPI's 422.
        if app.openapi_schema is None:
            schema = default_openapi()
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    if state.cors_allow_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=state.cors_allow_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    if state.max_body_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=state.max_body_bytes)
    app.add_middleware(_CountRequests, metrics=state.metrics)
    # Observability, outermost: request id on every response, the access log line, the request's trace.
    app.add_middleware(RequestObservability, access_log=obs.access_log, tracer=obs.tracer)
    install_error_handlers(app)
    gen = Generation(state)

    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        if not bearer_ok(request.headers.get("authorization"), state.api_key):
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer KEY').",
                           code="invalid_api_key")

    auth = [Depends(check_key)]

    def card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len,
                         root=state.model_root)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = state.engine.stats()
        return {"status": "ok", "model": state.model_name, "requests_running": s.num_running,
                "requests_waiting": s.num_waiting, "kv_cache_used_bytes": s.kv_used_bytes,
                "kv_cache_usage_ratio": s.kv_usage, "decoder": s.decoder, "decoder_failovers": s.decoder_failovers}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> VersionResponse:
        from dspark import __version__

        return VersionResponse(version=__version__)

    @app.get("/v1/models", dependencies=auth, responses=ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        gen.check_model(model_id)
        return card()

    add_completion_routes(app, gen, auth=auth)
    add_tokenizer_routes(app, state, auth=auth, errors=ERRORS, check_model=gen.check_model, render=gen.render,
                         tokenize_text=gen.tokenize_text)
    return app


__all__ = ["ServerState", "create_app"]
