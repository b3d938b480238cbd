"""The ``npu`` plugin (ONNX Runtime execution providers) against the real ONNX Runtime, no mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import dspark_plugins_npu as npu
from dspark import TOLERANCES, Bid, Device, Unavailable
from dspark.host import inventory
from dspark.graph.model import Graph, Subgraph
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.testing import PluginConformance
from dspark_plugins_npu import bench, models, providers, session, support

REPO = Path(__file__).resolve().parents[2]
F32 = TensorProto.FLOAT
GPU_EPS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def _cuda_usable() -> bool:
    try:
        with session.quiet_ort():
            session.create(models.PROBE_MODEL, "CUDAExecutionProvider", strict=False)
        return True
    except session.EpUnusable:
        return False


HAVE_CUDA = "CUDAExecutionProvider" in ort.get_available_providers() and _cuda_usable()


@pytest.fixture(scope="module")
def probed() -> list[Device | Unavailable]:
    return npu.dspark_probe_devices(refresh=False)


@pytest.fixture(scope="module")
def cpu(probed: list[Device | Unavailable]) -> Device:
    return _cpu_of(probed)


# -- probing -----------------------------------------------------------------


def test_probe_model_constant_is_what_onnx_builds() -> None:
    assert models.PROBE_MODEL == models.build_probe_model()


def test_import_is_light() -> None:
    code = "import sys, dspark_plugins_npu; print(sorted(m for m in ('onnx', 'onnxruntime') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_probe_reports_cpu_ep_with_measured_figures(cpu: Device) -> None:
    assert cpu.id == "cpu" and cpu.kind == "cpu"
    assert cpu.runtime == "onnxruntime/CPUExecutionProvider"
    assert cpu.peak_flops["float32"] > 1e8
    assert 0 < cpu.properties["call_overhead_s"] < 0.01
    assert cpu.memory_bandwidth_bytes_per_s and cpu.memory_total_bytes
    props = cpu.properties
    assert props["ort_version"] == ort.__version__
    assert props["ort_device"] == ort.get_device()
    assert props["available_providers"] == ort.get_available_providers()
    from dspark.host import hostinfo

    assert cpu.name == hostinfo.cpu_static()["model"]  # same silicon name as the other CPU plugins


@pytest.mark.skipif(HAVE_CUDA, reason="a usable GPU is present")
def test_probe_reports_unusable_gpu_eps_with_reason(probed: list[Device | Unavailable]) -> None:
    unavailable = {u.what: u.reason for u in probed if isinstance(u, Unavailable)}
    listed = [ep for ep in GPU_EPS if ep in ort.get_available_providers()]
    if not listed:
        pytest.skip("this ONNX Runtime build has no GPU execution provider")
    for ep in listed:
        assert ep in unavailable, f"{ep} is listed by ORT but neither a device nor unavailable"
        assert ep in unavailable[ep]  # the reason names the provider
        assert len(unavailable[ep]) > len(ep) + 10
    assert not any(isinstance(d, Device) and d.kind == "cuda" for d in probed)


def test_every_listed_provider_is_accounted_for(probed: list[Device | Unavailable]) -> None:
    seen = {d.properties["execution_provider"] for d in probed if isinstance(d, Device)}
    seen |= {u.what.split(" on ")[0] for u in probed if isinstance(u, Unavailable)}
    assert seen == set(ort.get_available_providers())


def test_probe_is_fast_and_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    t0 = time.perf_counter()
    first = _cpu_of(npu.dspark_probe_devices(refresh=False))
    cold = time.perf_counter() - t0
    figures = list((tmp_path / bench.NAMESPACE).glob("*.json"))
    assert len(figures) == 2, "one cached measurement for the CPU EP, one device list"
    # Doctor the cached device list: a cached probe must return it, a refresh must replace it.
    listed = next(f for f in figures if json.loads(f.read_text())["key"].get("snapshot"))
    entry = json.loads(listed.read_text())
    cpu_entry = next(d for d in entry["value"] if d.get("id") == "cpu")
    cpu_entry["peak_flops"]["float32"] = 123.0
    cpu_entry["properties"]["call_overhead_s"] = 0.5
    listed.write_text(json.dumps(entry))
    cached = _cpu_of(npu.dspark_probe_devices(refresh=False))
    assert cached.peak_flops["float32"] == 123.0 and cached.properties["call_overhead_s"] == 0.5
    assert cached.memory_free_bytes and cached.utilization is not None  # the live figures read now
    refreshed = _cpu_of(npu.dspark_probe_devices(refresh=True))
    assert refreshed.peak_flops["float32"] > 1e8 and refreshed.properties["call_overhead_s"] < 0.01
    assert _cpu_of(npu.dspark_probe_devices(refresh=False)).peak_flops == refreshed.peak_flops
    assert first.peak_flops["float32"] > 1e8
    assert cold < 2.0, cold  # its microbenchmarks run on time budgets (0.5 s in all)


def test_a_cached_probe_imports_no_onnxruntime(tmp_path: Path) -> None:
    """A process whose model runs elsewhere pays neither ONNX Runtime's import nor its memory: the second process
    lists the same devices from the cache, without onnxruntime in sys.modules."""
    code = ("import json, sys, dspark_plugins_npu as npu; found = npu.dspark_probe_devices(refresh=False); "
            "print(json.dumps([sorted(d.model_dump(mode='json', exclude={'memory_free_bytes', 'utilization', "
            "'memory_bandwidth_bytes_per_s', 'memory_total_bytes'})) for d in found]), 'onnxruntime' in sys.modules)")
    env = {**os.environ, "DSPARK_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                           check=True, timeout=120).stdout.split() for _ in range(2)]
    assert runs[0][-1] == "True" and runs[1][-1] == "False"
    assert runs[0][:-1] == runs[1][:-1]


def test_a_changed_snapshot_probes_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the device list depends on is its key: another GPU selection is probed, not read from the cache."""
    from dspark_plugins_npu import probe

    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    key = probe.snapshot_key()
    assert key is not None and key["distributions"] and key["libs"]
    npu.dspark_probe_devices(refresh=False)
    calls: list[str] = []
    real = probe._probe_ep
    monkeypatch.setattr(probe, "_probe_ep", lambda ep, *a: calls.append(ep) or real(ep, *a))
    npu.dspark_probe_devices(refresh=False)
    assert calls == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe.snapshot_key() != key
    npu.dspark_probe_devices(refresh=False)
    assert calls == list(ort.get_available_providers())


