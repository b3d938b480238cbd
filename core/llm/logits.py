"""Logits processing (penalties, bias, min_tokens, grammar masks) and raw logprobs.

Only sequences whose parameters ask for it come here (``Sequence.plain`` is
False); plain ones keep the engine's batched argmax / ``sample`` path.

The order is vLLM's: min_tokens mask, logit_bias, repetition penalty, then
frequency/presence penalties, and the grammar mask last. Logprobs are vLLM's
default ``raw_logprobs``: the log-softmax of the model's own logits, before
any of that (and before temperature).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol, overload

import torch

from dspark.llm.sampling import SamplingParams

NEG_INF = float("-inf")


class Constraint(Protocol):
    """What ``dspark.llm.structured.build_constraint`` returns (the engine only uses these four)."""

    def allowed(self) -> torch.Tensor: ...  # bool [vocab]: tokens allowed next
    def accept(self, token: int) -> bool: ...  # advance one token; False (unchanged) if not allowed
    def rollback(self, n: int) -> None: ...  # undo the last n accepted tokens
    def is_terminated(self) -> bool: ...  # ended (after accepting EOS): nothing may follow


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's raw logprob and the ``top`` N most likely tokens (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class LogprobsPrefix(Seq[TokenLogprobs]):
    """The first ``n`` entries of a sequence's append-only logprobs list, without copying them.

    A ``RequestOutput`` is handed over while the engine goes on appending to
    the list; this view stays the length of that output's ``token_ids``.
    """

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[TokenLogprobs], n: int) -> None:
        self._items, self._n = items, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> TokenLogprobs: ...
    @overload
    def __getitem__(self, i: slice) -> list[TokenLogprobs]: ...

    def __getitem__(self, i: int | slice) -> TokenLogprobs | list[TokenLogprobs]:
        if isinstance(i, slice):
            return self._items[slice(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("logprobs index out of range")
        return self._items[i]

    def __iter__(self) -> Iterator[TokenLogprobs]:
        for i in range(self._n):
            yield self._items[i]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Seq) and len(other) == self._n and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"LogprobsPrefix({list(self)!r})"


def stop_ids(params: SamplingParams, eos_ids: set[int] | frozenset[int]) -> list[int]:
    """Tokens min_tokens blocks: stop_token_ids, and EOS unless it is ignored (as vLLM)."""
    ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        ids += sorted(eos_ids)
    return ids


def process(row: torch.Tensor, prompt_ids: Seq[int], output_ids: Seq[int], params: SamplingParams,
            constraint: Constraint | None, eos_ids: set[int] | frozenset[int]) -> torch.Tensor:
    """The processed copy of fp32 ``row`` [vocab] (``row`` itself is never written).

    ``output_ids``: the tokens generated so far, plus any draft tokens taken
    ahead of this row in speculative verification.
    """
    out = row.clone()  # ``row`` is usually a view of the step's batch of logits
    dev, V = out.device, out.shape[-1]
    if len(output_ids) < params.min_tokens:
        blocked = [t for t in stop_ids(params, eos_ids) if 0 <= t < V]
        if blocked:
            out[torch.tensor(blocked, device=dev)] = NEG_INF
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=dev)
        out[ids] += torch.tensor(list(params.logit_bias.values()), dtype=out.dtype, device=dev)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([*prompt_ids, *output_ids], device=dev).unique()
        s = out[seen]
        out[seen] = torch.where(s > 0, s / params.repetition_penalty, s * params.repetition_penalty)
    if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and len(output_ids):
        counts = torch.bincount(torch.tensor(list(output_ids), device=dev), minlength=V)[:V].to(out.dtype)
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(out.dtype)
    if constraint is not None:
        out = _mask(out, row, constraint, eos_ids)
    return out


def _mask(out: torch.Tensor, raw: torch.Tensor, constraint: Constraint, eos_ids: set[int] | frozenset[int]
          ) -> torch.Tensor:
    """The grammar mask, which wins over everything else: when min_tokens has blocked every token the
    grammar allows (it allows only EOS at its end), the grammar's choice among the raw logits stands."""
    allowed = constraint.allowed().to(out.device)
    masked = out.masked_fill(~allowed, NEG_INF)
    if bool(torch.isfinite(masked).any()):
        return masked
    if bool(allowed.any()):
        return raw.masked_fill(~allowed, NEG_INF)
    # A grammar that allows nothing at all (its own fault) ends the text rather than failing the step.
    end = torch.full_like(out, NEG_INF)
    end[min(eos_ids) if eos_ids else int(torch.argmax(raw))] = 0.0
    return end


def token_logprobs(row: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    """Raw logprob of ``token`` and the ``n`` most likely tokens under fp32 logits ``row``."""
    lp = torch.log_softmax(row.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if n > 0:
        v, i = torch.topk(lp, n)
        top = list(zip(i.tolist(), v.tolist()))
    return TokenLogprobs(token, float(lp[token]), top)


def batch_logprobs(rows: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprobs]:
    """``token_logprobs`` for each row of ``rows`` [m, vocab] in one pass (speculative verification)."""
    lp = torch.log_softmax(rows.float(), dim=-1)
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if n > 0:
        v, i = torch.topk(lp, n, dim=-1)
        tops = [list(zip(a, b)) for a, b in zip(i.tolist(), v.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprobs(t, c, top) for t, c, top in zip(tokens, chosen, tops)]

