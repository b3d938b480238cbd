"""The CPU/OpenVINO plugin against the real OpenVINO runtime (no mocks)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import dspark_plugins_cpu as plugin
from dspark import TOLERANCES
from dspark.host import cache
from dspark.graph.model import Graph, Subgraph
from dspark.testing import PluginConformance
from dspark.types import Bid, Device
from dspark_plugins_cpu import bench, runtime, support

RTOL, ATOL = TOLERANCES["float32"]


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache only this module's probes write, so the first probe really measures."""
    path = tmp_path_factory.mktemp("ov-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def device(own_cache: Path) -> Device:
    devices = plugin.dspark_probe_devices(refresh=False)
    cpu = [d for d in devices if isinstance(d, Device) and d.id == "cpu"]
    assert len(cpu) == 1, devices
    return cpu[0]


def _model(nodes: list[onnx.NodeProto], inputs: list[tuple[str, Any]], outputs: list[tuple[str, Any]],
           inits: dict[str, np.ndarray] | None = None, opset: int = 17,
           value_info: list[onnx.ValueInfoProto] | None = None, domains: tuple[str, ...] = (),
           f: int = TensorProto.FLOAT) -> Graph:
    graph = helper.make_graph(
        nodes, "test",
        [helper.make_tensor_value_info(n, f, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, f, s) for n, s in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
        value_info=value_info or [],
    )
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 9
    return Graph.from_onnx(model)


def _mlp(batch: int | str = 4) -> Graph:
    rng = np.random.default_rng(0)
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "b"], ["z"], name="add"),
         helper.make_node("Relu", ["z"], ["y"], name="relu")],
        [("x", [batch, 32])], [("y", [batch, 16])],
        {"w": rng.standard_normal((32, 16), dtype=np.float32), "b": rng.standard_normal(16, dtype=np.float32)},
    )


