"""The FastAPI app: OpenAI's /v1 routes over an ``AsyncLLMEngine``, plus /health and /metrics.

Every error leaves as OpenAI's ``{"error": {message, type, param, code}}``;
bad input is always a 4xx (validation problems are 400, not FastAPI's 422).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark.llm import AsyncLLMEngine, RequestOutput, SamplingParams
from dspark.host.log import get_logger
from dspark.server.protocol.chat_template import ChatTemplate
from dspark.server.group import ClientGone, SeqSpec, SequenceGroup, ShuttingDown
from dspark.server.limits import BodySizeLimit
from dspark.server.metrics import ServerMetrics
from dspark.server.observability import Observability, RequestObservability, start_stats_logger
from dspark.server.protocol import logprobs_format as lpf
from dspark.server.protocol.openai_schema import (
    APIError, AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionRequest, Completion, CompletionChoice,
    CompletionRequest, ErrorBody, ErrorResponse, ModelCard, ModelList, SamplingFields, Usage, VersionResponse,
)
from dspark.server.protocol.token_text import TokenText
from dspark.server.tokenizer_routes import add_tokenizer_routes

log = get_logger("dspark.server")

MAX_SEQUENCES = 256  # prompts x n in one request
# Fields typed to accept only their neutral value: say so when a client sends anything else.
_UNSUPPORTED = {"best_of", "suffix", "tools", "tool_choice", "functions", "modalities"}
_ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": ErrorResponse} for c in (400, 401, 404, 413, 503)}


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str
    model_root: str
    metrics: ServerMetrics
    chat_template: ChatTemplate
    api_key: str | None = None
    created: int = 0
    max_body_bytes: int | None = None  # larger request bodies are a 413; None = no limit
    cors_allow_origins: list[str] = field(default_factory=list)  # empty = no CORS headers
    draining: bool = False  # set at SIGTERM: new generation requests are refused with 503
    groups: set[SequenceGroup] = field(default_factory=set)  # requests being generated, for the drain
    token_text: TokenText | None = None
    max_token_bytes: int = 0  # the longest token's bytes: bounds how few tokens a text can become

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
    _install_error_handlers(app)
    eng = state.engine.engine
    if state.token_text is None:
        state.token_text = TokenText(eng.tokenizer)
        if eng.tokenizer is not None:
            vocab = eng.tokenizer.get_vocab_size(with_added_tokens=True)
            state.max_token_bytes = max((len(state.token_text.token_bytes(i)) for i in range(vocab)), default=0)
    tt = state.token_text

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

    @app.get("/version")
    async def version() -> VersionResponse:
        from dspark import __version__

        return VersionResponse(version=__version__)

    @app.get("/v1/models", dependencies=auth, responses=_ERRORS)
    async def list_models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", dependencies=auth, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id)
        return card()

    # -- shared request plumbing ------------------------------------------------------------------

    def tokenize_text(text: str, special: bool) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while it works, and a big
        # text takes seconds, during which the event loop must keep serving everyone else.
        return list(eng.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)

    def encode_now(prompt: str | list[int], special: bool) -> list[int]:
        if isinstance(prompt, str) and eng.tokenizer is not None:
            return eng.encode(tokenize_text(prompt, special) or "")
        return eng.encode(prompt)

    async def encode(prompt: str | list[int], param: str, *, special: bool = True) -> list[int]:
        """Token ids of a prompt, tokenized in a worker thread so a huge one never stalls the event loop."""
        budget = state.token_budget
        try:
            if isinstance(prompt, str):
                size = len(prompt.encode("utf-8"))  # JSON can carry lone surrogates ("\ud800"); the tokenizer cannot
                # Each token holds at most max_token_bytes bytes: past this the prompt cannot fit, whatever
                # it tokenizes to, so it is refused without spending seconds tokenizing it.
                if state.max_token_bytes and size > budget * state.max_token_bytes:
                    raise APIError(400, f"This model's maximum context length is {budget} tokens; the {param} "
                                   f"({size} bytes) is longer than that.", param=param,
                                   code="context_length_exceeded")
                ids = await asyncio.to_thread(encode_now, prompt, special)
            else:
                ids = encode_now(prompt, special)
        except UnicodeEncodeError:
            raise APIError(400, f"the {param} is not valid Unicode text (a lone surrogate?)", param=param) from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        if len(ids) >= budget:
            raise APIError(400, f"This model's maximum context length is {budget} tokens; the "
                           f"{param} has {len(ids)} tokens, leaving none for the output.",
                           param=param, code="context_length_exceeded")
        return ids

    def check_room(n_prompt: int, max_tokens: int, what: str) -> None:
        # As OpenAI and vLLM: asking for more than the context leaves is an error, not silently capped.
        budget = state.token_budget
        if n_prompt + max_tokens > budget:
            raise APIError(400, f"This model's maximum context length is {budget} tokens. However, you requested "
                           f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the "
                           f"completion). Please reduce the length of the {what} or completion.",
                           param="max_tokens", code="context_length_exceeded")

    def guided(body: SamplingFields) -> tuple[Any, str | None]:
        """The output constraint the body asks for (a GuidedSpec or None) and the field that asked."""
        from dspark.llm.sampling import GuidedSpec

        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            return GuidedSpec(kind="json_object", value=None), "response_format"
        if rf is not None and rf.type == "json_schema":
            return GuidedSpec(kind="json_schema", value=json.dumps(rf.json_schema.schema_)), "response_format"
        if body.guided_json is not None:
            v = body.guided_json if isinstance(body.guided_json, str) else json.dumps(body.guided_json)
            return GuidedSpec(kind="json_schema", value=v), "guided_json"
        if body.guided_regex is not None:
            return GuidedSpec(kind="regex", value=body.guided_regex), "guided_regex"
        if body.guided_grammar is not None:
            return GuidedSpec(kind="grammar", value=body.guided_grammar), "guided_grammar"
        if body.guided_choice is not None:
            return GuidedSpec(kind="choice", value=json.dumps(body.guided_choice)), "guided_choice"
        return None, None

    def logit_bias(body: SamplingFields) -> dict[int, float]:
        out: dict[int, float] = {}
        vocab = eng.runner.cfg.vocab_size
        for k, v in (body.logit_bias or {}).items():
            try:
                tid = int(k)
            except ValueError:
                raise APIError(400, f"logit_bias: key {k!r} is not a token id", param="logit_bias") from None
            if not 0 <= tid < vocab:
                raise APIError(400, f"logit_bias: token id {tid} is outside the vocabulary [0, {vocab})",
                               param="logit_bias")
            out[tid] = v
        return out

    def sampling(body: SamplingFields, max_tokens: int, seed: int | None, logprobs: int | None,
                 spec: Any, prompt_logprobs: int | None = None) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else body.temperature
        top_p = 1.0 if body.top_p is None else body.top_p
        if top_p == 0.0:  # nucleus sampling's limit: only the most likely token
            temperature, top_p = 0.0, 1.0
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        extra: dict[str, Any] = {}
        if prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=body.top_k or 0, seed=seed,
                stop=stop, stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                logit_bias=logit_bias(body), min_tokens=body.min_tokens or 0, logprobs=logprobs, guided=spec,
                **extra)
        except ValidationError as e:
            err = e.errors()[0]
            msg = str(err["msg"]).removeprefix("Value error, ")
            # A check across fields has no location; its message starts with the field it is about.
            where = _param(err["loc"]) or next((w for w in msg.split()[:1] if w in SamplingParams.model_fields), None)
            raise APIError(400, msg, param=where) from None

    def unregister(group: SequenceGroup) -> None:
        state.groups.discard(group)

    async def start(request: Request, rid: str, prompts: list[list[int]], body: SamplingFields,
                    max_tokens: list[int], arrival: float, what: str, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SequenceGroup:
        if state.draining:
            raise APIError(503, "The server is shutting down; retry on another replica or later.",
                           type="server_error", code="server_shutting_down")
        n = body.n or 1
        if len(prompts) * n > MAX_SEQUENCES:
            raise APIError(400, f"{len(prompts)} prompts x n={n} exceeds {MAX_SEQUENCES} sequences per request",
                           param="n")
        for ids, m in zip(prompts, max_tokens):
            check_room(len(ids), m, what)
        spec, field_name = guided(body)
        if spec is not None:
            from dspark.llm.structured import build_constraint

            try:  # compiled off the event loop (a schema can take a while); cached for the sequences below
                await asyncio.to_thread(build_constraint, eng, spec)
            except ValueError as e:
                raise APIError(400, str(e), param=field_name) from None
        specs = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                seed = None if body.seed is None else (body.seed + j + 2**63) % 2**64 - 2**63  # wrap, stay in range
                specs.append(SeqSpec(f"{rid}-{p * n + j}", ids,
                                     sampling(body, max_tokens[p], seed, logprobs, spec, prompt_logprobs)))
        try:
            group = SequenceGroup(state.engine, state.metrics, request, specs, arrival)
        except ValueError as e:  # e.g. prompt + max_tokens beyond the KV cache
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        state.groups.add(group)
        group.on_close.append(unregister)
        return group.start()

    def usage(prompts: list[list[int]], finals: list[RequestOutput], request: Request | None = None) -> Usage:
        # Like OpenAI: a prompt counts once however many choices it has.
        pt, ct = sum(len(p) for p in prompts), sum(len(f.token_ids) for f in finals)
        if request is not None:  # observability: the access log line's token counts
            request.state.usage_tokens = (pt, ct)
        return Usage(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    Chunk = Callable[[int, str | None, str | None, Any], dict[str, Any]]

    async def stream(group: SequenceGroup, prompts: list[list[int]], head: list[str], chunk: Chunk,
                     envelope: dict[str, Any], include_usage: bool,
                     logprobs: Callable[[int, Any, int], Any] | None = None) -> AsyncIterator[str]:
        """SSE body: optional head chunk per choice, deltas, a finish chunk per choice, usage, [DONE].

        ``logprobs(i, entries, offset)``: the logprobs object for choice i's new tokens, when asked for;
        every chunk carries those of the tokens generated since the previous one.
        """
        extra = {"usage": None} if include_usage else {}
        finals: dict[int, RequestOutput] = {}
        sent: dict[int, int] = {}  # tokens whose logprobs went out, per choice
        offset: dict[int, int] = {i: len(t) for i, t in enumerate(head)}
        try:
            for i, text in enumerate(head):
                yield sse({**envelope, "choices": [chunk(i, text, None, None)], **extra})
            async for i, out in group.events():
                new = None
                if logprobs is not None and out.logprobs is not None and len(out.token_ids) > sent.get(i, 0):
                    new = logprobs(i, out.logprobs[sent.get(i, 0):len(out.token_ids)], offset.get(i, 0))
                    sent[i] = len(out.token_ids)
                if out.delta or new is not None:
                    yield sse({**envelope, "choices": [chunk(i, out.delta, None, new)], **extra})
                    offset[i] = offset.get(i, 0) + len(out.delta)
                if out.finished:
                    finals[i] = out
                    yield sse({**envelope, "choices": [chunk(i, None, out.finish_reason, None)], **extra})
            u = usage(prompts, [finals[i] for i in sorted(finals)], group.request)
            if include_usage:
                yield sse({**envelope, "choices": [], "usage": u.model_dump()})
        except ClientGone:
            return
        except ShuttingDown:  # the drain time ran out: end the stream in-band, as OpenAI reports errors
            yield sse({"error": ErrorBody(message="The server is shutting down; this response was cut short.",
                                          type="server_error", code="server_shutting_down").model_dump()})
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
        except ShuttingDown:
            raise APIError(503, "The server is shutting down; the request was not completed.",
                           type="server_error", code="server_shutting_down") from None
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
        prompts = [await encode(p, "prompt") for p in raw]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = body.n or 1
        echo = [p if isinstance(p, str) else eng.tokenizer.decode(p) if eng.tokenizer else ""
                for p in raw] if body.echo else []
        prompt_lp = body.logprobs if body.echo and body.logprobs is not None else None
        group = await start(request, rid, prompts, body, [max_tokens] * len(prompts), arrival, "prompt",
                            logprobs=body.logprobs, prompt_logprobs=prompt_lp)
        envelope = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
        if body.stream:
            def chunk(i: int, text: str | None, reason: str | None, lps: Any) -> dict[str, Any]:
                return {"index": i, "text": text or "", "logprobs": lps, "finish_reason": reason}

            include = bool(body.stream_options and body.stream_options.include_usage)
            head = [echo[i // n] for i in range(len(prompts) * n)] if echo else []
            lp_fn = None
            if body.logprobs is not None:
                def lp_fn(i: int, entries: Any, offset: int) -> Any:
                    return lpf.completion_logprobs(tt, entries, offset).model_dump()
            return sse_response(stream(group, prompts, head, chunk, envelope, include, lp_fn))
        try:
            finals = await finals_or_raise(group)
        except ClientGone:
            return Response(status_code=499)
        choices = []
        for i, f in enumerate(finals):
            prefix = echo[i // n] if echo else ""
            lps = None
            if body.logprobs is not None:
                lps = lpf.completion_logprobs(tt, f.logprobs or [], len(prefix),
                                          with_prompt=prompts[i // n] if echo else None,
                                          prompt_entries=getattr(f, "prompt_logprobs", None))
                if echo:  # the prompt's tokens start the text
                    lps.text_offset = lpf.offsets(lps.tokens)
            choices.append(CompletionChoice(index=i, text=prefix + f.text, logprobs=lps,
                                            finish_reason=f.finish_reason))
        request.state.usage_tokens = (sum(map(len, prompts)), sum(len(f.token_ids) for f in finals))
        return Completion(**envelope, choices=choices, usage=usage(prompts, finals))

    @app.post("/v1/chat/completions", dependencies=auth, response_model=None,
              responses={200: {"model": ChatCompletion}, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletion | Response:
        arrival = time.perf_counter()
        check_model(body.model)
        text = await render(body.messages, body.add_generation_prompt)
        ids = await encode(text, "messages", special=state.chat_template.adds_special_tokens)
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked if asked is not None else state.token_budget - len(ids)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        group = await start(request, rid, [ids], body, [max_tokens], arrival, "messages", logprobs=logprobs)
        envelope = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": state.model_name}
        if body.stream:
            def chunk(i: int, text: str | None, reason: str | None, lps: Any) -> dict[str, Any]:
                delta: dict[str, Any] = {} if text is None else {"content": text}
                if text is not None and reason is None and i in first:
                    first.discard(i)
                    delta = {"role": "assistant", **delta}
                return {"index": i, "delta": delta, "logprobs": lps, "finish_reason": reason}

            n = body.n or 1
            first = set(range(n))
            include = bool(body.stream_options and body.stream_options.include_usage)
            lp_fn = None
            if logprobs is not None:
                def lp_fn(i: int, entries: Any, offset: int) -> Any:
                    return lpf.chat_logprobs(tt, entries).model_dump()
            return sse_response(stream(group, [ids], [""] * n, chunk, envelope, include, lp_fn))
        try:
            finals = await finals_or_raise(group)
        except ClientGone:
            return Response(status_code=499)
        choices = [ChatChoice(index=i, message=AssistantMessage(content=f.text), finish_reason=f.finish_reason,
                              logprobs=None if logprobs is None else lpf.chat_logprobs(tt, f.logprobs or []))
                   for i, f in enumerate(finals)]
        request.state.usage_tokens = (len(ids), sum(len(f.token_ids) for f in finals))
        return ChatCompletion(**{**envelope, "object": "chat.completion"}, choices=choices,
                              usage=usage([ids], finals))

    async def render(messages: Any, add_generation_prompt: bool) -> str:
        # Off the event loop: a template over a huge conversation takes a while.
        return await asyncio.to_thread(state.chat_template.render, messages, add_generation_prompt)

    add_tokenizer_routes(app, state, auth=auth, errors=_ERRORS, check_model=check_model, render=render,
                         tokenize_text=tokenize_text)
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
