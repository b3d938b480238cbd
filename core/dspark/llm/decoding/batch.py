"""One engine step as a :class:`~dspark.sdk.decoder.StepBatch`: the engine's block tables flattened."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dspark.sdk.decoder import SeqBatch, StepBatch

if TYPE_CHECKING:
    from dspark.llm.runner.kv_cache import PagedKVCache
    from dspark.llm.runner.types import SeqChunk


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


class SeqKV:
    """A per-sequence target's KV store and what it holds: the engine's sequence keys mapped to the
    stable integer ids the target sees, and how many positions the target keeps for each."""

    def __init__(self, store: object) -> None:
        self.store = store
        self.ids: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self._next = 0

    def drops(self, cache: PagedKVCache) -> list[tuple[int, int]]:
        """What the engine dropped since the last step: rolled-back positions, freed sequences."""
        out = []
        for key, n in list(self.held.items()):
            have = cache.seq_lens.get(key, 0)
            if have < n:
                out.append((self.ids[key], have))
                if have == 0:  # freed (or preempted and requeued): the id is not used again
                    del self.held[key], self.ids[key]
                else:
                    self.held[key] = have
        return out

    def id_of(self, key: str) -> int:
        sid = self.ids.get(key)
        if sid is None:
            sid = self.ids[key] = self._next
            self._next += 1
        return sid

    def advanced(self, chunks: list[SeqChunk], cache: PagedKVCache) -> None:
        for ch in chunks:
            self.held[ch.seq_id] = cache.seq_lens[ch.seq_id]


def build_seq_batch(cache: PagedKVCache, kv: SeqKV, chunks: list[SeqChunk],
                    exit_layer: int | None = None) -> SeqBatch:
    """The step for a target that keeps its KV per sequence: the drops since its last step, then the
    new rows. Pages are still reserved: they are the engine's count of what each sequence holds."""
    drops = kv.drops(cache)
    sids: list[int] = []
    ids: list[int] = []
    pos: list[int] = []
    rows: list[int] = []
    for ch in chunks:
        n = len(ch.token_ids)
        if n == 0:
            raise ValueError(f"sequence {ch.seq_id}: empty chunk")
        s = cache.seq_lens.get(ch.seq_id, 0)
        cache.reserve(ch.seq_id, s + n)
        o = len(ids)
        sids.extend([kv.id_of(ch.seq_id)] * n)
        ids.extend(ch.token_ids)
        pos.extend(range(s, s + n))
        if ch.all_logits:
            rows.extend(range(o, o + n))
        else:
            rows.append(o + n - 1)
    return SeqBatch(seq_ids=np.asarray(sids, dtype=np.int64), input_ids=np.asarray(ids, dtype=np.int64),
                    positions=np.asarray(pos, dtype=np.int64), logit_rows=np.asarray(rows, dtype=np.int64),
                    drops=drops, exit_layer=exit_layer)


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