def _run(sg: Subgraph, device: Device, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    exe = plugin.dspark_compile(sg, device)
    assert exe is not None
    return exe.run(inputs)


# -- probing -----------------------------------------------------------------


def test_probe_reports_the_cpu_with_measured_figures(device: Device) -> None:
    core = runtime.core()
    assert device.kind == "cpu" and device.runtime == "openvino/CPU"
    assert device.name == core.get_property("CPU", "FULL_DEVICE_NAME")
    assert device.peak_flops["float32"] > 1e9  # any CPU this decade does > 1 GFLOP/s in f32
    capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    for cap, dtype in (("BF16", "bfloat16"), ("FP16", "float16")):
        assert (dtype in device.peak_flops) == (cap in capabilities)
    assert set(device.peak_flops) <= set(device.dtypes)
    assert device.memory_total_bytes and device.memory_free_bytes is not None
    assert device.memory_bandwidth_bytes_per_s and device.memory_bandwidth_bytes_per_s > 1e8
    assert device.utilization is not None
    props = device.properties
    assert props["openvino_version"] == runtime.version()
    assert 0 < props["call_overhead_s"] < 0.05 and props["op_overhead_s"] > 0
    for key in ("cpu_model", "physical_cores", "logical_cores", "usable_cores", "isa_features", "numa_nodes"):
        assert key in props
    ov_props = props["openvino"]
    assert ov_props["FULL_DEVICE_NAME"] == device.name
    assert "FP32" in ov_props["OPTIMIZATION_CAPABILITIES"]
    assert "RANGE_FOR_ASYNC_INFER_REQUESTS" in ov_props and "NUM_STREAMS" in ov_props
    json.dumps(props)  # everything shown must serialise


def test_second_probe_hits_the_cache_and_refresh_measures_again(
    device: Device, own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = bench._measure

    def counting(ov_name: str, capabilities: list[str]) -> dict[str, Any]:
        calls.append(ov_name)
        return real(ov_name, capabilities)

    monkeypatch.setattr(bench, "_measure", counting)
    again = next(d for d in plugin.dspark_probe_devices(refresh=False) if isinstance(d, Device))
    assert calls == []  # nothing measured again
    assert again.peak_flops == device.peak_flops
    assert again.properties["call_overhead_s"] == device.properties["call_overhead_s"]
    assert any(own_cache.joinpath(bench.CACHE_NAMESPACE).iterdir())

    fresh = next(d for d in plugin.dspark_probe_devices(refresh=True) if isinstance(d, Device))
    assert calls == ["CPU"]
    assert fresh.peak_flops["float32"] > 1e9
    # The refreshed figures replace the cached ones.
    key = bench.cache_key("CPU", device.name)
    assert cache.load(bench.CACHE_NAMESPACE, key)["peak_flops"] == fresh.peak_flops


def test_device_names_map_to_dspark_ids() -> None:
    assert runtime.dspark_id("CPU") == ("cpu", "cpu")
    assert runtime.dspark_id("GPU") == ("gpu:0", "gpu")
    assert runtime.dspark_id("GPU.1") == ("gpu:1", "gpu")
    assert runtime.dspark_id("NPU") == ("npu:0", "npu")
    assert runtime.dspark_id("FPGA.2") == ("fpga:2", "other")


# -- bidding -----------------------------------------------------------------


def test_bids_on_what_openvino_runs(device: Device) -> None:
    sg = _mlp().subgraph()
    bid = plugin.dspark_bid(sg, device)
    assert isinstance(bid, Bid)
    assert bid.device_id == "cpu" and bid.runtime == "openvino/CPU" and bid.precision == "float32"
    # The calibration timed the whole call: the probed overhead only bounds the bid's fixed part.
    assert 0 < bid.fixed_overhead_s <= min(bid.latency_s, device.properties["call_overhead_s"])
    assert bid.peak_memory_bytes == sg.param_bytes + sg.io_bytes()


def test_abstains_on_ops_openvino_cannot_run(device: Device) -> None:
    # Det is standard ONNX without an OpenVINO conversion; a custom-domain op has none either.
    det = _model([helper.make_node("Det", ["x"], ["y"], name="det")], [("x", [3, 3])], [("y", [])])
    assert support.unsupported_reason(det.subgraph(), "CPU")
    assert plugin.dspark_bid(det.subgraph(), device) is None
    custom = _model(
        [helper.make_node("Frobnicate", ["x"], ["y"], name="frob", domain="com.example")],
        [("x", [2, 3])], [("y", [2, 3])], domains=("com.example",),
    )
    assert plugin.dspark_bid(custom.subgraph(), device) is None
    assert "Frobnicate" in (support.unsupported_reason(custom.subgraph(), "CPU") or "")


def test_half_precision_models_claim_half_precision(device: Device) -> None:
    g = _model([helper.make_node("Mul", ["x", "y"], ["z"], name="mul")], [("x", [4, 8]), ("y", [4, 8])],
               [("z", [4, 8])], f=TensorProto.FLOAT16)
    bid = plugin.dspark_bid(g.subgraph(), device)
    assert bid is not None and bid.precision == "float16"  # results round to f16 whatever computes them
    rng = np.random.default_rng(7)
    x, y = (rng.standard_normal((4, 8)).astype(np.float16) for _ in range(2))
    out = _run(g.subgraph(), device, {"x": x, "y": y})["z"]
    assert out.dtype == np.float16
    np.testing.assert_allclose(out, x * y, *TOLERANCES["float16"])


def test_abstains_on_another_plugins_quantized_variant(device: Device) -> None:
    variant = _mlp().subgraph().model_copy(update={"quantized_by": "torch"})
    assert plugin.dspark_bid(variant, device) is None
    assert plugin.dspark_compile(variant, device) is None


# -- compile and run ---------------------------------------------------------


def test_matmul_add_relu(device: Device) -> None:
    g = _mlp()
    x = np.random.default_rng(1).standard_normal((4, 32), dtype=np.float32)
    out = _run(g.subgraph(), device, {"x": x})
    ref = np.maximum(x @ g.initializers["w"] + g.initializers["b"], 0)
    np.testing.assert_allclose(out["y"], ref, rtol=RTOL, atol=ATOL)


def test_symbolic_batch_runs_at_any_size(device: Device) -> None:
    g = _mlp("batch")
    exe = plugin.dspark_compile(g.subgraph(), device)
    assert exe is not None
    for n in (1, 5):
        x = np.random.default_rng(n).standard_normal((n, 32), dtype=np.float32)
        ref = np.maximum(x @ g.initializers["w"] + g.initializers["b"], 0)
        np.testing.assert_allclose(exe.run({"x": x})["y"], ref, rtol=RTOL, atol=ATOL)


def test_part_of_a_graph_maps_tensors_by_name(device: Device) -> None:
    g = _mlp()
    sg = g.subgraph(["add", "relu"])  # reads the MatMul's output, returns Relu's
    assert sg.inputs == ["h"] and sg.outputs == ["y"]
    h = np.random.default_rng(2).standard_normal((4, 16), dtype=np.float32)
    out = _run(sg, device, {"h": h})
    np.testing.assert_allclose(out["y"], np.maximum(h + g.initializers["b"], 0), rtol=RTOL, atol=ATOL)


def test_softmax(device: Device) -> None:
    g = _model([helper.make_node("Softmax", ["x"], ["y"], axis=-1, name="sm")], [("x", [3, 10])], [("y", [3, 10])])
    x = np.random.default_rng(3).standard_normal((3, 10), dtype=np.float32) * 4
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(_run(g.subgraph(), device, {"x": x})["y"], e / e.sum(-1, keepdims=True),
                               rtol=RTOL, atol=ATOL)


def test_conv(device: Device) -> None:
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 3, 3, 3), dtype=np.float32)
    b = rng.standard_normal(8, dtype=np.float32)
    g = _model([helper.make_node("Conv", ["x", "w", "b"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv")],
               [("x", [2, 3, 9, 9])], [("y", [2, 8, 5, 5])], {"w": w, "b": b})
    x = rng.standard_normal((2, 3, 9, 9), dtype=np.float32)
    # Reference in float64: windows of the padded input against every filter.
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), (2, 3))
    ref = np.einsum("ncijkl,ockl->noij", windows[:, :, ::2, ::2].astype(np.float64), w) + b[:, None, None]
    np.testing.assert_allclose(_run(g.subgraph(), device, {"x": x})["y"], ref, rtol=RTOL, atol=ATOL)


def test_layer_normalization(device: Device) -> None:
    rng = np.random.default_rng(5)
    scale = rng.standard_normal(24, dtype=np.float32)
    bias = rng.standard_normal(24, dtype=np.float32)
    g = _model([helper.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-5, name="ln")],
               [("x", [2, 5, 24])], [("y", [2, 5, 24])], {"s": scale, "b": bias})
    x = rng.standard_normal((2, 5, 24), dtype=np.float32)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    ref = (x - mean) / np.sqrt(var + 1e-5) * scale + bias
    np.testing.assert_allclose(_run(g.subgraph(), device, {"x": x})["y"], ref, rtol=RTOL, atol=ATOL)


