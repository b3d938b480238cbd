"""Tiny random checkpoints of every supported family, written by transformers itself (no downloads).

The variants are the conformance kit's (:data:`dspark.testing.FAMILIES`), with a
tokenizer trained beside them so the engine can run them from text.
"""

from __future__ import annotations

from pathlib import Path

from llm_testutil import VOCAB, train_tokenizer

from dspark.testing import FAMILIES as _KIT
from dspark.testing import tiny_checkpoint
from dspark.testing.decoder_kit import WINDOW

__all__ = ["FAMILIES", "WINDOW", "make_family_checkpoint"]

# What the family tests cover: each family's own additions (the plain Llama variants are the loader's tests).
FAMILIES = {k: v for k, v in _KIT.items() if k not in ("llama", "llama3", "qwen2")}


def make_family_checkpoint(out: Path, variant: str, seed: int = 0) -> Path:
    tiny_checkpoint(out, variant, seed, vocab_size=VOCAB)
    train_tokenizer(out)
    return out
