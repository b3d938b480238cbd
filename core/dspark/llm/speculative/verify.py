"""Lossless verification of drafted tokens against the target's logits.

Greedy: keep the longest prefix of the draft that matches the target's
argmax, then the target's own token at the first mismatch (or the bonus
token after a fully accepted draft): exactly what plain greedy decoding emits.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``x`` drawn
from ``q`` is kept with probability ``min(1, p(x) / q(x))``; on rejection one
token is drawn from the normalised residual ``max(0, p - q)`` and the step
ends; after a fully accepted draft a bonus token is drawn from ``p``. Every
emitted token is then distributed exactly as plain sampling from ``p``. A
deterministic drafter (no ``q``) is the case ``q = one-hot(x)``.

Sequences with processed logits (penalties, bias, min_tokens, a grammar) or
logprobs are verified row by row over full logits (``accept_processed``):
row j is processed as plain decoding would after the tokens emitted before
it, so both rules above stay exact; logprobs come from the target's raw rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dspark.llm.logits import Constraint, TokenLogprobs, argmax_last, batch_logprobs, process
from dspark.llm.sampling import distribution

if TYPE_CHECKING:
    from dspark.llm.scheduler import ScheduledChunk, Sequence

# Rows of logits computed first in blockwise greedy verification. A draft usually breaks
# early, and the LM head is a large share of a verified token's cost: past the first
# mismatch its rows are never computed.
HEAD_BLOCK = 8


def accept_greedy(draft: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """``logits`` [len(draft) + 1, vocab] -> (tokens to emit, number of draft tokens accepted)."""
    toks, n_acc, _ = accept_greedy_blocks([draft], [logits], lambda rows: rows, block=len(draft) + 1)[0]
    return toks, n_acc


def split(k: int, block: int = HEAD_BLOCK) -> bool:
    """Whether a greedy draft of k tokens gets its logits in two parts (first block, then the rest)."""
    return k + 1 > 2 * block


def head_rows(k: int, p_first_block: float, block: int = HEAD_BLOCK) -> float:
    """Expected drafted rows of a k-token greedy draft whose logits get computed, given the
    probability that its first ``block`` tokens are all accepted."""
    return float(k) if not split(k, block) else (block - 1) + p_first_block * (k + 1 - block)


def accept_greedy_blocks(drafts: list[list[int]], hidden: list[torch.Tensor],
                         head: Callable[[torch.Tensor], torch.Tensor],
                         block: int = HEAD_BLOCK) -> list[tuple[list[int], int, int]]:
    """``accept_greedy`` for many drafts, computing the logits of long drafts in two parts.

    ``hidden[i]``: the final-normed hidden rows [len(drafts[i]) + 1, hidden] of
    draft i's verification chunk; ``head`` maps rows to logits. The head runs
    once over the first ``block`` rows of every long draft (``split``) and all
    rows of the others, then once over the remaining rows of every long draft
    that matched all through its first block: a long draft that breaks early
    never pays for the rest of its rows, one that holds pays for two head
    calls, not one.
    Returns per draft (tokens to emit, accepted, rows of logits computed).
    """
    out: list[list[int]] = [[] for _ in drafts]
    result: list[tuple[list[int], int, int] | None] = [None] * len(drafts)
    pos = [0] * len(drafts)
    active = list(range(len(drafts)))
    first = True
    while active:
        # A draft that held for a whole block likely holds on: the rest in one go. Drafts of up to two
        # blocks run whole at once: the rows saved would not pay for a second call.
        parts = [hidden[i][pos[i]:pos[i] + block] if first and split(len(drafts[i]), block) else hidden[i][pos[i]:]
                 for i in active]
        first = False
        best = argmax_last(head(torch.cat(parts) if len(parts) > 1 else parts[0]))
        o, still = 0, []
        for i, part in zip(active, parts):
            d, toks = drafts[i], out[i]
            for r in range(part.shape[0]):
                j, b = pos[i] + r, best[o + r]
                toks.append(b)
                if j == len(d) or b != d[j]:  # the bonus row, or the first mismatch
                    result[i] = (toks, j, pos[i] + part.shape[0])
                    break
            else:
                pos[i] += part.shape[0]
                still.append(i)
            o += part.shape[0]
        active = still
    return result  # type: ignore[return-value]


def accept_row(d: int, q_row: torch.Tensor | None, p_row: torch.Tensor, gen: torch.Generator | None) -> int | None:
    """The rejection rule for one drafted token ``d``: None when it is kept, else the token drawn in its place."""
    pd = float(p_row[d])
    qd = 1.0 if q_row is None else float(q_row[d])
    u = float(torch.rand((), generator=gen))
    if qd > 0.0 and u * qd < pd:  # u < p/q without dividing
        return None
    if q_row is None:
        resid = p_row.clone()
        resid[d] = 0.0
    else:
        resid = (p_row - q_row.to(p_row.dtype)).clamp_min_(0.0)
    if not float(resid.sum()) > 0.0:  # only reachable through rounding: p == q
        resid = p_row
    return int(torch.multinomial(resid, 1, generator=gen))


def accept_sampling(draft: list[int], q: torch.Tensor | None, p: torch.Tensor,
                    gen: torch.Generator | None) -> tuple[list[int], int]:
    """Rejection rule over target distributions ``p`` [len(draft) + 1, vocab].

    ``q`` [len(draft), vocab] are the distributions the draft tokens were
    sampled from, or None for a deterministic drafter. Returns (tokens to
    emit, number of draft tokens accepted).
    """
    out: list[int] = []
    for j, d in enumerate(draft):
        got = accept_row(d, None if q is None else q[j], p[j], gen)
        if got is not None:
            out.append(got)
            return out, j
        out.append(d)
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=gen)))
    return out, len(draft)


def grammar_prefix(constraint: Constraint, draft: list[int]) -> int:
    """How many leading draft tokens the grammar allows; its state is left as it was."""
    n = 0
    for t in draft:
        if not constraint.accept(t):
            break
        n += 1
        if constraint.is_terminated():
            break  # nothing may follow the end
    constraint.rollback(n)
    return n


def clip_to_grammar(dec: list[ScheduledChunk], pend: dict[str, Any]) -> None:
    """Cut each constrained sequence's draft (``pend[rid]``, with ``tokens`` and ``q``) at the first token
    its grammar refuses: verifying past it is wasted.

    A deterministic draft loses the refused token too (it would be rejected, and the residual of a
    one-hot guess at a token of probability 0 is the target distribution itself). A draft sampled
    from ``q`` keeps it: its rejection must draw from the residual ``max(0, p - q)`` to stay exact.
    """
    for p in dec:
        s = p.seq
        d = None if s.constraint is None else pend.get(s.request_id)
        if d is None or not d.tokens:
            continue
        n = grammar_prefix(s.constraint, d.tokens)
        if d.q is not None:
            n = min(n + 1, len(d.tokens))
            d.q = d.q[:n]
        d.tokens = d.tokens[:n]


def accept_processed(seq: Sequence, draft: list[int], q: torch.Tensor | None, rows: torch.Tensor,
                     eos_ids: set[int], gen: torch.Generator | None) -> tuple[list[int], int, list[TokenLogprobs] | None]:
    """Verification of a sequence whose logits are processed (penalties, bias, min_tokens, grammar) or
    whose logprobs are wanted, over its raw target logits ``rows`` [len(draft) + 1, vocab].

    Row j is processed as plain decoding would process it after the tokens
    emitted before it, then judged as in ``accept_greedy`` / ``accept_sampling``.
    Emitted tokens advance ``seq.constraint``. Returns (tokens to emit, draft
    tokens accepted, their raw logprobs or None).
    """
    p = seq.params
    busy = p.needs_processing or seq.constraint is not None
    outs = list(seq.output_ids)
    emitted: list[int] = []
    n_acc = 0
    for j in range(len(draft) + 1):
        row = process(rows[j], seq.prompt_ids, outs, p, seq.constraint, eos_ids) if busy else rows[j]
        kept = False
        if p.greedy:
            t = int(argmax_last(row))
            kept = j < len(draft) and t == draft[j]
        elif j < len(draft):
            got = accept_row(draft[j], None if q is None else q[j], distribution(row, p), gen)
            kept = got is None
            t = draft[j] if kept else got
        else:  # the bonus token after a fully accepted draft
            t = int(torch.multinomial(distribution(row, p), 1, generator=gen))
        emitted.append(t)
        outs.append(t)
        n_acc += kept
        if seq.constraint is not None:
            seq.constraint.accept(t)
            if seq.constraint.is_terminated():
                break
        if not kept:
            break
    lps = None if p.logprobs is None else batch_logprobs(rows[: len(emitted)], emitted, p.logprobs)
    return emitted, n_acc, lps
