"""What the generation routes share: prompts to token ids, body to sampling parameters, sequence groups, SSE.

A :class:`Generation` serves one app: it checks a request against the model's
context and the server's limits, starts its sequences on the engine, and turns
their outputs into a response body or an SSE stream.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from dspark.host.log import get_logger
from dspark.llm import RequestOutput, SamplingParams
from dspark.server.api.errors import param_path
from dspark.server.api.state import ServerState
from dspark.server.group import ClientGone, EngineUnavailable, SeqSpec, SequenceGroup, ShuttingDown
from dspark.server.protocol.openai_schema import APIError, ErrorBody, SamplingFields, Usage
from dspark.server.protocol.token_text import TokenText

log = get_logger("dspark.server")

MAX_SEQUENCES = 256  # prompts x n in one request

# (choice index, new text, finish reason, logprobs object) -> one choice of an SSE chunk
Chunk = Callable[[int, str | None, str | None, Any], dict[str, Any]]


def usage(prompts: list[list[int]], finals: list[RequestOutput], request: Request | None = None) -> Usage:
    # Like OpenAI: a prompt counts once however many choices it has.
    pt, ct = sum(len(p) for p in prompts), sum(len(f.token_ids) for f in finals)
    if request is not None:  # observability: the access log line's token counts
        request.state.usage_tokens = (pt, ct)
    return Usage(prompt_tokens=pt, completion_tokens=ct, total_tokens=pt + ct)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


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
    except EngineUnavailable as e:  # a cluster replica died mid-stream: say so, the client may retry
        log.warning("stream cut short: engine unavailable", request_id=envelope["id"], error=str(e))
        yield sse({"error": ErrorBody(message=f"generation failed: {e}", type="server_error",
                                      code="engine_unavailable").model_dump()})
    except Exception as e:  # an engine fault mid-stream: the status line is gone, so say it in-band
        log.exception("stream failed", request_id=envelope["id"], error=repr(e))
        yield sse({"error": ErrorBody(message=f"generation failed: {e}", type="server_error").model_dump()})
    finally:
        group.close()
    yield "data: [DONE]\n\n"


async def finals_or_raise(group: SequenceGroup) -> list[RequestOutput]:
    try:
        return await group.finals()
    except ClientGone:
        raise
    except ShuttingDown:
        raise APIError(503, "The server is shutting down; the request was not completed.",
                       type="server_error", code="server_shutting_down") from None
    except EngineUnavailable as e:
        raise APIError(503, f"generation failed: {e}", type="server_error", code="engine_unavailable") from None
    except Exception as e:
        log.exception("generation failed", error=repr(e))
        raise APIError(500, f"generation failed: {e}", type="server_error") from None


class Generation:
    """The request plumbing of one app's generation routes, over its :class:`ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.inputs = state.engine.inputs
        if state.token_text is None:
            state.token_text = TokenText(self.inputs.tokenizer)
            if self.inputs.tokenizer is not None:
                vocab = self.inputs.tokenizer.get_vocab_size(with_added_tokens=True)
                state.max_token_bytes = max((len(state.token_text.token_bytes(i)) for i in range(vocab)), default=0)
        self.tt: TokenText = state.token_text

    def check_model(self, model: str) -> None:
        if model != self.state.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.state.model_name}'.",
                           param="model", code="model_not_found")

    # -- prompts ---------------------------------------------------------------------------------

    def tokenize_text(self, text: str, special: bool) -> list[int]:
        # encode_batch, not encode: only the batch call lets go of the GIL while it works, and a big
        # text takes seconds, during which the event loop must keep serving everyone else.
        return list(self.inputs.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)

    def _encode_now(self, prompt: str | list[int], special: bool) -> list[int]:
        if isinstance(prompt, str) and self.inputs.tokenizer is not None:
            return self.inputs.encode(self.tokenize_text(prompt, special) or "")
        return self.inputs.encode(prompt)

    async def encode(self, prompt: str | list[int], param: str, *, special: bool = True) -> list[int]:
        """Token ids of a prompt, tokenized in a worker thread so a huge one never stalls the event loop."""
        state = self.state
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
                ids = await asyncio.to_thread(self._encode_now, prompt, special)
            else:
                ids = self._encode_now(prompt, special)
        except UnicodeEncodeError:
            raise APIError(400, f"the {param} is not valid Unicode text (a lone surrogate?)", param=param) from None
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None
        if len(ids) >= budget:
            raise APIError(400, f"This model's maximum context length is {budget} tokens; the "
                           f"{param} has {len(ids)} tokens, leaving none for the output.",
                           param=param, code="context_length_exceeded")
        return ids

    async def render(self, messages: Any, add_generation_prompt: bool) -> str:
        # Off the event loop: a template over a huge conversation takes a while.
        return await asyncio.to_thread(self.state.chat_template.render, messages, add_generation_prompt)

    def _check_room(self, n_prompt: int, max_tokens: int, what: str) -> None:
        # As OpenAI and vLLM: asking for more than the context leaves is an error, not silently capped.
        budget = self.state.token_budget
        if n_prompt + max_tokens > budget:
            raise APIError(400, f"This model's maximum context length is {budget} tokens. However, you requested "
                           f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the "
                           f"completion). Please reduce the length of the {what} or completion.",
                           param="max_tokens", code="context_length_exceeded")

    # -- sampling --------------------------------------------------------------------------------

    @staticmethod
    def _guided(body: SamplingFields) -> tuple[Any, str | None]:
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

    def _logit_bias(self, body: SamplingFields) -> dict[int, float]:
        out: dict[int, float] = {}
        vocab = self.inputs.vocab_size
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

    def _sampling(self, body: SamplingFields, max_tokens: int, seed: int | None, logprobs: int | None,
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
                logit_bias=self._logit_bias(body), min_tokens=body.min_tokens or 0, logprobs=logprobs, guided=spec,
                **extra)
        except ValidationError as e:
            err = e.errors()[0]
            msg = str(err["msg"]).removeprefix("Value error, ")
            # A check across fields has no location; its message starts with the field it is about.
            where = param_path(err["loc"]) or next((w for w in msg.split()[:1] if w in SamplingParams.model_fields),
                                                   None)
            raise APIError(400, msg, param=where) from None

    # -- sequence groups -------------------------------------------------------------------------

    def _unregister(self, group: SequenceGroup) -> None:
        self.state.groups.discard(group)

    async def start(self, request: Request, rid: str, prompts: list[list[int]], body: SamplingFields,
                    max_tokens: list[int], arrival: float, what: str, logprobs: int | None = None,
                    prompt_logprobs: int | None = None) -> SequenceGroup:
        """The request's sequences (prompts x n), checked and started on the engine."""
        state = self.state
        if state.draining:
            raise APIError(503, "The server is shutting down; retry on another replica or later.",
                           type="server_error", code="server_shutting_down")
        n = body.n or 1
        if len(prompts) * n > MAX_SEQUENCES:
            raise APIError(400, f"{len(prompts)} prompts x n={n} exceeds {MAX_SEQUENCES} sequences per request",
                           param="n")
        for ids, m in zip(prompts, max_tokens):
            self._check_room(len(ids), m, what)
        spec, field_name = self._guided(body)
        if spec is not None:
            from dspark.llm.structured import build_constraint

            try:  # compiled off the event loop (a schema can take a while); cached for the sequences below
                await asyncio.to_thread(build_constraint, self.inputs, spec)
            except ValueError as e:
                raise APIError(400, str(e), param=field_name) from None
        specs = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                seed = None if body.seed is None else (body.seed + j + 2**63) % 2**64 - 2**63  # wrap, stay in range
                specs.append(SeqSpec(f"{rid}-{p * n + j}", ids,
                                     self._sampling(body, max_tokens[p], seed, logprobs, spec, prompt_logprobs)))
        try:
            group = SequenceGroup(state.engine, state.metrics, request, specs, arrival)
        except ValueError as e:  # e.g. prompt + max_tokens beyond the KV cache
            raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        state.groups.add(group)
        group.on_close.append(self._unregister)
        return group.start()
