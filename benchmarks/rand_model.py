"""A seeded random-weight Llama checkpoint (82M parameters) for the quantization benchmark's speed/bytes rows.

Usage: .venv/bin/python benchmarks/rand_model.py [--out DIR] [--force]

Same architecture family as the embedded model (Llama, SiLU MLP, GQA, RoPE,
tied embeddings, vocab 8192 and its tokenizer) but twice as wide and deep
(hidden 768, intermediate 2048, 12 layers, 12 heads, 4 KV heads: 81.8M
stored parameters, 88M counting the tied head twice; the issue's "about
90M", with the projection shapes the plugins' kernels are timed on), so
single-request decode streams 330 MB of fp32 weights per token and is bound
by weight traffic, which is what weight quantization cuts. Weights are
drawn from N(0, 0.02) with a fixed seed (norm weights 1), so every build is
bit-identical; the checkpoint is written with transformers' ``save_pretrained``
(float32 safetensors) next to the embedded model's tokenizer files and its
``heldout_files.txt``. Built once into benchmarks/out/models/random-90m and
reused while its ``config.json`` matches.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from dspark.llm.api import default_model_path

OUT = Path(__file__).resolve().parent / "out" / "models" / "random-90m"
SEED = 0
ARCH: dict[str, Any] = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
            num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=1024,
            tie_word_embeddings=True, rms_norm_eps=1e-5, initializer_range=0.02)
COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
        "heldout_files.txt")


def _config(src: Path) -> Any:  # LlamaConfig
    from transformers import LlamaConfig

    base = json.loads((src / "config.json").read_text())
    ids = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in base}
    rope = base.get("rope_parameters") or {"rope_type": "default", "rope_theta": 10000.0}
    return LlamaConfig(**ARCH, **ids, rope_parameters=rope, hidden_act="silu", attention_bias=False, mlp_bias=False)


def build(out: Path = OUT, src: Path | None = None, force: bool = False) -> Path:
    """Write the checkpoint to ``out`` unless an identical one is already there; returns ``out``."""
    src = src or default_model_path()
    cfg = _config(src)
    if not force and (out / "model.safetensors").exists() and (out / "config.json").exists():
        have = json.loads((out / "config.json").read_text())
        if all(have.get(k) == v for k, v in ARCH.items()):
            return out
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    # Explicit init, independent of transformers' _init_weights defaults across versions.
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * ARCH["initializer_range"])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in COPY:
        if (src / f).exists():
            shutil.copy2(src / f, tmp / f)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # atomic: a half-written checkpoint is never picked up as built
    return out


def num_params(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--force", action="store_true", help="rebuild even if present")
    args = ap.parse_args()
    path = build(args.out, force=args.force)
    print(f"{path}: {num_params(path) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
