"""The FastAPI app: OpenAI's /v1 routes over an ``AsyncLLMEngine``, plus /health and /metrics.

Every error leaves as OpenAI's ``{"error": {message, type, param, code}}``;
bad input is always a 4xx (validation problems are 400, not FastAPI's 422).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark.llm import AsyncLLMEngine, RequestOutput, SamplingParams
from dspark.log import get_logger
from dspark.server.chat_template import ChatTemplate
from dspark.server.group import ClientGone, SeqSpec, SequenceGroup
from dspark.server.metrics import ServerMetrics
from dspark.server.openai_schema import (
    APIError, AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionRequest, Completion, CompletionChoice,
    CompletionRequest, ErrorBody, ErrorResponse, ModelCard, ModelList, Usage, SamplingFields,
)

log = get_logger("dspark.server")

MAX_SEQUENCES = 256  # prompts x n in one request
# Fields typed to accept only their neutral value: say so when a client sends anything else.
_UNSUPPORTED = {"logprobs", "top_logprobs", "best_of", "suffix", "logit_bias", "presence_penalty",
                "frequency_penalty", "tools", "tool_choice", "functions", "response_format", "modalities"}
_ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": ErrorResponse} for c in (400, 401, 404)}


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str
    model_root: str
    metrics: ServerMetrics
    chat_template: ChatTemplate
    api_key: str | None = None
    created: int = 0

    @property
    def max_model_len(self) -> int:
        return int(self.engine.engine.max_model_len)

    @property
    def token_budget(self) -> int:
        """The most prompt + output tokens one sequence can get: model length and KV capacity."""
        cache = self.engine.engine.cache
        return min(self.max_model_len, cache.allocator.num_pages * cache.page_size)


class _AsciiJSON(JSONResponse):
    """Error bodies quote client input, which JSON lets carry lone surrogates: escape, never fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def _error(status: int, body: ErrorBody) -> JSONResponse:
    return _AsciiJSON({"error": body.model_dump()}, status_code=status)


_UNION_TAGS = {"body", "str", "int", "float", "bool", "list", "dict", "none"}


def _param(loc: tuple[Any, ...]) -> str | None:
    # Drop "body" and pydantic's union-member tags ("str", "list[constrained-str]"): keep the field path.
    parts = [str(x) for x in loc if isinstance(x, int) or (str(x).isidentifier() and x not in _UNION_TAGS)]
    return ".".join(parts) or None


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


