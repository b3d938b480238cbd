"""Loading the checkpoint families: what is refused and why, optimized directories of a fused-projection
family, half precision, and the dense offload's SiLU-only limit."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dspark.llm import CheckpointError, ModelRunner, SeqChunk, load_checkpoint
from family_testutil import make_family_checkpoint


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = make_family_checkpoint(tmp_path_factory.mktemp(variant), variant)
        return built[variant]

    return get


def _edited(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


@pytest.mark.parametrize(("variant", "changes", "message"), [
    ("gemma3", {"model_type": "gemma3"}, "multimodal Gemma 3.*model_type 'gemma3_text'"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden activation 'relu' is not supported"),
    ("smollm3", {"mlp_bias": True}, "mlp_bias is true; smollm3 MLPs with biases are not supported"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention is true"),
    ("qwen3", {"layer_types": ["full_attention"]}, "layer_types has 1 entries for 2 layers"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, r"layer_types \['chunked_attention'\]"),
    ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries for 4 layers"),
])
def test_refusals_name_the_field(family: Callable[[str], Path], tmp_path: Path, variant: str,
                                 changes: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(_edited(family(variant), tmp_path / "m", **changes))


def test_transformers_4_config_layout(family: Callable[[str], Path], tmp_path: Path) -> None:
    """Hub configs written by transformers 4.x: rope_theta / rope_scaling apart, Gemma 3's local base,
    Phi-3's "su" LongRoPE and top-level original_max_position_embeddings."""
    g3 = json.loads((family("gemma3") / "config.json").read_text())
    old = {k: v for k, v in g3.items() if k not in ("rope_parameters", "layer_types")}
    d = tmp_path / "g3"
    shutil.copytree(family("gemma3"), d)
    (d / "config.json").write_text(json.dumps({**old, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                                               "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                               "sliding_window_pattern": 2}))
    cfg, _ = load_checkpoint(d, "float32")
    assert cfg.rope_theta == 1e6 and cfg.rope_type == "linear" and cfg.local_rope == {"rope_type": "default",
                                                                                       "rope_theta": 1e4}
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    p3 = json.loads((family("phi3_longrope") / "config.json").read_text())
    rp = p3.pop("rope_parameters")
    d = tmp_path / "p3"
    shutil.copytree(family("phi3_longrope"), d)
    (d / "config.json").write_text(json.dumps({**p3, "rope_theta": 10000.0, "rope_scaling": {
        "type": "su", "short_factor": rp["short_factor"], "long_factor": rp["long_factor"]}}))
    cfg, _ = load_checkpoint(d, "float32")
    assert cfg.rope_type == "longrope" and cfg.rope_scaling is not None
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32 and cfg.partial_rotary_factor == 0.5


@pytest.mark.parametrize("variant", ["gemma3", "qwen3", "phi4_mini"])
def test_half_precision_runs(family: Callable[[str], Path], variant: str) -> None:
    r = ModelRunner.from_pretrained(str(family(variant)), "bf16")
    c = r.make_cache(8, 4)
    (logits,) = r.step(c, [SeqChunk("a", list(range(3, 23)))])
    assert logits.shape == (320,) and torch.isfinite(logits).all()
    ref = ModelRunner.from_pretrained(str(family(variant)), "float32")
    c32 = ref.make_cache(8, 4)
    (want,) = ref.step(c32, [SeqChunk("a", list(range(3, 23)))])
    assert torch.corrcoef(torch.stack([logits, want]))[0, 1] > 0.99


def test_optimized_directory_of_fused_projections(family: Callable[[str], Path], tmp_path: Path) -> None:
    """Phi-3 stores qkv_proj and gate_up_proj fused: an int8 directory keeps them under those names."""
    from dspark.llm import LLM, SamplingParams
    from dspark.llm.quantization.convert import convert

    src = family("phi3_longrope")
    out = tmp_path / "opt"
    plan = convert(src, out, quantization={"method": "int8", "calibration_samples": 2, "calibration_seq_len": 32},
                   draft_spec="none")
    assert any(lp.precision == "int8" and lp.name.endswith("qkv_proj") for lp in plan.layers)
    _, w = load_checkpoint(out, "float32")
    _, w0 = load_checkpoint(src, "float32")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert (w[name] - w0[name]).abs().max() < 0.02 * w0[name].abs().max()
    llm = LLM(str(out), dtype="float32")
    (o,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(o.token_ids) == 5


def test_dense_offload_is_silu_only(family: Callable[[str], Path]) -> None:
    from dspark.llm.device_map.offload import setup_dense_offload

    runner = ModelRunner.from_pretrained(str(family("gemma2")), "float32")
    off, decision = setup_dense_offload(runner, "auto")
    assert off is None and "gelu_pytorch_tanh" in decision.reason
    with pytest.raises(ValueError, match="SiLU only"):
        setup_dense_offload(runner, "openvino")
