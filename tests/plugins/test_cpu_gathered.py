"""The cpu decoder's attention over the gathered past (soft-capped models): its host side, by its contract."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.sdk.decoder import StepBatch
from dspark_plugins_cpu.decoder import gathered

BLOCK = 4


def _batch(pasts: list[int], news: list[int], tables: list[list[int]]) -> StepBatch:
    """Sequences with ``pasts[s]`` cached tokens and ``news[s]`` new rows, KV blocks ``tables[s]``."""
    pos = np.concatenate([np.arange(p, p + n) for p, n in zip(pasts, news, strict=True)]).astype(np.int64)
    slots = np.concatenate([[t[q // BLOCK] * BLOCK + q % BLOCK for q in range(p, p + n)]
                            for p, n, t in zip(pasts, news, tables, strict=True)]).astype(np.int64)
    return StepBatch(positions=pos, past_lens=np.array(pasts, np.int32),
                     subsequence_begins=np.cumsum([0, *news]).astype(np.int32),
                     block_indices=np.concatenate(tables).astype(np.int32),
                     block_indices_begins=np.cumsum([0, *map(len, tables)]).astype(np.int32),
                     slot_mapping=slots, max_context_len=max(p + n for p, n in zip(pasts, news, strict=True)),
                     logit_rows=np.array([sum(news) - 1], np.int64), input_ids=np.zeros(len(pos), np.int64))


def test_the_past_is_read_from_each_sequences_own_blocks() -> None:
    b = _batch([6, 0, 3], [1, 2, 2], [[5, 2], [7], [1, 3]])
    slots, seqs, pos = gathered.past_slots(b, BLOCK)
    assert seqs.tolist() == [0] * 6 + [2] * 3 and pos.tolist() == [*range(6), *range(3)]
    assert slots.tolist() == [20, 21, 22, 23, 8, 9, 4, 5, 6]  # block 5 then 2; block 1


@pytest.mark.parametrize("window", [None, 1, 3])
def test_each_row_sees_its_own_sequence_in_causal_order_within_the_window(window: int | None) -> None:
    b = _batch([6, 0, 3], [1, 2, 2], [[5, 2], [7], [1, 3]])
    _, seqs, pos = gathered.past_slots(b, BLOCK)
    m = gathered.masks(b, seqs, pos, [window])[gathered.mask_name(window)]
    key_seq = np.concatenate([seqs, [0, 1, 1, 2, 2]])
    key_pos = np.concatenate([pos, b.positions])
    assert m.shape == (5, len(key_seq))
    for r, (s, p) in enumerate(zip([0, 1, 1, 2, 2], b.positions, strict=True)):
        seen = {(int(key_seq[j]), int(key_pos[j])) for j in np.flatnonzero(m[r] == 0)}
        lo = 0 if window is None else max(0, p - window + 1)
        assert seen == {(s, q) for q in range(lo, p + 1)}, (r, seen)
        assert np.all(np.isneginf(m[r][m[r] != 0]))


def test_a_steps_rows_are_stored_at_their_slots_and_padding_is_dropped() -> None:
    cache = np.zeros((3, BLOCK, 2, 4), np.float32)
    rows = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4) + 1
    gathered.write(cache, rows, np.array([5, -1, 11]))
    assert np.array_equal(cache[1, 1], rows[0]) and np.array_equal(cache[2, 3], rows[2])
    assert np.count_nonzero(cache) == 2 * rows[0].size  # the padding row went nowhere
