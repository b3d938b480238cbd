"""Engine logprobs (:class:`~dspark.llm.TokenLogprobs`) in OpenAI's two response shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from dspark.server.protocol.openai_schema import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from dspark.server.protocol.token_text import TokenText

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token the model rules out entirely reports this (vLLM's choice)


def lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def offsets(tokens: list[str]) -> list[int]:
    """Where each token's text starts, tokens laid end to end."""
    out, pos = [], 0
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out


def completion_logprobs(tt: TokenText, entries: Sequence[Any], offset: int, with_prompt: list[int] | None = None,
                        prompt_entries: Sequence[Any] | None = None) -> CompletionLogprobs:
    """The legacy completions shape; ``offset``: where the first token's text starts in the choice's text.

    ``with_prompt`` (echo): the prompt's token ids, listed first; ``prompt_entries[k]`` is the entry of
    prompt token k + 1 (the first token has no logprob: nothing comes before it).
    """
    out = CompletionLogprobs()
    rows: list[tuple[int, float | None, list[tuple[int, float]]]] = []
    if with_prompt is not None:
        pe = list(prompt_entries or [])
        for k, tid in enumerate(with_prompt):
            e = pe[k - 1] if 0 < k <= len(pe) else None
            rows.append((tid, None if e is None else e.logprob, [] if e is None else list(e.top)))
    rows += [(e.token_id, e.logprob, list(e.top)) for e in entries]
    for tid, value, top in rows:
        s = tt.token_str(tid)
        out.tokens.append(s)
        out.token_logprobs.append(None if value is None else lp(value))
        if value is None:
            out.top_logprobs.append(None)
        else:
            d = {tt.token_str(t): lp(v) for t, v in top}
            d.setdefault(s, lp(value))  # as vLLM: the chosen token is always among them
            out.top_logprobs.append(d)
        out.text_offset.append(offset)
        offset += len(s)
    return out


def chat_logprobs(tt: TokenText, entries: Sequence[Any]) -> ChatLogprobs:
    def one(t: int, v: float) -> TopLogprob:
        return TopLogprob(token=tt.token_str(t), logprob=lp(v), bytes=list(tt.token_bytes(t)))

    return ChatLogprobs(content=[ChatTokenLogprob(**one(e.token_id, e.logprob).model_dump(),
                                                  top_logprobs=[one(t, v) for t, v in e.top])
                                 for e in entries])
