"""vLLM's tokenizer endpoints: ``POST /tokenize`` and ``POST /detokenize``.

Both work in a worker thread: tokenizing megabytes of text, and encoding the
answer's token list as JSON, each take seconds that the event loop must not
lose.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from dspark.server.protocol.openai_schema import (
    APIError, DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse,
)


def add_tokenizer_routes(app: FastAPI, state: Any, *, auth: list[Any], errors: dict[int | str, dict[str, Any]],
                         check_model: Callable[[str], None],
                         render: Callable[[Any, bool], Awaitable[str]],
                         tokenize_text: Callable[[str, bool], list[int]]) -> None:
    inputs = state.engine.inputs

    @app.post("/tokenize", dependencies=auth, response_model=None,
              responses={200: {"model": TokenizeResponse}, **errors})
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        if body.model is not None:
            check_model(body.model)
        if inputs.tokenizer is None:
            raise APIError(400, "this checkpoint has no tokenizer.json")
        if isinstance(body, TokenizeChatRequest):
            text = await render(body.messages, body.add_generation_prompt)
            special = state.chat_template.adds_special_tokens
        else:
            text, special = body.prompt, body.add_special_tokens
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the text is not valid Unicode (a lone surrogate?)") from None

        def work() -> bytes:
            ids = tokenize_text(text, special)
            strs = [state.token_text.token_str(t) for t in ids] if body.return_token_strs else None
            return json.dumps({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                               "token_strs": strs}, ensure_ascii=False, separators=(",", ":")).encode()

        return Response(await asyncio.to_thread(work), media_type="application/json")

    @app.post("/detokenize", dependencies=auth, responses=errors)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        if body.model is not None:
            check_model(body.model)
        if inputs.tokenizer is None:
            raise APIError(400, "this checkpoint has no tokenizer.json")
        vocab = inputs.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(inputs.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)
