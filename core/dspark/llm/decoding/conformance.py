"""Does a compiled decoder compute what the torch reference does? A scenario shared by the engine's
probe step, the plugins' tests and third-party plugin authors.

The scenario mixes what the engine sends: two prompts prefilled in one step (one of them in two
chunks), batched decode steps, and a verified draft (every row's logits) with a rollback after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dspark.llm.decoding.batch import build_batch, split_logits
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.model import ModelRunner, SeqChunk
from dspark.sdk.decoder import CompiledDecoder


@dataclass
class Conformance:
    max_abs_diff: float  # over every logit compared
    rows: int  # logit rows compared
    argmax_flips: int  # rows whose argmax differs from the reference's

    @property
    def flip_rate(self) -> float:
        return self.argmax_flips / max(1, self.rows)


def _as_tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))


def compare(decoder: CompiledDecoder, runner: ModelRunner, *, seed: int = 0, prompt_lens: tuple[int, int] = (11, 37),
            decode_steps: int = 6, draft: int = 8, num_blocks: int = 64) -> Conformance:
    """Run the scenario on ``decoder`` and on ``runner`` (the torch reference), greedy tokens fed to
    both from the reference; returns how far the logits are apart."""
    g = torch.Generator().manual_seed(seed)
    vocab = runner.cfg.vocab_size
    ps = decoder.block_size
    ref = runner.make_cache(num_blocks, ps)
    mine = PagedKVCache(num_layers=runner.cfg.num_hidden_layers, num_pages=num_blocks, page_size=ps, kv_heads=1,
                        head_dim=1, device="meta")
    kv = decoder.allocate(num_blocks)
    worst, rows, flips = 0.0, 0, 0

    def step(chunks: list[SeqChunk]) -> list[torch.Tensor]:
        nonlocal worst, rows, flips
        want = runner.step(ref, chunks)
        batch = build_batch(mine, chunks)
        got = split_logits(chunks, _as_tensor(decoder.step(kv, batch)).float())
        for ch in chunks:
            mine.set_len(ch.seq_id, mine.seq_lens.get(ch.seq_id, 0) + len(ch.token_ids))
        for w, o in zip(want, got, strict=True):
            w2, o2 = w.reshape(-1, vocab).float(), o.reshape(-1, vocab)
            worst = max(worst, float((w2 - o2).abs().max()))
            rows += w2.shape[0]
            flips += int((w2.argmax(-1) != o2.argmax(-1)).sum())
        return want

    a, b = (torch.randint(4, vocab, (n,), generator=g).tolist() for n in prompt_lens)
    half = len(b) // 2
    out = step([SeqChunk("a", a), SeqChunk("b", b[:half])])
    out = [out[0], step([SeqChunk("b", b[half:])])[0]]
    last = [int(o.argmax()) for o in out]
    for _ in range(decode_steps):
        out = step([SeqChunk("a", [last[0]]), SeqChunk("b", [last[1]])])
        last = [int(o.argmax()) for o in out]
    drafted = [last[0], *torch.randint(4, vocab, (draft,), generator=g).tolist()]
    out = step([SeqChunk("a", drafted, all_logits=True), SeqChunk("b", [last[1]])])
    for cache in (ref, mine):  # the draft is rejected after its first token: roll back
        cache.truncate("a", draft)
    step([SeqChunk("a", [int(out[0][0].argmax())])])
    return Conformance(max_abs_diff=worst, rows=rows, argmax_flips=flips)
