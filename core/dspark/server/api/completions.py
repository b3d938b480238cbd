"""OpenAI's generation routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from dspark.server.api.errors import ERRORS
from dspark.server.api.generation import Generation, finals_or_raise, sse_response, stream, usage
from dspark.server.group import ClientGone
from dspark.server.protocol import logprobs_format as lpf
from dspark.server.protocol.openai_schema import (
    AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionRequest, Completion, CompletionChoice,
    CompletionRequest,
)


def add_completion_routes(app: FastAPI, gen: Generation, *, auth: list[Any]) -> None:
    state, tt = gen.state, gen.tt

    @app.post("/v1/completions", dependencies=auth, response_model=None,
              responses={200: {"model": Completion}, **ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Completion | Response:
        arrival = time.perf_counter()
        gen.check_model(body.model)
        raw = body.prompts()
        prompts = [await gen.encode(p, "prompt") for p in raw]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        rid = f"cmpl-{uuid.uuid4().hex}"
        n = body.n or 1
        tok = gen.inputs.tokenizer
        echo = [p if isinstance(p, str) else tok.decode(p) if tok else "" for p in raw] if body.echo else []
        prompt_lp = body.logprobs if body.echo and body.logprobs is not None else None
        group = await gen.start(request, rid, prompts, body, [max_tokens] * len(prompts), arrival, "prompt",
                                logprobs=body.logprobs, prompt_logprobs=prompt_lp)
        envelope: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()),
                                    "model": state.model_name}
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
              responses={200: {"model": ChatCompletion}, **ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> ChatCompletion | Response:
        arrival = time.perf_counter()
        gen.check_model(body.model)
        text = await gen.render(body.messages, body.add_generation_prompt)
        ids = await gen.encode(text, "messages", special=state.chat_template.adds_special_tokens)
        asked = body.max_completion_tokens or body.max_tokens
        max_tokens = asked if asked is not None else state.token_budget - len(ids)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        group = await gen.start(request, rid, [ids], body, [max_tokens], arrival, "messages", logprobs=logprobs)
        envelope: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
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
