"""One layer's attention over the paged KV cache, for every row of a step, and the step's plans.

Plans: short chunks (decode rows, verification drafts, tiny prompts) go to the
paged C kernel where it runs (:func:`kernel_plan`); otherwise decode rows are
batched into padded SDPA calls grouped by length (:func:`decode_groups`), and
every longer chunk is one SDPA call over its gathered pages (:func:`prefill_plan`).
With a sliding window (``window``: a row sees its last this-many positions) the
SDPA plans gather only the positions in the window and mask the band.

The step's plans are built once and shared by all layers
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

from dspark.llm.runner.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from dspark.llm.runner.types import SeqChunk

# A decode SDPA call's fixed cost, in padded-token equivalents, for grouping rows by length.
_GROUP_COST = 64
# Chunks of at most this many tokens go to the paged kernel (decode, verification, short prompts);
# longer ones to SDPA over gathered pages, which catches up with the kernel at about this size.
KERNEL_MAX_CHUNK = 64


def decode_groups(cache: PagedKVCache, chunks: list[SeqChunk], starts: list[int], offsets: list[int],
                  dec: list[int], window: int | None = None,
                  ) -> list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]]:
    """The torch path's decode attention plan: (q rows, key length, K/V slots, mask) per SDPA group."""
    # Decode rows are grouped by length (sorted, then cut where padding a row up to its
    # group's longest costs more than another SDPA call); each group gathers only its
    # own tokens' K/V slots with one index_select per layer, the slot indices built once
    # per step. Rows shorter than their group's longest mask their tail.
    dec_plan: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]] = []
    if dec:
        ps = cache.page_size
        lens = [starts[i] + 1 if window is None else min(starts[i] + 1, window) for i in dec]
        order = sorted(range(len(dec)), key=lambda r: lens[r])
        sl = [lens[r] for r in order]
        # cost[j] = cheapest split of sorted rows [0, j); a group [i, j) costs one call
        # (worth _GROUP_COST tokens) plus (j - i) rows padded to sl[j - 1].
        n = len(sl)
        cost = [0] + [0] * n
        cut = [0] * (n + 1)
        for j in range(1, n + 1):
            best, bi = _GROUP_COST + j * sl[j - 1], 0
            for i in range(1, j):
                c_ = cost[i] + _GROUP_COST + (j - i) * sl[j - 1]
                if c_ < best:
                    best, bi = c_, i
            cost[j], cut[j] = best, bi
        bounds, j = [], n
        while j > 0:
            bounds.append((cut[j], j))
            j = cut[j]
        for a, b in reversed(bounds):
            members = sorted(order[a:b])  # row order within a group is free; keep step order
            glen = sl[b - 1]
            if window is None:
                width = cache.pages_for(glen)
                pages = torch.zeros(len(members), width, dtype=torch.long)
                for r, m in enumerate(members):
                    table = cache.block_tables[chunks[dec[m]].seq_id][:width]
                    pages[r, : len(table)] = torch.tensor(table)
                slots = ((pages * ps).unsqueeze(2) + torch.arange(ps)).view(len(members), -1)[:, :glen].reshape(-1)
            else:  # each row's window: its last lens[m] positions, the padding pointing at its last one
                per_row = []
                for m in members:
                    end = starts[dec[m]] + 1
                    tab = torch.tensor(cache.block_tables[chunks[dec[m]].seq_id][: cache.pages_for(end)])
                    pos = torch.clamp(torch.arange(end - lens[m], end - lens[m] + glen), max=end - 1)
                    per_row.append(tab[pos // ps] * ps + pos % ps)
                slots = torch.cat(per_row)
            mask = None
            if sl[a] != glen:
                mlens = torch.tensor([lens[m] for m in members])
                mask = (torch.arange(glen)[None, :] < mlens[:, None])[:, None, None, :]
            rows = torch.tensor([offsets[dec[m]] for m in members], dtype=torch.long)
            dec_plan.append((rows, glen, slots, mask))
    return dec_plan


def kernel_plan(cache: PagedKVCache, chunks: list[SeqChunk], starts: list[int], offsets: list[int],
                 short: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paged kernel's plan: block tables [S, W], and per row of the step its table row and
    visible length (causal within a chunk; 0 = a row another path runs)."""
    T = offsets[-1] + len(chunks[-1].token_ids)
    tabs = [cache.block_tables[chunks[i].seq_id] for i in short]
    W = max(len(t) for t in tabs)
    row_seq, row_len = [0] * T, [0] * T
    for r, i in enumerate(short):
        off, s = offsets[i], starts[i]
        for j in range(len(chunks[i].token_ids)):
            row_seq[off + j], row_len[off + j] = r, s + j + 1
    tables = torch.tensor([t + [0] * (W - len(t)) for t in tabs], dtype=torch.int32)
    return tables, torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_len, dtype=torch.int32)


def prefill_plan(cache: PagedKVCache, chunks: list[SeqChunk], starts: list[int], offsets: list[int],
                 pre: list[int], window: int | None = None,
                 ) -> list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]:
    """Per chunk run by SDPA on its own: (first row, rows, its pages, the first key's offset into them,
    mask over cached + new keys; None = plain causal from position 0)."""
    plan: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]] = []
    ps = cache.page_size
    for i in pre:
        n, s = len(chunks[i].token_ids), starts[i]
        k0 = 0 if window is None else max(0, s - window + 1)  # the first row's earliest visible key
        pages = torch.tensor(cache.block_tables[chunks[i].seq_id][k0 // ps : cache.pages_for(s + n)])
        mask = None
        if s > 0 or (window is not None and n > window):
            kp, qp = torch.arange(k0, s + n)[None, :], torch.arange(s, s + n)[:, None]
            mask = kp <= qp if window is None else (kp <= qp) & (kp > qp - window)
        plan.append((offsets[i], n, pages, k0 % ps, mask))
    return plan


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
