"""Checkpoint loading: every supported variant, dtypes, shards, and the errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.llm import CheckpointError, load_checkpoint
from dspark.llm.runner.loader import load_config

from llm_testutil import VARIANTS


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loads_every_variant(checkpoint: Callable[[str], Path], variant: str) -> None:
    cfg, w = load_checkpoint(checkpoint(variant), "float32")
    assert cfg.model_type == VARIANTS[variant]["model_type"]
    assert ("lm_head.weight" in w) != cfg.tie_word_embeddings
    assert all(t.dtype == torch.float32 for t in w.values())


def test_config_normalisation(checkpoint: Callable[[str], Path]) -> None:
    assert load_config(checkpoint("qwen2")).attention_bias
    assert load_config(checkpoint("qwen2")).num_key_value_heads == 1
    lin = load_config(checkpoint("llama_linear"))
    assert lin.rope_type == "linear" and lin.rope_scaling and lin.rope_scaling["factor"] == 2.0
    assert load_config(checkpoint("llama3")).rope_theta == 500000.0


@pytest.mark.parametrize("dtype", ["bf16", "float16"])
def test_half_dtypes_load_and_run(checkpoint: Callable[[str], Path], dtype: str) -> None:
    from dspark.llm import ModelRunner, SeqChunk

    r = ModelRunner.from_pretrained(str(checkpoint("llama")), dtype)
    assert r.embed.dtype in (torch.bfloat16, torch.float16)
    cache = r.make_cache(8)
    (logits,) = r.step(cache, [SeqChunk("a", [1, 5, 9])])
    assert logits.shape == (320,) and torch.isfinite(logits).all()
    cache.free("a")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_the_runner_holds_no_page_of_the_checkpoint_once_loaded(checkpoint: Callable[[str], Path]) -> None:
    """safetensors hands out views of its mapped file; the pages the fused projections were copied from go as
    the layers are built (the rest come back from the file when read), so a loaded runner holds its weights
    once. Its outputs are those of the checkpoint."""
    from dspark.llm import ModelRunner, SeqChunk
    from dspark.sdk import mapped

    root = checkpoint("llama")
    f = root / "model.safetensors"
    r = ModelRunner.from_pretrained(str(root), "float32")
    assert mapped.resident_file(f) < f.stat().st_size // 4, (mapped.resident_file(f), f.stat().st_size)
    _, w = load_checkpoint(root, "float32")
    L = r.layers[0]
    q, k, v = (w[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(L.w_qkv_t, torch.cat([q, k, v]).t())
    gate, up = (w[f"model.layers.0.mlp.{x}_proj.weight"] for x in ("gate", "up"))
    assert torch.equal(L.w_gate_up_t, torch.cat([gate, up]).t()) and L.w_gate_up_t.is_contiguous()
    out = r.step(r.make_cache(4, 16), [SeqChunk("s", [1, 2, 3])])
    assert torch.isfinite(out[0]).all()


def test_sharded_index(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    d = _copy(checkpoint("llama"), tmp_path / "m")
    w = load_file(d / "model.safetensors")
    names = sorted(w)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in parts.items():
        save_file({n: w[n] for n in ns}, d / f)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, ns in parts.items() for n in ns}}))
    _, got = load_checkpoint(d, "float32")
    assert torch.equal(got["model.norm.weight"], w["model.norm.weight"])


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_checkpoint(tmp_path)


def test_missing_weights(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    d = _copy(checkpoint("llama"), tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights found"):
        load_checkpoint(d)


def test_unsupported_model_type(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    d = _copy(checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match=r"'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3, "
                                              r"gemma2, gemma3_text, phi3, smollm3"):
        load_checkpoint(d)


def test_wrong_shape_names_tensor_and_shapes(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    d = _copy(checkpoint("llama"), tmp_path / "m")
    w = load_file(d / "model.safetensors")
    w["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(w, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.up_proj.weight has shape \(100, 64\).*\(128, 64\)"):
        load_checkpoint(d)


def test_missing_tensor(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    d = _copy(checkpoint("llama"), tmp_path / "m")
    w = load_file(d / "model.safetensors")
    del w["model.layers.0.self_attn.k_proj.weight"]
    save_file(w, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.k_proj.weight is missing"):
        load_checkpoint(d)


def test_unsupported_rope_type(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    d = _copy(checkpoint("llama"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "mrope", "factor": 4.0, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="'mrope' is not supported; supported: default, linear, dynamic, yarn, "
                                              "longrope, llama3"):
        load_checkpoint(d)


def test_bad_dtype_names_field(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="dtype: 'int8'"):
        load_checkpoint(checkpoint("llama"), "int8")
