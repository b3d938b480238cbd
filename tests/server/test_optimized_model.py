"""`dspark serve` on a directory written by `dspark convert`: the server runs the quantized plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conftest import start_server

from dspark.llm import default_model_path


def test_serves_a_converted_model(tmp_path: Path) -> None:
    from dspark.llm.quantization.convert import PLAN_FILE, convert

    out = tmp_path / "stdlib-llama-int8"
    plan = convert(default_model_path(), out, quantization={
        "method": "int8_mixed", "calibration_samples": 2, "calibration_seq_len": 32}, draft_spec="none")
    h = start_server(tmp_path / "srv", model={"path": str(out), "name": "q8", "dtype": "float32"})
    try:
        client = h.openai()
        assert [m.id for m in client.models.list().data] == ["q8"]
        r = client.completions.create(model="q8", prompt="import os\n", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 12 and r.choices[0].text
        applied: list[dict[str, Any]] = [x for x in h.log() if x.get("event") == "quantization.applied"]
        assert applied and applied[0]["scheme"] == "int8_mixed"
        quantized = sum(1 for lp in plan.layers if lp.precision != "float")
        assert sum(applied[0]["kernels"].values()) == quantized
        assert json.loads((out / PLAN_FILE).read_text())["scheme"] == "int8_mixed"
    finally:
        assert h.stop() == 0
