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
"""

from __future__ import annotations

import torch


def accept_greedy(draft: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """``logits`` [len(draft) + 1, vocab] -> (tokens to emit, number of draft tokens accepted)."""
    best = torch.argmax(logits, dim=-1).tolist()
    out: list[int] = []
    for j, d in enumerate(draft):
        if best[j] != d:
            out.append(best[j])
            return out, j
        out.append(d)
    out.append(best[len(draft)])
    return out, len(draft)


def accept_sampling(draft: list[int], q: torch.Tensor | None, p: torch.Tensor,
                    gen: torch.Generator | None) -> tuple[list[int], int]:
    """Rejection rule over target distributions ``p`` [len(draft) + 1, vocab].

    ``q`` [len(draft), vocab] are the distributions the draft tokens were
    sampled from, or None for a deterministic drafter. Returns (tokens to
    emit, number of draft tokens accepted).
    """
    out: list[int] = []
    for j, d in enumerate(draft):
        pd = float(p[j, d])
        qd = 1.0 if q is None else float(q[j, d])
        u = float(torch.rand((), generator=gen))
        if qd > 0.0 and u * qd < pd:  # u < p/q without dividing
            out.append(d)
            continue
        if q is None:
            resid = p[j].clone()
            resid[d] = 0.0
        else:
            resid = (p[j] - q[j].to(p.dtype)).clamp_min_(0.0)
        if not float(resid.sum()) > 0.0:  # only reachable through rounding: p == q
            resid = p[j]
        out.append(int(torch.multinomial(resid, 1, generator=gen)))
        return out, j
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=gen)))
    return out, len(draft)
