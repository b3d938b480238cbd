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
    """The processed copy of fp32 ``row`` [vocab] (``row`` itself is never written): ``process_batch``
    for one row that no sequence holds, so its token counts are made afresh from ``output_ids``.

    ``output_ids``: the tokens generated so far, plus any draft tokens taken
    ahead of this row in speculative verification.
    """
    view = _RowView(prompt_ids, output_ids, params, constraint)
    return process_batch(row[None], [view], eos_ids)[0]


@dataclass
class _RowView:
    """What ``process_batch`` reads of a sequence."""

    prompt_ids: Seq[int]
    output_ids: Seq[int]
    params: SamplingParams
    constraint: Constraint | None
    penalty_counts: Any = None


def _fallback(raw: torch.Tensor, allowed: torch.Tensor, eos_ids: set[int] | frozenset[int]) -> torch.Tensor:
    """A row the grammar mask left without a finite logit (min_tokens blocked the EOS that is all the
    grammar allows at its end): the grammar wins, choosing among the raw logits."""
    if bool(allowed.any()):
        return raw.masked_fill(~allowed, NEG_INF)
    # A grammar that allows nothing at all (its own fault) ends the text rather than failing the step.
    end = torch.full_like(raw, NEG_INF)
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



class PenaltyCounts:
    """One sequence's output-token counts [vocab] and the prompt's tokens [vocab], kept up to date
    from ``output_ids`` as it grows, so a step costs the new tokens, not the whole history."""

    def __init__(self, prompt_ids: Seq[int], vocab: int) -> None:
        self.vocab = vocab
        self.prompt_seen = torch.zeros(vocab, dtype=torch.bool)
        ids = [t for t in prompt_ids if 0 <= t < vocab]
        if ids:
            self.prompt_seen[torch.tensor(ids)] = True
        self.counts = torch.zeros(vocab)
        self.n = 0

    def sync(self, output_ids: Seq[int]) -> PenaltyCounts:
        if len(output_ids) < self.n:  # never happens today (outputs only grow); recount rather than be wrong
            self.counts.zero_()
            self.n = 0
        new = [t for t in output_ids[self.n:] if 0 <= t < self.vocab]
        if new:
            self.counts.index_add_(0, torch.tensor(new), torch.ones(len(new)))
        self.n = len(output_ids)
        return self


