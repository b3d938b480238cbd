"""Attention the graph computes itself over the past it gathers: the cpu decoder's way for what
``PagedAttentionExtension`` cannot run (soft-capped scores: Gemma 2).

The KV of a layer lives in two host arrays ``[blocks, block_size, kv_heads, head_dim]``. Each step the graph
takes the slots of every sequence's past (:func:`past_slots`), gathers those rows, appends the step's own
K/V, and attends over them with a mask per window size (:func:`masks`) that keeps each row to its own
sequence, causal order and window; it returns the step's K/V, which :func:`write` stores at the rows' slots.
Every row scores every gathered key, so a step costs rows x (past + rows): correct for any batch, meant for
the families the paged operation cannot run rather than for speed.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dspark.sdk.decoder import StepBatch


def mask_name(window: int | None) -> str:
    return "attn_mask.all" if window is None else f"attn_mask.{window}"


def _seq_of_rows(batch: StepBatch) -> np.ndarray:
    return np.repeat(np.arange(batch.num_seqs), np.diff(batch.subsequence_begins))


def past_slots(batch: StepBatch, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slots, sequence, position) of every sequence's past tokens, sequence after sequence."""
    slots, seqs, pos = [], [], []
    for s in range(batch.num_seqs):
        n = int(batch.past_lens[s])
        if n == 0:
            continue
        table = batch.block_indices[batch.block_indices_begins[s]:batch.block_indices_begins[s + 1]].astype(np.int64)
        p = np.arange(n, dtype=np.int64)
        slots.append(table[p // block_size] * block_size + p % block_size)
        seqs.append(np.full(n, s, dtype=np.int64))
        pos.append(p)
    if not slots:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    return np.concatenate(slots), np.concatenate(seqs), np.concatenate(pos)


def masks(batch: StepBatch, past_seq: np.ndarray, past_pos: np.ndarray,
          windows: Iterable[int | None]) -> dict[str, np.ndarray]:
    """Additive masks ``[rows, past + rows]`` by name: 0 where a row may attend a key, -inf elsewhere."""
    row_seq, row_pos = _seq_of_rows(batch), batch.positions.astype(np.int64)
    key_seq, key_pos = np.concatenate([past_seq, row_seq]), np.concatenate([past_pos, row_pos])
    base = (row_seq[:, None] == key_seq[None, :]) & (key_pos[None, :] <= row_pos[:, None])
    out = {}
    for w in set(windows):
        ok = base if w is None else base & (row_pos[:, None] - key_pos[None, :] < w)
        out[mask_name(w)] = np.where(ok, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
    return out


def write(cache: np.ndarray, rows: np.ndarray, slot_mapping: np.ndarray) -> None:
    """Store a step's K or V rows ``[T, kv_heads, head_dim]`` at their slots of ``cache`` (padding rows: slot < 0)."""
    flat = cache.reshape(-1, *cache.shape[2:])
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = rows[keep]
