"""One engine step as a :class:`~dspark.sdk.decoder.StepBatch`: the engine's block tables flattened."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dspark.sdk.decoder import StepBatch

if TYPE_CHECKING:
    from dspark.llm.runner.kv_cache import PagedKVCache
    from dspark.llm.runner.model import SeqChunk


def build_batch(cache: PagedKVCache, chunks: list[SeqChunk], exit_layer: int | None = None) -> StepBatch:
    """Reserve the chunks' pages (all or nothing per chunk, as the torch runner does) and lay the
    step out flat. Lengths are not advanced here: the caller does that once the step succeeded."""
    ps = cache.page_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    past: list[int] = []
    begins = [0]
    blocks: list[int] = []
    bbegins = [0]
    rows: list[int] = []
    ctx = 0
    for ch in chunks:
        n = len(ch.token_ids)
        if n == 0:
            raise ValueError(f"sequence {ch.seq_id}: empty chunk")
        s = cache.seq_lens.get(ch.seq_id, 0)
        cache.reserve(ch.seq_id, s + n)
        table = cache.block_tables[ch.seq_id]
        o = len(ids)
        ids.extend(ch.token_ids)
        for p in range(s, s + n):
            pos.append(p)
            slots.append(table[p // ps] * ps + p % ps)
        past.append(s)
        begins.append(o + n)
        blocks.extend(table)
        bbegins.append(len(blocks))
        if ch.all_logits:
            rows.extend(range(o, o + n))
        else:
            rows.append(o + n - 1)
        ctx = max(ctx, s + n)
    return StepBatch(
        input_ids=np.asarray(ids, dtype=np.int64), positions=np.asarray(pos, dtype=np.int64),
        past_lens=np.asarray(past, dtype=np.int32), subsequence_begins=np.asarray(begins, dtype=np.int32),
        block_indices=np.asarray(blocks, dtype=np.int32), block_indices_begins=np.asarray(bbegins, dtype=np.int32),
        slot_mapping=np.asarray(slots, dtype=np.int64), max_context_len=ctx,
        logit_rows=np.asarray(rows, dtype=np.int64), exit_layer=exit_layer)


def split_logits(chunks: list[SeqChunk], logits: object) -> list[object]:
    """Per chunk its rows of the step's logits ``[R, vocab]``: ``[vocab]``, or ``[n, vocab]`` for a
    chunk that wanted all its rows (the layout ``ModelRunner.step`` returns)."""
    out: list[object] = []
    r = 0
    for ch in chunks:
        if ch.all_logits:
            n = len(ch.token_ids)
            out.append(logits[r : r + n])  # type: ignore[index]
            r += n
        else:
            out.append(logits[r])  # type: ignore[index]
            r += 1
    return out
