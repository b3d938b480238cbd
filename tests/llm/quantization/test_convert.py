"""``dspark convert``: optimized model directories, byte-identical twice, loaded by the engine; bad input."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.llm.runner.loader import CheckpointError
from dspark.llm.quantization.convert import (DEVICE_FILE, DRAFT_FILE, META_FILE, PLAN_FILE, WEIGHTS_FILE, ConvertError,
                                         convert)
from dspark.llm.quantization.data import CalibrationDataError

QUICK = {"method": "int8_mixed", "calibration_samples": 2, "calibration_seq_len": 32}


def _digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".partial-" in p.name]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llm_testutil import make_checkpoint

    root = tmp_path_factory.mktemp("src")
    target = make_checkpoint(root / "tiny", "llama_tied_mha")
    make_checkpoint(root / "tiny-draft", "llama_tied_mha")  # found by draft spec 'auto' (same tokenizer)
    return target


def test_convert_twice_is_byte_identical_and_loads(source: Path, tmp_path: Path) -> None:
    from dspark.llm import LLM, SamplingParams

    a, b = tmp_path / "a", tmp_path / "b"
    plan = convert(source, a, quantization={**QUICK, "method": "int4_mixed"}, draft_spec="auto")
    convert(source, b, quantization={**QUICK, "method": "int4_mixed"}, draft_spec="auto")
    da = _digest(a)
    assert da == _digest(b)
    for f in (WEIGHTS_FILE, PLAN_FILE, DRAFT_FILE, DEVICE_FILE, META_FILE, "config.json", "tokenizer.json",
              "draft/config.json"):
        assert f in da, f
    meta = json.loads((a / META_FILE).read_text())
    assert meta["format"] == "dspark-optimized/1" and meta["plugin_api"] and meta["versions"]["torch"]
    assert len(meta["source"]["sha256"]) == 64 and meta["plan"]["scheme"] == "int4_mixed"
    assert json.loads((a / DRAFT_FILE).read_text())["draft_model"] == "draft"
    assert json.loads((a / DEVICE_FILE).read_text())["layers"] == ["cpu", "cpu"]
    from safetensors import safe_open

    with safe_open(str(a / WEIGHTS_FILE), framework="pt") as sf:
        names = set(sf.keys())
        q = sf.get_tensor("model.layers.0.mlp.gate_up_proj.qweight")
    assert "model.layers.0.mlp.gate_proj.weight" not in names  # stored quantized, not float
    # Tied model: the int8 head shares the int8 embedding's integers, stored once (as NNCF does).
    assert plan.layer("lm_head").precision == "int8" and "shared" in plan.layer("lm_head").reason
    assert "lm_head.qweight" in names and "model.embed_tokens.qweight" not in names
    assert plan.weight_bytes() == sum(lp.weight_bytes() for lp in plan.layers if lp.kind == "linear")
    assert str(q.dtype) == "torch.uint8" and tuple(q.shape) == (32, 256)  # int4: two per byte along in=64
    assert (a / WEIGHTS_FILE).stat().st_size < 0.4 * sum(f.stat().st_size for f in source.glob("*.safetensors"))

    llm = LLM(str(a), dtype="float32", speculative_decoding={"strategy": "fixed", "draft_model": "auto"})
    assert llm.plan == plan
    from dspark.llm.quantization.fake import quantize_rows_int8
    from dspark.llm.runner.model import ModelRunner

    want_q, want_s = quantize_rows_int8(ModelRunner.from_pretrained(str(source), "float32").embed)
    assert torch.equal(llm.runner.embed_q[0], want_q) and torch.allclose(llm.runner.embed_q[1], want_s, rtol=1e-6)
    assert all(k.runs == plan.layer(k.name).precision for k in llm.kernels)
    # draft_model auto found the draft copied into the optimized directory (fixed prefers the model drafter).
    assert llm.engine.spec.fixed is not None and llm.engine.spec.fixed.kind == "model"
    assert "draft" in llm.engine.spec.fixed.name
    out = llm.generate("def f(x):", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 6
    with pytest.raises(ValueError, match="already an optimized directory"):
        LLM(str(a), dtype="float32", quantization="int8")
    with pytest.raises(ConvertError, match="already an optimized directory"):
        convert(a, tmp_path / "c", quantization=QUICK)


def test_none_scheme_roundtrips_float(source: Path, tmp_path: Path) -> None:
    from dspark.llm import LLM, SamplingParams

    out = tmp_path / "f"
    convert(source, out, quantization={"method": "none"}, draft_spec="none")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = LLM(str(out), dtype="float32").generate("import os", sp)[0].token_ids
    want = LLM(str(source), dtype="float32").generate("import os", sp)[0].token_ids
    assert got == want


def test_bad_input_leaves_nothing_behind(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match="does not exist"):
        convert(tmp_path / "missing", out, quantization=QUICK)
    with pytest.raises(ValueError, match="unknown quantization scheme 'int5'"):
        convert(source, out, quantization="int5")
    bad = tmp_path / "calib.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 3}\n')
    with pytest.raises(CalibrationDataError, match=r"calib.jsonl:2"):
        convert(source, out, quantization=QUICK, calibration_data_path=bad)
    with pytest.raises(ConvertError, match="speculative-draft-model-spec"):
        convert(source, out, quantization=QUICK, draft_spec=str(tmp_path / "nope"))
    # A failure after work began (the draft is incompatible) removes the partial directory.
    from llm_testutil import make_checkpoint

    other = make_checkpoint(tmp_path / "other", "llama")
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] = 999
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="cannot draft"):
        convert(source, out, quantization=QUICK, draft_spec=str(other))
    assert not out.exists() and not _leftovers(tmp_path)
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConvertError, match="already exists"):
        convert(source, out, quantization=QUICK)
    assert (out / "keep.txt").read_text() == "x"  # nothing of the user's was touched


def test_cli_convert(source: Path, tmp_path: Path) -> None:
    exe = Path(sys.executable).parent
    env = {**os.environ, "DSPARK_LOG_LEVEL": "WARNING"}
    bad = subprocess.run([str(exe / "dspark"), "convert", "--model-path", str(source), "--output-path",
                          str(tmp_path / "o"), "--quantization", "int5"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "unknown quantization scheme 'int5'" in bad.stderr
    assert not (tmp_path / "o").exists()
    ok = subprocess.run([str(exe / "dspark-convert"), "--model-path", str(source), "--output-path",
                         str(tmp_path / "o"), "--quantization", "int8", "--speculative-draft-model-spec", "none",
                         "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["plan"]["scheme"] == "int8" and (tmp_path / "o" / PLAN_FILE).exists()