def create_app(state: ServerState, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
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
    app.add_middleware(_CountRequests, metrics=state.metrics)
    _install_error_handlers(app)
    eng = state.engine.engine

    async def check_key(request: Request) -> None:
        if state.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Hash both sides first so the comparison time depends on neither length nor content.
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.strip().encode()).digest(), hashlib.sha256(state.api_key.encode()).digest())
        if not ok:
            raise APIError(401, "Incorrect or missing API key (send 'Authorization: Bearer KEY').",
                           code="invalid_api_key")

    auth = [Depends(check_key)]

    def check_model(model: str) -> None:
        if model != state.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{state.model_name}'.",
                           param="model", code="model_not_found")

    def card() -> ModelCard:
        return ModelCard(id=state.model_name, created=state.created, max_model_len=state.max_model_len,
                         root=state.model_root)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = state.engine.stats()
        return {"status": "ok", "model": state.model_name, "requests_running": s.num_running,
                "requests_waiting": s.num_waiting, "kv_cache_used_bytes": s.kv_used_bytes,
                "kv_cache_usage_ratio": s.kv_usage}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth, responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id)
        return card()

    # -- shared request plumbing ------------------------------------------------------------------

    def encode(prompt: str | list[int], param: str, *, special: bool = True) -> list[int]:
        try:
            if isinstance(prompt, str):
                prompt.encode("utf-8")  # JSON can carry lone surrogates ("\ud800"); the tokenizer cannot
            if isinstance(prompt, str) and not special:
                ids = eng.encode(eng.tokenizer.encode(prompt, add_special_tokens=False).ids) \
                    if eng.tokenizer is not None else eng.encode(prompt)
            else:
                ids = eng.encode(prompt)
        except UnicodeEncodeError:
            raise APIError(400, f"the {param} is not valid Unicode text (a lone surrogate?)", param=param) from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        if len(ids) >= state.token_budget:
            raise APIError(400, f"This model's maximum context length is {state.token_budget} tokens; the "
                           f"{param} has {len(ids)} tokens, leaving none for the output.",
                           param=param, code="context_length_exceeded")
        return ids

    def sampling(body: SamplingFields, max_tokens: int, seed: int | None) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if top_p == 0.0:  # nucleus sampling's limit: only the most likely token
            temperature, top_p = 0.0, 1.0
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=body.top_k or 0,
                                  seed=seed, stop=stop, stop_token_ids=body.stop_token_ids or [],
                                  ignore_eos=body.ignore_eos)
        except ValidationError as e:
            raise APIError(400, str(e), param=_param(e.errors()[0]["loc"])) from None

    def start(request: Request, rid: str, prompts: list[list[int]], body: SamplingFields, max_tokens: list[int],
              arrival: float) -> SequenceGroup:
        n = body.n or 1
        if len(prompts) * n > MAX_SEQUENCES:
            raise APIError(400, f"{len(prompts)} prompts x n={n} exceeds {MAX_SEQUENCES} sequences per request",
                           param="n")
        specs = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                seed = None if body.seed is None else (body.seed + j + 2**63) % 2**64 - 2**63  # wrap, stay in range
                specs.append(SeqSpec(f"{rid}-{p * n + j}", ids, sampling(body, max_tokens[p], seed)))
        try:
            return SequenceGroup(state.engine, state.metrics, request, specs, arrival).start()
        except ValueError as e:  # e.g. prompt + max_tokens beyond the KV cache
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None

    def usage(prompts: list[list[int]], finals: list[RequestOutput]) -> Usage:
        # Like OpenAI: a prompt counts once however many choices it has.
        pt, ct = sum(len(p) for p in prompts), sum(len(f.token_ids) for f in finals)
        return Usage(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    async def stream(group: SequenceGroup, prompts: list[list[int]], head: list[str],
                     chunk: Callable[[int, str | None, str | None], dict[str, Any]], envelope: dict[str, Any],
                     include_usage: bool) -> AsyncIterator[str]:
        """SSE body: optional head chunk per choice, deltas, a finish chunk per choice, usage, [DONE]."""
        extra = {"usage": None} if include_usage else {}
        finals: dict[int, RequestOutput] = {}
        try:
            for i, text in enumerate(head):
                yield sse({**envelope, "choices": [chunk(i, text, None)], **extra})
            async for i, out in group.events():
                if out.delta:
                    yield sse({**envelope, "choices": [chunk(i, out.delta, None)], **extra})
                if out.finished:
                    finals[i] = out
                    yield sse({**envelope, "choices": [chunk(i, None, out.finish_reason)], **extra})
            if include_usage:
                u = usage(prompts, [finals[i] for i in sorted(finals)])
                yield sse({**envelope, "choices": [], "usage": u.model_dump()})
        except ClientGone:
            return
        except Exception as e:  # an engine fault mid-stream: the status line is gone, so say it in-band
            log.exception("stream failed", request_id=envelope["id"], error=repr(e))
            yield sse({"error": ErrorBody(message=f"generation failed: {e}", type="server_error").model_dump()})
        finally:
            group.close()
        yield "data: [DONE]\n\n"

    def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def finals_or_raise(group: SequenceGroup) -> list[RequestOutput]:
        try:
            return await group.finals()
        except ClientGone:
            raise
        except Exception as e:
            log.exception("generation failed", error=repr(e))
            raise APIError(500, f"generation failed: {e}", type="server_error") from None

    # -- routes -----------------------------------------------------------------------------------

    @app.post("/v1/completions", dependencies=auth, response_model=None,
              responses={200: {"model": Completion}, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Completion | Response:
        arrival = time.perf_counter()
        check_model(body.model)
        raw = body.prompts()
        prompts = [encode(p, "prompt") for p in raw]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = body.n or 1
        echo = [p if isinstance(p, str) else eng.tokenizer.decode(p) if eng.tokenizer else ""
                for p in raw] if body.echo else []
        group = start(request, rid, prompts, body, [max_tokens] * len(prompts), arrival)
        envelope = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
        if body.stream:
            def chunk(i: int, text: str | None, reason: str | None) -> dict[str, Any]:
                return {"index": i, "text": text or "", "logprobs": None, "finish_reason": reason}

            include = bool(body.stream_options and body.stream_options.include_usage)
            head = [echo[i // n] for i in range(len(prompts) * n)] if echo else []
            return sse_response(stream(group, prompts, head, chunk, envelope, include))
        try:
            finals = await finals_or_raise(group)
        except ClientGone:
            return Response(status_code=499)
        choices = [CompletionChoice(index=i, text=(echo[i // n] if echo else "") + f.text,
                                    finish_reason=f.finish_reason) for i, f in enumerate(finals)]
        return Completion(**envelope, choices=choices, usage=usage(prompts, finals))

    @app.post("/v1/chat/completions", dependencies=auth, response_model=None,
              responses={200: {"model": ChatCompletion}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletion | Response:
        arrival = time.perf_counter()
        check_model(body.model)
        text = state.chat_template.render(body.messages, body.add_generation_prompt)
        ids = encode(text, "messages", special=state.chat_template.adds_special_tokens)
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked if asked is not None else state.token_budget - len(ids)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        group = start(request, rid, [ids], body, [max_tokens], arrival)
        envelope = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": state.model_name}
        if body.stream:
            def chunk(i: int, text: str | None, reason: str | None) -> dict[str, Any]:
                delta: dict[str, Any] = {} if text is None else {"content": text}
                if text is not None and reason is None and i in first:
                    first.discard(i)
                    delta = {"role": "assistant", **delta}
                return {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}

            n = body.n or 1
            first = set(range(n))
            include = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(stream(group, [ids], [""] * n, chunk, envelope, include))
        try:
            finals = await finals_or_raise(group)
        except ClientGone:
            return Response(status_code=499)
        choices = [ChatChoice(index=i, message=AssistantMessage(content=f.text), finish_reason=f.finish_reason)
                   for i, f in enumerate(finals)]
        return ChatCompletion(**{**envelope, "object": "chat.completion"}, choices=choices,
                              usage=usage([ids], finals))

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.body)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errs):
            ctx = errs[0].get("ctx") or {}
            return _error(400, ErrorBody(message=f"The request body is not valid JSON: {ctx.get('error', '')}",
                                         type="invalid_request_error"))
        msgs = []
        for e in errs:
            where = _param(tuple(e.get("loc", ())))
            msg = e.get("msg", "invalid")
            if e.get("type") == "extra_forbidden":
                msg = "unrecognized request argument"
            elif where and where.split(".")[0] in _UNSUPPORTED:
                msg += " (not supported by this server)"
            msgs.append(f"{where}: {msg}" if where else f"request body: {msg}")
        first = _param(tuple(errs[0].get("loc", ()))) if errs else None
        return _error(400, ErrorBody(message="; ".join(msgs), type="invalid_request_error", param=first))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        resp = _error(exc.status_code, ErrorBody(message=str(exc.detail), type=kind))
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", error=repr(exc))
        return _error(500, ErrorBody(message="internal server error", type="server_error"))


__all__ = ["ServerState", "create_app"]
