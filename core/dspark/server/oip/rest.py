"""The REST side: KServe v2 routes plus Triton's model configuration, statistics and repository index, and the plan.

Every error is ``{"error": "..."}`` (the spec's error object) with Triton's
statuses; the health routes are open, every other route needs the API key
when one is set. Large bodies are decoded and encoded on a worker thread, so a
big JSON tensor does not hold up the event loop the batchers run on.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from dspark.host.log import get_logger
from dspark.server.limits import BodySizeLimit, bearer_ok
from dspark.server.oip.errors import OipError, bad_request
from dspark.server.oip.model import ServedModel
from dspark.server.oip.rest_codec import HEADER, error_body, parse_infer, render_infer
from dspark.server.oip.service import OipService

log = get_logger("dspark.server.oip")

_INLINE_BYTES = 256 * 1024  # bodies (and outputs) larger than this are decoded (encoded) off the event loop
_OPEN = ("/v2/health/live", "/v2/health/ready")  # probes: never behind the API key


def _error(e: OipError) -> Response:
    return Response(error_body(e), status_code=e.status, media_type="application/json")


class _ApiKey:
    """Pure ASGI: ``Authorization: Bearer KEY`` on every route but the health checks."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN:
            auth = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"authorization"), None)
            if not bearer_ok(auth, self.api_key):
                resp = _error(OipError(401, "incorrect or missing API key (send 'Authorization: Bearer KEY')"))
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _body(request: Request, limit: int | None) -> bytes:
    """The request body, inflated if tritonclient compressed it (request_compression_algorithm)."""
    body = await request.body()
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("identity", ""):
        return body
    if encoding not in ("gzip", "deflate"):
        raise OipError(415, f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    inflater = zlib.decompressobj(31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(body, limit or 0)
    except zlib.error as e:
        raise bad_request(f"the {encoding} body does not inflate: {e}") from None
    if inflater.unconsumed_tail:
        raise OipError(413, f"the request body inflates past {limit} bytes (server.max_body_bytes)")
    return out


def create_app(service: OipService, *, max_body_bytes: int | None = None, cors_allow_origins: list[str] | None = None,
               lifespan: Any = None) -> Starlette:
    def model(request: Request) -> ServedModel:
        p = request.path_params
        return service.model(p["model"], p.get("version", ""))

    async def live(_: Request) -> Response:
        return Response(status_code=200 if service.live else 400)

    async def ready(_: Request) -> Response:
        return Response(status_code=200 if service.ready else 400)

    async def model_ready(request: Request) -> Response:
        p = request.path_params
        return Response(status_code=200 if service.model_ready(p["model"], p.get("version", "")) else 400)

    async def server_metadata(_: Request) -> Response:
        return JSONResponse(service.server_metadata())

    async def model_metadata(request: Request) -> Response:
        return JSONResponse(model(request).metadata())

    async def model_config(request: Request) -> Response:
        return JSONResponse(model(request).config_json())

    async def stats(request: Request) -> Response:
        p = request.path_params
        return JSONResponse({"model_stats": service.statistics(p.get("model", ""), p.get("version", ""))})

    async def repository_index(_: Request) -> Response:
        return JSONResponse(service.repository_index())

    async def plan(request: Request) -> Response:
        return JSONResponse(model(request).session.plan.to_json_dict())

    async def plan_html(request: Request) -> Response:
        m = model(request)
        try:
            from dspark.placement.picture import render_plan_html
        except ImportError:
            raise OipError(501, "the plan picture (dspark.placement.picture) is not in this build") from None
        return HTMLResponse(render_plan_html(m.session.graph, m.session.plan, title=m.name))

    async def infer(request: Request) -> Response:
        t0 = time.monotonic_ns()
        m = model(request)
        try:
            body = await _body(request, max_body_bytes)
            header = request.headers.get(HEADER)
            if len(body) > _INLINE_BYTES:
                req = await asyncio.to_thread(parse_infer, m, body, header)
            else:
                req = parse_infer(m, body, header)
            outs = await service.infer(m, req.feed)
            if sum(a.nbytes for a in outs.values()) > _INLINE_BYTES:
                content, headers = await asyncio.to_thread(render_infer, m, req, outs)
            else:
                content, headers = render_infer(m, req, outs)
        except OipError as e:
            service.finished(m, t0, e)
            raise
        service.finished(m, t0)
        return Response(content, headers=headers)

    async def oip_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, OipError)
        return _error(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        what = "no such route" if exc.status_code == 404 else exc.detail
        return _error(OipError(exc.status_code, f"{request.method} {request.url.path}: {what}"))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error("unhandled error", path=request.url.path, error=f"{type(exc).__name__}: {exc}")
        return _error(OipError(500, f"internal error: {type(exc).__name__}: {exc}"))

    m_ = "/v2/models/{model}"
    v_ = "/v2/models/{model}/versions/{version}"
    routes = [
        Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server_metadata),
        Route("/v2/repository/index", repository_index, methods=["GET", "POST"]),
        Route("/v2/models/stats", stats),
        *(r for base in (m_, v_) for r in (
            Route(base, model_metadata), Route(f"{base}/ready", model_ready), Route(f"{base}/config", model_config),
            Route(f"{base}/stats", stats), Route(f"{base}/infer", infer, methods=["POST"]))),
        Route(f"{m_}/plan", plan), Route(f"{m_}/plan.html", plan_html),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={OipError: oip_error, HTTPException: http_error, Exception: internal_error})
    if service.api_key is not None:
        app.add_middleware(_ApiKey, api_key=service.api_key)
    if max_body_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, error_body=lambda n: error_body(OipError(
            413, f"the request body is larger than this server accepts ({n} bytes; server.max_body_bytes)")))
    if cors_allow_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cors_allow_origins, allow_methods=["*"], allow_headers=["*"],
                           expose_headers=[HEADER])
    return app
