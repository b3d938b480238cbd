"""LongRoPE on a plugin's compiled decoder: the torch runner's switch, and which RoPE rows each row reads.

Phi-3's LongRoPE rotates a sequence by short factors while it is at most
``original_max_position_embeddings`` long and by long factors for every position
once it is longer; its ``generate`` recomputes the whole cache at the crossing.
The torch runner does the same (``ModelRunner._longrope_switch``); for a
compiled decoder :class:`~dspark.llm.decoding.runner.DecoderRunner` does it
here: a chunk that crosses is split so each part runs in one mode, a sequence
whose chunk runs in the other mode than its cache holds is recomputed in that
mode from its tokens, and a long-mode row reads row ``position +
max_position_embeddings`` of the spec's RoPE tables (``StepBatch.rope_positions``,
``DecoderSpec.rope_at``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.types import SeqChunk


def switch(cache: PagedKVCache, chunks: list[SeqChunk], orig: int,
           recompute: Callable[[SeqChunk, bool], None]) -> list[bool]:
    """Per chunk, whether it runs in long mode; first, every sequence whose cache holds the other mode is
    recomputed in the chunk's mode (``recompute(prefix_chunk, long)``, its length set to 0 before)."""
    modes = []
    for ch in chunks:
        s = cache.seq_lens.get(ch.seq_id, 0)
        long = max(s + len(ch.token_ids), ch.prompt_len or 0) > orig
        was = ch.seq_id in cache.long_rope
        (cache.long_rope.add if long else cache.long_rope.discard)(ch.seq_id)
        if s > 0 and long != was:
            prefix = cache.tokens[ch.seq_id][:s]
            if len(prefix) != s:
                raise RuntimeError(f"sequence {ch.seq_id}: {len(prefix)} recorded tokens for {s} cached")
            cache.set_len(ch.seq_id, 0)
            recompute(SeqChunk(ch.seq_id, prefix), long)
        modes.append(long)
    return modes


def rope_positions(positions: np.ndarray, chunks: list[SeqChunk], modes: list[bool], offset: int) -> np.ndarray | None:
    """Each row's row of the RoPE tables: its position, plus ``offset`` in long mode (None: no row is)."""
    if not any(modes):
        return None
    return positions + np.repeat(np.where(modes, offset, 0), [len(ch.token_ids) for ch in chunks])