def _cpu_of(found: list[Device | Unavailable]) -> Device:
    return next(d for d in found if isinstance(d, Device) and d.runtime.endswith("/CPUExecutionProvider"))


def test_session_errors_lose_the_cpp_location() -> None:
    exc = RuntimeError("/onnxruntime_src/onnxruntime/python/x.cc:729 void ns::F(A&, const B&) Please install X")
    assert session.clean_error(exc) == "Please install X"


def test_provider_table_maps_vendor_builds() -> None:
    assert providers.device_id("CPUExecutionProvider") == "cpu"
    assert providers.device_id("OpenVINOExecutionProvider") == "cpu"
    assert providers.device_id("TensorrtExecutionProvider", 1) == "cuda:1"
    for ep in ("QNNExecutionProvider", "CANNExecutionProvider", "VitisAIExecutionProvider", "CoreMLExecutionProvider"):
        assert providers.device_id(ep) == "npu:0"
    for ep in ("DmlExecutionProvider", "ROCMExecutionProvider", "MIGraphXExecutionProvider"):
        assert providers.device_id(ep) == "gpu:0"
    unknown = providers.info("Foo-BarExecutionProvider")
    assert unknown.kind == "other" and providers.device_id("Foo-BarExecutionProvider") == "foobar:0"


# -- bidding, compiling, running -----------------------------------------------


