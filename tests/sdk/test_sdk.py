"""dspark.sdk, the plugin SDK: every declared name resolves, the import is cheap, the reference wrapper runs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import dspark
import dspark.sdk
from dspark.graph import Graph, Op, TensorSpec


@pytest.mark.parametrize("name", dspark.sdk.__all__)
def test_every_declared_name_resolves(name: str) -> None:
    assert getattr(dspark.sdk, name) is not None
    assert name in dir(dspark.sdk)


def test_unknown_name_says_where_to_look() -> None:
    with pytest.raises(AttributeError, match="dspark.sdk.__all__"):
        dspark.sdk.no_such_helper  # noqa: B018


def test_import_is_cheap() -> None:
    code = ("import sys, dspark.sdk; from dspark.sdk import cache, get_logger, time_call; "
            "print(sorted(m for m in ('torch', 'onnx', 'dspark.builtin.torch_ref', 'dspark.host.plugin_manager') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_api_1_3_module_names_warn_and_stand_for_the_sdk_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    from dspark import cache, calibration, cost, hostinfo, log, quant

    assert cost.roofline is dspark.sdk.cost.roofline and quant.quantize_weight is dspark.sdk.quant.quantize_weight
    assert cache.cache_dir is dspark.sdk.cache.cache_dir and hostinfo.memory is dspark.sdk.hostinfo.memory
    assert log.get_logger is dspark.sdk.get_logger
    assert sorted(n for n in dir(cost) if not n.startswith("_")) == sorted(n for n in dir(dspark.sdk.cost)
                                                                          if not n.startswith("_"))
    before = dspark.sdk.calibration.OBSERVE_MIN
    monkeypatch.setattr(calibration, "OBSERVE_MIN", before + 3)  # a knob set through the old name is the new module's
    assert dspark.sdk.calibration.OBSERVE_MIN == dspark.sdk.calibration.config.OBSERVE_MIN == before + 3
    monkeypatch.undo()  # and undone through it, the new module's knob is back (not deleted)
    assert dspark.sdk.calibration.OBSERVE_MIN == dspark.sdk.calibration.config.OBSERVE_MIN == before
    # each old name warns once, when first imported, naming its replacement and when it goes
    for old, new in [("cost", "dspark.sdk.cost"), ("log", "dspark.sdk.get_logger"), ("cache", "dspark.sdk.cache")]:
        code = f"import warnings; warnings.simplefilter('always'); import dspark.{old}"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        assert (f"DeprecationWarning: dspark.{old} is deprecated and will be removed in plugin API 2.0: "
                f"use {new} instead") in out.stderr, out.stderr
        assert out.stderr.startswith("<string>:1:"), out.stderr  # charged to the importing line


def _graph(op_type: str) -> Graph:
    rng = np.random.default_rng(0)
    return Graph(
        name="g", opset=17,
        ops=[Op(name="mm", op_type="MatMul", inputs=["x", "w"], outputs=["h"]),
             Op(name="act", op_type=op_type, inputs=["h"], outputs=["y"])],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=[2, 4]),
                 "w": TensorSpec(name="w", dtype="float32", shape=[4, 3]),
                 "h": TensorSpec(name="h", dtype="float32", shape=[2, 3]),
                 "y": TensorSpec(name="y", dtype="float32", shape=[2, 3])},
        inputs=["x"], outputs=["y"],
        initializers={"w": rng.standard_normal((4, 3)).astype(np.float32)},
    )


def test_reference_support_check() -> None:
    assert "MatMul" in dspark.sdk.REFERENCE_OPS and "NonMaxSuppression" not in dspark.sdk.REFERENCE_OPS
    ok = _graph("Relu").subgraph()
    assert dspark.sdk.unsupported_ops(ok) == [] and dspark.sdk.reference_problem(ok) is None
    nms = _graph("NonMaxSuppression").subgraph()
    assert dspark.sdk.unsupported_ops(nms) == ["NonMaxSuppression"]
    assert "NonMaxSuppression 'act'" in (dspark.sdk.reference_problem(nms) or "")
    graph = _graph("Relu")
    custom = graph.model_copy(update={"ops": [graph.ops[0], graph.ops[1].model_copy(update={"domain": "com.example"})]})
    assert dspark.sdk.unsupported_ops(custom.subgraph()) == ["Relu"]
    assert dspark.sdk.reference_problem(custom.subgraph()) is not None


def test_reference_executable_computes_the_subgraph() -> None:
    graph = _graph("Relu")
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    exe = dspark.sdk.ReferenceExecutable(graph.subgraph(), "cpu")
    got = exe.run({"x": x})
    want = np.maximum(x @ graph.initializers["w"], 0)
    np.testing.assert_allclose(got["y"], want, rtol=1e-6, atol=1e-6)
    assert set(exe.run_all({"x": x})) == {"x", "h", "y"}
    assert exe.torch.__name__ == "torch" and exe.inputs == ["x"] and exe.outputs == ["y"]