def test_outputs_are_copies(device: Device) -> None:
    exe = plugin.dspark_compile(_mlp().subgraph(), device)
    assert exe is not None
    rng = np.random.default_rng(6)
    first = exe.run({"x": rng.standard_normal((4, 32), dtype=np.float32)})["y"]
    kept = first.copy()
    exe.run({"x": rng.standard_normal((4, 32), dtype=np.float32)})
    np.testing.assert_array_equal(first, kept)  # the next call must not overwrite what we returned


# -- through the real plugin manager -----------------------------------------


def test_plugin_manager_lists_cpu_plugin_active() -> None:
    from dspark.host import inventory
    from dspark.host.plugin_manager import PluginHost
    from dspark.host.settings import PluginSettings

    host = PluginHost(PluginSettings.from_env(env={})).load()
    inv = inventory.probe(host)
    record = host.records["cpu"]
    assert record.status.value == "active", record.reason
    assert record.devices == ["cpu"]
    cpu = inv.device("cpu")
    assert "cpu" in cpu.plugins
    driver = next(d for d in cpu.drivers if d.plugin == "cpu")
    assert driver.runtime == "openvino/CPU"
    bid = host.call("cpu", "dspark_bid", subgraph=_mlp().subgraph(), device=driver)
    assert isinstance(bid, Bid) and bid.plugin == "cpu"


# -- the conformance kit -----------------------------------------------------


class TestCpuConformance(PluginConformance):
    plugin = "cpu"
