"""Attention plans for one step, shared by all layers: which rows, which cached K/V slots, which mask.

Short chunks (decode rows, verification drafts, tiny prompts) go to the paged C
kernel where it runs (:func:`kernel_plan`); otherwise decode rows are batched
into padded SDPA calls grouped by length (:func:`decode_groups`), and every
longer chunk is one SDPA call over its gathered pages (:func:`prefill_plan`).
With a sliding window (``window``: a row sees its last this-many positions) the
SDPA plans gather only the positions in the window and mask the band.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