def _model(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], outputs: list[str],
           inits: dict[str, np.ndarray] | None = None, opset: int = 17) -> Graph:
    graph = helper.make_graph(
        nodes, "case",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
         for n, a in inputs.items()],
        [helper.make_tensor_value_info(o, F32, None) for o in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    return Graph.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


RNG = np.random.default_rng(7)


def _randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _matmul_add_relu() -> tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray]]:
    x, w, b = _randn(4, 16), _randn(16, 8), _randn(8)
    g = _model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                helper.make_node("Add", ["h", "b"], ["a"], name="add"),
                helper.make_node("Relu", ["a"], ["y"], name="relu")], {"x": x}, ["y"], {"w": w, "b": b})
    return g, {"x": x}, {"y": np.maximum(x @ w + b, 0)}


def _softmax() -> tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray]]:
    x = _randn(3, 10)
    e = np.exp(x - x.max(-1, keepdims=True))
    g = _model([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], {"x": x}, ["y"])
    return g, {"x": x}, {"y": e / e.sum(-1, keepdims=True)}


def _conv() -> tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray]]:
    x, w, b = _randn(1, 3, 8, 8), _randn(4, 3, 3, 3), _randn(4)
    g = _model([helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1])], {"x": x}, ["y"],
               {"w": w, "b": b})
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))  # 1,3,8,8,3,3
    ref = np.einsum("nchwij,ocij->nohw", windows, w) + b[None, :, None, None]
    return g, {"x": x}, {"y": ref.astype(np.float32)}


def _layernorm() -> tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray]]:
    x, scale, bias = _randn(2, 5, 16), _randn(16), _randn(16)
    g = _model([helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-5)],
               {"x": x}, ["y"], {"s": scale, "b": bias})
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return g, {"x": x}, {"y": (x - mean) / np.sqrt(var + 1e-5) * scale + bias}


def _gather() -> tuple[Graph, dict[str, np.ndarray], dict[str, np.ndarray]]:
    table, ids = _randn(50, 8), np.array([[1, 4, 49], [0, 0, 7]], dtype=np.int64)
    g = _model([helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)], {"ids": ids}, ["y"],
               {"table": table})
    return g, {"ids": ids}, {"y": table[ids]}


CASES = {"matmul_add_relu": _matmul_add_relu, "softmax": _softmax, "conv": _conv,
         "layernorm": _layernorm, "gather": _gather}


@pytest.mark.parametrize("case", list(CASES))
def test_bid_compile_run_matches_reference(case: str, cpu: Device) -> None:
    graph, feeds, expected = CASES[case]()
    sg = graph.subgraph()
    bid = npu.dspark_bid(sg, cpu)
    assert isinstance(bid, Bid)
    assert bid.device_id == "cpu" and bid.runtime == "onnxruntime/CPUExecutionProvider"
    assert bid.precision == "float32"
    # The calibration timed the whole call: the probed overhead only bounds the bid's fixed part.
    assert 0 < bid.fixed_overhead_s <= min(bid.latency_s, cpu.properties["call_overhead_s"])
    exe = npu.dspark_compile(sg, cpu)
    assert exe is not None
    out = exe.run(feeds)
    assert list(out) == sg.outputs
    rtol, atol = TOLERANCES["float32"]
    for name, ref in expected.items():
        np.testing.assert_allclose(out[name], ref, rtol=rtol, atol=atol)


def test_bid_grows_with_work(cpu: Device) -> None:
    small, _, _ = _matmul_add_relu()
    x, w = _randn(256, 512), _randn(512, 512)
    big = _model([helper.make_node("MatMul", ["x", "w"], ["y"])], {"x": x}, ["y"], {"w": w})
    b_small, b_big = npu.dspark_bid(small.subgraph(), cpu), npu.dspark_bid(big.subgraph(), cpu)
    assert b_small is not None and b_big is not None
    assert b_big.latency_s > b_small.latency_s
    assert b_big.peak_memory_bytes >= w.nbytes


def test_partial_subgraph_runs(cpu: Device) -> None:
    graph, feeds, _ = _matmul_add_relu()
    sg = Subgraph(graph=graph, op_names=["mm", "add"])
    exe = npu.dspark_compile(sg, cpu)
    assert exe is not None
    out = exe.run(feeds)
    np.testing.assert_allclose(out["a"], feeds["x"] @ graph.initializers["w"] + graph.initializers["b"],
                               rtol=1e-4, atol=1e-5)