def process_batch(rows: torch.Tensor, seqs: Seq[Any], eos_ids: set[int] | frozenset[int]) -> torch.Tensor:
    """The processed copy of every row of ``rows`` [R, vocab] (row r belongs to ``seqs[r]``, a
    :class:`~dspark.llm.scheduler.Sequence` or anything with its fields, with its generated tokens so
    far), in the module's order, as a few batched tensor operations for the whole step rather than a
    dozen small ones per row. A sequence's token counts are kept on it (``penalty_counts``) and
    brought up to date from the tokens appended since."""
    out = rows.clone()  # ``rows`` is usually a view of the step's batch of logits
    R, V = out.shape
    dev = out.device
    ps = [s.params for s in seqs]
    ri: list[int] = []
    ti: list[int] = []
    for r, (s, p) in enumerate(zip(seqs, ps)):
        if len(s.output_ids) < p.min_tokens:
            blocked = [t for t in stop_ids(p, eos_ids) if 0 <= t < V]
            ri += [r] * len(blocked)
            ti += blocked
    if ri:
        out[torch.tensor(ri, device=dev), torch.tensor(ti, device=dev)] = NEG_INF
    ri, ti, bv = [], [], []
    for r, p in enumerate(ps):
        for t, b in p.logit_bias.items():
            ri.append(r)
            ti.append(t)
            bv.append(b)
    if ri:
        out.index_put_((torch.tensor(ri, device=dev), torch.tensor(ti, device=dev)),
                       torch.tensor(bv, dtype=out.dtype, device=dev), accumulate=True)
    rep = [r for r, p in enumerate(ps) if p.repetition_penalty != 1.0]
    pen = [r for r, (s, p) in enumerate(zip(seqs, ps))
           if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and s.output_ids]
    if rep or pen:
        counts = {r: _counts(seqs[r], V) for r in {*rep, *pen}}
        if rep:
            seen = torch.stack([counts[r].prompt_seen | (counts[r].counts > 0) for r in rep]).to(dev)
            k = torch.tensor([ps[r].repetition_penalty for r in rep], dtype=out.dtype, device=dev)[:, None]
            sub = out[rep]
            out[rep] = torch.where(seen, torch.where(sub > 0, sub / k, sub * k), sub)
        if pen:
            c = torch.stack([counts[r].counts for r in pen]).to(device=dev, dtype=out.dtype)
            f = torch.tensor([ps[r].frequency_penalty for r in pen], dtype=out.dtype, device=dev)[:, None]
            pr = torch.tensor([ps[r].presence_penalty for r in pen], dtype=out.dtype, device=dev)[:, None]
            out[pen] = out[pen] - (f * c + pr * (c > 0).to(out.dtype))
    gram = [r for r, s in enumerate(seqs) if s.constraint is not None]
    if gram:
        allowed = _allowed([seqs[r].constraint for r in gram]).to(dev)
        masked = out[gram].masked_fill(~allowed, NEG_INF)
        ok = torch.isfinite(masked).any(-1).tolist()
        for j, r in enumerate(gram):
            if not ok[j]:  # rare: the mask left no finite logit, and the grammar's choice wins
                masked[j] = _fallback(rows[r], allowed[j], eos_ids)
        out[gram] = masked
    return out


def _allowed(constraints: list[Constraint]) -> torch.Tensor:
    """Bool [len, vocab] of ``allowed()``; a constraint type with a ``batch_allowed`` does them together."""
    kind = type(constraints[0])
    batch = getattr(kind, "batch_allowed", None)
    if batch is not None and all(type(c) is kind for c in constraints):
        return batch(constraints)  # type: ignore[no-any-return]
    return torch.stack([c.allowed() for c in constraints])


def _counts(seq: Any, vocab: int) -> PenaltyCounts:
    pc = getattr(seq, "penalty_counts", None)
    if pc is None or pc.vocab != vocab:
        pc = seq.penalty_counts = PenaltyCounts(seq.prompt_ids, vocab)
    return pc.sync(seq.output_ids)


def argmax_last(x: torch.Tensor) -> Any:
    """``x.argmax(-1).tolist()``, through numpy for CPU rows: torch's argmax over [9, 8192] took 26 us in float32
    and 133 us in bfloat16, numpy's 4 and 10 (with the cast). The first maximum, as torch's."""
    if x.device.type == "cpu" and not x.requires_grad:
        return (x if x.dtype == torch.float32 else x.float()).numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


def as_batch(rows: Seq[torch.Tensor]) -> torch.Tensor:
    """Rows [vocab] as one tensor [n, vocab]: rows that are consecutive views of one tensor (a compiled
    decoder's logits) are read in place, others stacked."""
    first = rows[0]
    n, v = len(rows), first.shape[-1]
    flat = (first.device.type == "cpu" and first.dtype == torch.float32 and first.is_contiguous()
            and all(r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                    and r.storage_offset() == first.storage_offset() + i * v for i, r in enumerate(rows)))
    return first.as_strided((n, v), (v, 1)) if flat else torch.stack(list(rows))


def argmax_rows(rows: Seq[torch.Tensor]) -> list[int]:
    """Greedy picks of several fp32 rows at once (read in place where they can be: ``as_batch``); numpy's
    argmax over a batch on the CPU is several times faster than torch's."""
    if len(rows) == 1:  # one request at a time
        return [int(argmax_last(rows[0]))]
    return argmax_last(as_batch(rows))  # type: ignore[no-any-return]
