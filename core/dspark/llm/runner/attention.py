"""One layer's attention over the paged KV cache, for every row of a step.

The step's plans (attention_plan.py) are built once and shared by all layers
with the same sliding window: one set for full attention, one per window the
model has (a window no row of the step reaches past is full attention, and
shares that set). The paged C kernel takes the window and the soft-cap as
arguments; where the kernel does not run, SDPA takes the rows, except for
soft-capped scores (Gemma 2), which SDPA cannot express: those go through
plain matmul and softmax, as transformers' eager attention computes them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dspark.llm.runner.attention_plan import (
    KERNEL_MAX_CHUNK,
    decode_groups,
    kernel_plan,
    prefill_plan,
)
from dspark.llm.runner.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from dspark.llm.runner.types import SeqChunk

DecodePlan = list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]]
PrefillPlan = list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
         scale: float | None, softcap: float | None) -> torch.Tensor:
    """Attention of q [..., H, n, D] over k, v [..., KVH, L, D]; ``mask`` True = visible."""
    H, KVH = q.shape[-3], k.shape[-3]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=H != KVH)
    if H != KVH:
        k, v = k.repeat_interleave(H // KVH, dim=-3), v.repeat_interleave(H // KVH, dim=-3)
    s = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = torch.tanh(s / softcap) * softcap
    if causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


class StepAttention:
    """The attention plans of one step, per window; called per layer."""

    def __init__(self, cache: PagedKVCache, chunks: list[SeqChunk], starts: list[int], offsets: list[int],
                 kern: Any, windows: Iterable[int | None]) -> None:
        self.kern = kern
        longest = max(s + len(ch.token_ids) for s, ch in zip(starts, chunks))
        # Short chunks (decode rows, verification drafts, tiny prompts) go to the paged kernel when it runs
        # here; otherwise decode rows are batched SDPA groups and every longer chunk is one SDPA call.
        self.kplan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if kern is not None:
            short = [i for i, ch in enumerate(chunks) if len(ch.token_ids) <= KERNEL_MAX_CHUNK]
            self.kplan = kernel_plan(cache, chunks, starts, offsets, short) if short else None
            dec: list[int] = []
            pre = [i for i, ch in enumerate(chunks) if len(ch.token_ids) > KERNEL_MAX_CHUNK]
        else:
            dec = [i for i, ch in enumerate(chunks) if len(ch.token_ids) == 1]
            pre = [i for i, ch in enumerate(chunks) if len(ch.token_ids) > 1]
        self.effective: dict[int | None, int | None] = {}
        self.plans: dict[int | None, tuple[DecodePlan, PrefillPlan]] = {}
        for w in set(windows) | {None}:
            eff = None if w is None or w >= longest else w
            self.effective[w] = eff
            if eff not in self.plans:
                self.plans[eff] = (decode_groups(cache, chunks, starts, offsets, dec, eff),
                                   prefill_plan(cache, chunks, starts, offsets, pre, eff))

    def to(self, d: torch.device) -> None:
        """Move the plans' tensors to ``d`` (the next layer runs there)."""
        for w, (dec, pre) in self.plans.items():
            self.plans[w] = ([(r.to(d), g, s.to(d), None if m is None else m.to(d)) for r, g, s, m in dec],
                             [(o, n, p.to(d), f, None if m is None else m.to(d)) for o, n, p, f, m in pre])

    def __call__(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, *, window: int | None,
                 scale: float | None, softcap: float | None) -> torch.Tensor:
        """Attention output [T, H, D] for q [T, H, D] over the layer's pages ``kc``, ``vc`` (this step's
        K/V already written); ``scale`` None = head_dim ** -0.5."""
        T, H, D = q.shape
        KVH = kc.shape[2]
        w = self.effective[window]
        dec, pre = self.plans[w]
        # A decode-only step with one group has its rows already in order: no gather/scatter of q.
        whole = not pre and len(dec) == 1
        attn = None if whole else torch.empty(T, H, D, dtype=q.dtype, device=q.device)
        if self.kplan is not None:
            assert attn is not None
            self.kern(q, attn, kc, vc, *self.kplan, D ** -0.5 if scale is None else scale, w, softcap)
        kflat, vflat = kc.view(-1, KVH, D), vc.view(-1, KVH, D)
        for rows, glen, slots, mask in dec:
            B = rows.shape[0]
            qd = (q if whole else q.index_select(0, rows)).unsqueeze(2)  # [B, H, 1, D]
            kd = kflat.index_select(0, slots).view(B, glen, KVH, D).transpose(1, 2)
            vd = vflat.index_select(0, slots).view(B, glen, KVH, D).transpose(1, 2)
            out = sdpa(qd, kd, vd, mask, False, scale, softcap)
            if attn is None:
                attn = out.squeeze(2)
            else:
                attn.index_copy_(0, rows, out.squeeze(2))
        for off, n, pages, first, mask in pre:
            L_ = n if mask is None else mask.shape[1]
            qp = q[off : off + n].transpose(0, 1).unsqueeze(0)
            kp = kc[pages].view(-1, KVH, D)[first : first + L_].transpose(0, 1).unsqueeze(0)
            vp = vc[pages].view(-1, KVH, D)[first : first + L_].transpose(0, 1).unsqueeze(0)
            out = sdpa(qp, kp, vp, mask, mask is None, scale, softcap)
            assert attn is not None
            attn[off : off + n] = out[0].transpose(0, 1)
        assert attn is not None
        return attn
