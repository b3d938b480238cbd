"""Mixed-precision quantization: config, calibration data, fake quantization, plans, kernels via plugins."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.llm.runner.model import EMBED, HEAD, ModelRunner
from dspark.sdk.quant import quantize_weight, dequantize
from dspark.llm.config import QuantizationConfig
from dspark.llm.quantization.data import CalibrationDataError, load_jsonl, spread_windows
from dspark.llm.quantization.evaluate import perplexity
from dspark.llm.quantization.fake import fake_activations, fake_weight
from dspark.llm.quantization import QuantPlan
from dspark.llm.quantization.sensitivity import build_plan, matches
from dspark.types import QuantSpec

TINY = {"calibration_samples": 4, "calibration_seq_len": 32}


# -- config -------------------------------------------------------------------------------------

def test_config_schemes_and_aliases() -> None:
    assert QuantizationConfig.model_validate("int8_mixed").scheme == "int8_mixed"
    assert QuantizationConfig.model_validate("int8_activation_fp16_weight").scheme == "int8_mixed"
    c4 = QuantizationConfig.model_validate({"method": "int4_mixed"})
    assert (c4.method, c4.weight_bits, c4.budget, c4.speed_first) == ("auto_mixed_precision", 4, 0.04, False)
    assert QuantizationConfig(method="int8").budget == 0.01
    seed = QuantizationConfig.model_validate({"method": "auto_mixed_precision", "calibration_dataset": "c.jsonl",
                                              "sensitive_layers": ["embed_tokens", "lm_head"]})
    assert seed.calibration_data_path == Path("c.jsonl")


@pytest.mark.parametrize("bad, needle", [
    ({"method": "int3"}, "unknown quantization scheme 'int3'"),
    ({"method": "int4_mixed", "weight_bits": 8}, "implies weight_bits 4"),
    ({"method": "int8", "group_size": 0}, "group_size"),
    ({"method": "int8", "surprise": 1}, "surprise"),
])
def test_config_errors_name_the_field(bad: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        QuantizationConfig.model_validate(bad)


# -- calibration data ---------------------------------------------------------------------------

def test_jsonl_errors_name_file_and_line(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    with pytest.raises(CalibrationDataError, match="does not exist"):
        load_jsonl(f)
    f.write_text('{"text": "a"}\n\n{"text": "b"\n')
    with pytest.raises(CalibrationDataError, match=r"c.jsonl:3: not valid JSON"):
        load_jsonl(f)
    f.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(CalibrationDataError, match=r"c.jsonl:2: expected an object with a \"text\" string"):
        load_jsonl(f)
    f.write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(CalibrationDataError, match=r"c.jsonl:1: not UTF-8"):
        load_jsonl(f)
    f.write_text("\n\n")
    with pytest.raises(CalibrationDataError, match="no calibration texts"):
        load_jsonl(f)
    f.write_text('{"text": "x = 1"}\n{"text": "y = 2"}\n')
    assert load_jsonl(f) == ["x = 1", "y = 2"]


def test_spread_windows_take_turns_across_texts() -> None:
    class Tok:
        def encode(self, t: str, add_special_tokens: bool = False):  # one token per character
            return type("E", (), {"ids": [ord(c) for c in t]})()

    w = spread_windows(["a" * 20, "b" * 20, "c" * 5], Tok(), seq_len=4, max_windows=5)
    assert [chr(x[0]) for x in w] == ["a", "b", "c", "a", "b"]
    assert all(len(x) == 5 for x in w)


# -- fake quantization = the canonical rounding -------------------------------------------------

@pytest.mark.parametrize("bits, group", [(8, None), (4, 32), (4, 128)])
def test_fake_weight_equals_canonical(bits: int, group: int | None) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((200, 48)).astype(np.float32)  # K=200: ragged for both group sizes
    spec = QuantSpec(weight_bits=bits, granularity="per_channel" if group is None else "group",
                     group_size=group or 128)
    want = dequantize(quantize_weight(w, spec))
    got = fake_weight(torch.from_numpy(w), bits, group).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert not np.allclose(got, w, atol=1e-4)  # it did quantize


def test_fake_activations_per_token() -> None:
    x = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 0.0], [100.0, 1.0, -3.0]])
    y = fake_activations(x)
    assert torch.equal(y[1], x[1])
    assert torch.allclose(y[0], x[0], atol=1.0 / 127)  # row 0's step is 1/127
    assert y[2, 1] == pytest.approx(round(1.0 / (100 / 127)) * 100 / 127)  # a small value next to an outlier


def test_sensitive_layer_patterns() -> None:
    assert matches("model.layers.3.mlp.down_proj", ["down_proj"]) == "down_proj"
    assert matches("model.layers.3.mlp.down_proj", ["model.layers.*.mlp.*"]) == "model.layers.*.mlp.*"
    assert matches("model.layers.13.mlp.down_proj", ["layers.1."]) is None
    assert matches(EMBED, ["embed_tokens", "lm_head"]) == "embed_tokens"


# -- plans ---------------------------------------------------------------------------------------

def test_mixed_plan_respects_budget_and_forced_layers(checkpoint) -> None:
    path = checkpoint("llama")
    runner = ModelRunner.from_pretrained(str(path), "float32")
    cfg = QuantizationConfig(method="int4_mixed", max_drop=0.0, sensitive_layers=["lm_head"], **TINY)
    plan = build_plan(runner, path, cfg)
    assert runner.linear_fn(runner.linear_names()[0]) is None and runner.embed_q is None  # left float
    by = {lp.name: lp for lp in plan.layers}
    assert by[HEAD].precision == "float" and "sensitive_layers" in by[HEAD].reason
    assert by[EMBED].precision in ("int8", "float")  # no int4 gather
    # A zero budget forces accuracy control to move layers up; each move is explained.
    moved = [lp for lp in plan.layers if lp.reason.startswith("moved up")]
    assert moved and plan.calibration["accuracy_control_steps"] >= len(moved)
    assert plan.calibration["drop"] <= 0.0 or all(lp.precision == "float" for lp in plan.layers)
    for lp in plan.layers:
        if lp.kind == "linear" and HEAD != lp.name:
            assert "int4" in lp.sensitivity  # every layer measured alone at its lowest rung
    table = plan.table()
    assert "lm_head" in table and "sensitive_layers" in table and "budget 0.0%" in table
    assert QuantPlan.model_validate_json(plan.to_json()) == plan


def test_unknown_sensitive_layer_is_an_error(checkpoint) -> None:
    path = checkpoint("llama")
    runner = ModelRunner.from_pretrained(str(path), "float32")
    with pytest.raises(ValueError, match=r"sensitive_layers: 'attention\.wq' matches no layer"):
        build_plan(runner, path, QuantizationConfig(method="int8", sensitive_layers=["attention.wq"], **TINY))


def test_outlier_inputs_keep_float_activations(checkpoint) -> None:
    path = checkpoint("llama")
    runner = ModelRunner.from_pretrained(str(path), "float32")
    plan = build_plan(runner, path, QuantizationConfig(method="int8", outlier_threshold=1.01, **TINY))
    lin = [lp for lp in plan.layers if lp.kind == "linear"]
    assert all(lp.activations == "float" and "outliers" in lp.reason for lp in lin)  # max/rms > 1 always
    plan = build_plan(runner, path, QuantizationConfig(method="int8", outlier_threshold=1e6, **TINY))
    assert all(lp.activations == "dynamic_int8" for lp in plan.layers if lp.kind == "linear")


# -- kernels through the plugins -------------------------------------------------------------------

@pytest.mark.parametrize("variant, scheme", [("llama", "int8"), ("llama_tied_mha", "int4"), ("qwen2", "int4")])
def test_applied_kernels_match_fake_quantization(checkpoint, variant: str, scheme: str) -> None:
    from dspark.llm.quantization.apply import apply_plan
    from dspark.llm.quantization.data import calibration_windows

    path = checkpoint(variant)
    runner = ModelRunner.from_pretrained(str(path), "float32")
    cfg = QuantizationConfig(method=scheme, prefer_speed=False, **TINY)
    plan = build_plan(runner, path, cfg)
    windows = calibration_windows(path, data_path=None, seq_len=32, samples=4, eos_id=None)
    float_ppl = perplexity(runner, windows)["perplexity"]
    float_bytes = runner.weight_bytes()
    choices = apply_plan(runner, plan, speed_first=False)
    assert {c.name for c in choices} == {lp.name for lp in plan.layers if lp.precision != "float"}
    assert all(c.runs == plan.layer(c.name).precision for c in choices)  # prefer_speed off: no float fallback
    assert all(c.bids for c in choices if c.name != EMBED)
    real = perplexity(runner, windows)["perplexity"]
    planned = plan.calibration["planned_ppl"]
    # Real kernels compute the canonical rounding (up to their accumulation order / activation scheme).
    assert real == pytest.approx(planned, rel=0.02)
    assert real != pytest.approx(float_ppl, rel=1e-6)
    ratio = runner.weight_bytes() / float_bytes
    assert ratio < (0.35 if scheme == "int8" else 0.25), ratio
    with pytest.raises(ValueError, match="float weight was dropped"):
        runner.weight_t(runner.linear_names()[0])


def test_engine_quantizes_at_load_and_generates(make_llm) -> None:
    from dspark.llm import SamplingParams

    llm = make_llm("llama", quantization={"method": "int8_mixed", **TINY})
    assert llm.plan is not None and llm.plan.scheme == "int8_mixed"
    assert llm.kernels and all(k.bids or k.name == EMBED for k in llm.kernels)
    out = llm.generate(["def f(x):", "import os"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [8, 8]


def test_optimize_model_seed_example(checkpoint) -> None:
    from dspark import optimize_model

    m = optimize_model(str(checkpoint("llama")), quantization_config={
        "method": "auto_mixed_precision", "sensitive_layers": ["embed_tokens", "lm_head"], "target_device": "cpu",
        # prefer_speed off: on this tiny model float and int8 bid within noise of each other.
        "prefer_speed": False, **TINY},
        speculative_decoding_config={"enabled": True, "draft_model": "none", "strategy": "deepspec"},
        dtype="float32")
    assert m.plan.layer(HEAD).precision == "float" and m.plan.layer(EMBED).precision == "float"
    assert m.engine.spec is not None
    assert m.weight_bytes() < ModelRunner.from_pretrained(str(checkpoint("llama")), "float32").weight_bytes()
    with pytest.raises(ValueError, match="quantization_config.target_device: 'cuda:7'"):
        optimize_model(str(checkpoint("llama")), quantization_config={"method": "int8", "target_device": "cuda:7"})
    with pytest.raises(TypeError, match="optimize_model: model must be"):
        optimize_model(42)


def test_spare_size_goes_to_the_most_sensitive_layers(checkpoint) -> None:
    path = checkpoint("llama")
    runner = ModelRunner.from_pretrained(str(path), "float32")
    base = build_plan(runner, path, QuantizationConfig(method="int4_mixed", max_drop=1.0, **TINY))
    ratio = base.weight_bytes() / base.float_bytes() + 0.05
    plan = build_plan(runner, path, QuantizationConfig(method="int4_mixed", max_drop=1.0, max_weight_ratio=ratio,
                                                       **TINY))
    spent = [lp for lp in plan.layers if "spare size" in lp.reason]
    assert spent, plan.table()
    assert base.weight_bytes() < plan.weight_bytes() <= ratio * plan.float_bytes()
    # The first layer moved is the one with the most measured harm per added byte among the int4 ones.
    def per_byte(lp):
        up = lp.model_copy(update={"precision": "int8", "group_size": None})
        return lp.sensitivity["int4"] / (up.weight_bytes() - lp.weight_bytes())
    int4 = [lp for lp in base.layers if lp.precision == "int4" and lp.sensitivity.get("int4", 0) > 0]
    best = max(int4, key=per_byte)
    assert plan.layer(best.name).precision != "int4"