def test_bid_abstains_for_another_plugins_quantized_variant(cpu: Device) -> None:
    graph, _, _ = _matmul_add_relu()
    foreign = graph.subgraph().model_copy(update={"quantized_by": "cuda"})
    assert npu.dspark_bid(foreign, cpu) is None
    assert npu.dspark_compile(foreign, cpu) is None


def test_bid_abstains_for_an_op_ort_does_not_know(cpu: Device) -> None:
    node = helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")
    graph = helper.make_graph([node], "custom", [helper.make_tensor_value_info("x", F32, [4])],
                              [helper.make_tensor_value_info("y", F32, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    sg = Graph.from_onnx(model).subgraph()
    assert npu.dspark_bid(sg, cpu) is None
    assert "Frobnicate" in (support.why_not(sg, "CPUExecutionProvider", 0) or "")


@pytest.mark.skipif(HAVE_CUDA, reason="a usable GPU is present")
def test_compile_never_falls_back_silently(cpu: Device) -> None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this ONNX Runtime build has no CUDA execution provider")
    graph, _, _ = _matmul_add_relu()
    fake = cpu.model_copy(update={"id": "cuda:0", "kind": "cuda", "runtime": "onnxruntime/CUDAExecutionProvider",
                                  "properties": {**cpu.properties, "execution_provider": "CUDAExecutionProvider"}})
    assert npu.dspark_bid(graph.subgraph(), fake) is None
    with pytest.raises(session.EpUnusable, match="CUDAExecutionProvider"):
        npu.dspark_compile(graph.subgraph(), fake)


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="no usable CUDA GPU for ONNX Runtime's CUDA execution provider")
def test_cuda_ep_runs_a_subgraph(probed: list[Device | Unavailable]) -> None:
    gpu = next(d for d in probed if isinstance(d, Device) and d.runtime == "onnxruntime/CUDAExecutionProvider")
    assert gpu.id == "cuda:0" and gpu.peak_flops["float32"] > 1e11
    graph, feeds, expected = _matmul_add_relu()
    bid = npu.dspark_bid(graph.subgraph(), gpu)
    assert bid is not None and bid.device_id == "cuda:0"
    exe = npu.dspark_compile(graph.subgraph(), gpu)
    assert exe is not None
    np.testing.assert_allclose(exe.run(feeds)["y"], expected["y"], rtol=1e-3, atol=1e-4)  # TF32 may be on


# -- through the real plugin manager --------------------------------------------


def test_plugin_manager_loads_npu_and_lists_unusable_providers() -> None:
    # The suite-wide cache (tests/conftest.py): the other plugins' benchmarks run once per session.
    host = PluginHost(PluginSettings.from_env(env={})).load()
    inv = inventory.probe(host)
    record = host.records["npu"]
    assert record.status.value == "active", record.reason
    assert record.api_version == "1.16"
    assert "cpu" in record.devices
    assert any(drv.plugin == "npu" for drv in inv.device("cpu").drivers)
    if not HAVE_CUDA and "CUDAExecutionProvider" in ort.get_available_providers():
        reasons: dict[str, Any] = {u.what: u.reason for u in record.unavailable}
        assert "CUDAExecutionProvider" in reasons.get("CUDAExecutionProvider", "")


def test_contrib_op_of_another_domain_runs(cpu: Device) -> None:
    import math

    x = _randn(3, 7)
    node = helper.make_node("Gelu", ["x"], ["y"], domain="com.microsoft")
    graph = helper.make_graph([node], "gelu", [helper.make_tensor_value_info("x", F32, [3, 7])],
                              [helper.make_tensor_value_info("y", F32, [3, 7])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sg = Graph.from_onnx(model).subgraph()
    assert npu.dspark_bid(sg, cpu) is not None
    exe = npu.dspark_compile(sg, cpu)
    assert exe is not None
    erf = np.vectorize(math.erf)
    np.testing.assert_allclose(exe.run({"x": x})["y"], 0.5 * x * (1 + erf(x / math.sqrt(2))), rtol=1e-4, atol=1e-5)


# -- the shared conformance kit --------------------------------------------------


class TestNpuConformance(PluginConformance):
    plugin = "npu"
