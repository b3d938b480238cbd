"""Perplexity and top-1 accuracy of a :class:`~dspark.llm.runner.model.ModelRunner` on token windows.

Runs the engine's own forward (paged cache, whatever kernels the runner has
installed), so a quantized runner is measured exactly as it serves.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from dspark.llm.quantization.data import heldout_texts, load_tokenizer, token_windows

if TYPE_CHECKING:
    from dspark.llm.runner.model import ModelRunner


def heldout_windows(model_path: str | Path, seq_len: int = 256, max_windows: int = 64) -> list[list[int]]:
    """Windows of the model's held-out files (``heldout_files.txt``), EOS between files."""
    from dspark.llm.runner.loader import load_config

    eos = load_config(model_path).eos_token_ids
    return token_windows(heldout_texts(model_path), load_tokenizer(model_path), seq_len=seq_len,
                         max_windows=max_windows, eos_id=eos[0] if eos else None)


@torch.inference_mode()
def nll_sum(runner: ModelRunner, windows: list[list[int]], batch: int = 8) -> tuple[float, int, int]:
    """(summed negative log-likelihood, correct top-1 predictions, predicted tokens)."""
    from dspark.llm.runner.types import SeqChunk

    longest = max(len(w) for w in windows)
    page = 16
    cache = runner.make_cache(batch * (-(-longest // page)) + 1, page)
    total, hits, n = 0.0, 0, 0
    for b in range(0, len(windows), batch):
        group = windows[b : b + batch]
        ids = [f"eval-{b + i}" for i in range(len(group))]
        chunks = [SeqChunk(seq_id=s, token_ids=w[:-1], all_logits=True) for s, w in zip(ids, group)]
        try:
            logits = runner.step(cache, chunks)
        finally:
            for s in ids:
                cache.free(s)
        for lg, w in zip(logits, group):
            tgt = torch.tensor(w[1:], dtype=torch.long)
            total += float(F.cross_entropy(lg.float(), tgt, reduction="sum"))
            hits += int((lg.argmax(-1) == tgt).sum())
            n += len(tgt)
    return total, hits, n


def perplexity(runner: ModelRunner, windows: list[list[int]], batch: int = 8) -> dict[str, float]:
    total, hits, n = nll_sum(runner, windows, batch)
    return {"perplexity": math.exp(total / n), "nll": total / n, "top1": hits / n, "tokens": n}
