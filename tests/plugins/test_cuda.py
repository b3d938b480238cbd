"""The CUDA/Triton plugin: probe without a driver, PCIe math, NVML->Device mapping,
bidding, and (on a GPU machine) real probing and execution against the CPU reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pynvml
import pytest
import torch

from dspark.graph.model import Graph, Op, TensorSpec
from dspark.host.inventory import probe
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.types import TOLERANCES, Device, PluginStatus, Unavailable
from dspark_plugins_cuda import bidding as bid_mod
from dspark_plugins_cuda import nvml, pcie, records
from dspark_plugins_cuda.bench import Measured
from dspark_plugins_cuda.nvml import GpuReading, SystemReading
from dspark_plugins_cuda.torch_side import TorchCuda, TorchGpu, normalize_uuid

HAS_CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")
no_gpu_here = pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA GPU")


def _host() -> PluginHost:
    return PluginHost(PluginSettings.from_env(env={})).load()


# -- the real plugin manager ------------------------------------------------


def test_plugin_loads_through_entry_point() -> None:
    record = _host().records["cuda"]
    assert record.source == "entry point"
    assert record.api_version == "1.10"
    assert record.status in (PluginStatus.ACTIVE, PluginStatus.NO_HARDWARE), record.reason


@no_gpu_here
def test_no_driver_reports_no_hardware_with_nvml_reason() -> None:
    inv = probe(_host())
    record = next(p for p in inv.plugins if p.name == "cuda")
    assert record.status == PluginStatus.NO_HARDWARE
    assert record.reason
    assert "NVML" in record.reason or "driver" in record.reason
    assert all("cuda" not in d.plugins for d in inv.devices)


_PROBE_SCRIPT = """
import json, sys, time
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.host.inventory import probe
t = time.perf_counter()
host = PluginHost(PluginSettings.from_env(env={"DSPARK_PLUGINS": "cuda"})).load()
inv = probe(host)
rec = host.records["cuda"]
print(json.dumps({"status": rec.status.value, "reason": rec.reason,
                  "torch": "torch" in sys.modules, "seconds": time.perf_counter() - t}))
"""


@no_gpu_here
def test_probe_without_driver_never_imports_torch() -> None:
    # Only the cuda plugin is loaded: the torch reference built-in imports torch itself.
    proc = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT], capture_output=True, text=True,
                          timeout=120, env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["status"] == "no hardware"
    assert result["reason"] == "no NVIDIA driver: NVML library not found (libnvidia-ml.so.1)"
    assert result["torch"] is False
    assert result["seconds"] < 1.5


def test_module_import_is_light() -> None:
    code = ("import sys, dspark_plugins_cuda; "
            "print(sorted(m for m in ('torch', 'triton', 'pynvml') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# -- NVML errors -> reasons ---------------------------------------------------


@pytest.mark.parametrize(("code", "expected"), [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "no NVIDIA driver: NVML library not found (libnvidia-ml.so.1)"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVIDIA driver not loaded (NVML: Driver Not Loaded)"),
    (pynvml.NVML_ERROR_NO_PERMISSION, "no permission to use the NVIDIA driver"),
    (pynvml.NVML_ERROR_UNKNOWN, "NVML failed to initialize: Unknown Error"),
])
def test_init_failure_reason_from_real_nvml_errors(code: int, expected: str) -> None:
    assert nvml.init_failure_reason(pynvml.NVMLError(code)).startswith(expected)


# -- PCIe math ----------------------------------------------------------------


@pytest.mark.parametrize(("gen", "width", "gb_s"), [
    (1, 1, 0.25), (2, 8, 4.0), (3, 16, 15.76), (4, 16, 31.504), (5, 16, 63.008), (5, 8, 31.504),
    (6, 16, 121.008), (4, 4, 7.876),
])
def test_pcie_link_bandwidth(gen: int, width: int, gb_s: float) -> None:
    assert pcie.link_bandwidth_bytes_per_s(gen, width) == pytest.approx(gb_s * 1e9, rel=1e-9)


@pytest.mark.parametrize(("gen", "width"), [(None, 16), (4, None), (0, 16), (4, 0), (9, 16)])
def test_pcie_unknown_link_is_none(gen: int | None, width: int | None) -> None:
    assert pcie.link_bandwidth_bytes_per_s(gen, width) is None


# -- NVML readings -> Device (recorded values; NVML cannot run here) ------------

SYSTEM = SystemReading(driver_version="550.54.15", cuda_driver_version="12.4")

# What NVML reports for an idle H100 SXM5 (link trained down to gen1 at idle).
H100 = GpuReading(
    index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-6f1b2c3d-aaaa-bbbb-cccc-0123456789ab",
    pci_bus_id="00000000:18:00.0", compute_capability=(9, 0),
    memory_total_bytes=85520809984, memory_free_bytes=84540784640, utilization_gpu_percent=37,
    pcie_current_generation=1, pcie_current_width=16, pcie_max_generation=5, pcie_max_width=16,
)
A100 = GpuReading(
    index=1, name="NVIDIA A100-PCIE-40GB", uuid="GPU-0a0b0c0d-1111-2222-3333-444455556666",
    pci_bus_id="00000000:3B:00.0", compute_capability=(8, 0),
    memory_total_bytes=42505273344, memory_free_bytes=42084466688, utilization_gpu_percent=None,
    pcie_current_generation=4, pcie_current_width=16, pcie_max_generation=4, pcie_max_width=16,
)
V100 = GpuReading(
    index=2, name="Tesla V100-SXM2-16GB", uuid=None, pci_bus_id=None, compute_capability=(7, 0),
    memory_total_bytes=16945512448, memory_free_bytes=16514908160, utilization_gpu_percent=0,
    pcie_current_generation=None, pcie_current_width=None, pcie_max_generation=3, pcie_max_width=16,
)
H100_MEASURED = Measured(peak_flops={"float32": 5.1e13, "float16": 6.6e14, "bfloat16": 6.7e14, "tf32": 3.7e14},
                         memory_bandwidth_bytes_per_s=2.9e12)


def _torch_gpu(index: int, sm: int) -> TorchGpu:
    return TorchGpu(index=index, sm_count=sm, torch_version="2.5.1+cu124", torch_cuda_version="12.4")


def test_h100_reading_maps_to_device() -> None:
    d = records.device_record(H100, SYSTEM, _torch_gpu(0, 132), H100_MEASURED, "3.1.0")
    assert (d.id, d.kind, d.runtime, d.name) == ("cuda:0", "cuda", "torch-cuda", "NVIDIA H100 80GB HBM3")
    assert d.memory_total_bytes == 85520809984 and d.memory_free_bytes == 84540784640
    assert d.utilization == pytest.approx(0.37)
    # Max link (gen5 x16), not the idle gen1 link.
    assert d.host_link_bandwidth_bytes_per_s == pytest.approx(63.008e9)
    assert d.properties["pcie"]["current_bandwidth_bytes_per_s"] == pytest.approx(4.0e9)
    assert d.peak_flops["float16"] == 6.6e14 and d.memory_bandwidth_bytes_per_s == 2.9e12
    assert "bfloat16" in d.dtypes and "float32" in d.dtypes
    p = d.properties
    assert p["compute_capability"] == "9.0" and p["sm_count"] == 132 and p["triton"] == "3.1.0"
    assert p["driver_version"] == "550.54.15" and p["cuda_driver_version"] == "12.4"
    Device.model_validate(d.model_dump())  # survives the plugin manager's validation


def test_a100_and_v100_readings() -> None:
    measured = Measured(peak_flops={"float32": 1.8e13}, memory_bandwidth_bytes_per_s=1.3e12)
    a = records.device_record(A100, SYSTEM, _torch_gpu(1, 108), measured, None)
    assert a.id == "cuda:1" and a.utilization is None and a.properties["triton"] is None
    assert a.host_link_bandwidth_bytes_per_s == pytest.approx(31.504e9)
    v = records.device_record(V100, SYSTEM, _torch_gpu(2, 80), measured, None)
    assert "bfloat16" not in v.dtypes  # no native bf16 before compute capability 8.0
    assert v.host_link_bandwidth_bytes_per_s == pytest.approx(15.76e9)
    assert v.properties["pcie"]["current_bandwidth_bytes_per_s"] is None


def test_unreadable_gpu_becomes_unavailable() -> None:
    u = records.unavailable(GpuReading(index=3, error="NVML query failed: GPU is lost"),
                            "NVML query failed: GPU is lost")
    assert isinstance(u, Unavailable) and u.what == "cuda:3" and "GPU is lost" in u.reason
    u = records.unavailable(H100, "torch 2.13.0+cpu was built without CUDA")
    assert u.what == "cuda:0" and u.reason.startswith("NVIDIA H100 80GB HBM3: torch")


def test_nvml_gpus_matched_to_cuda_ordinals_by_uuid() -> None:
    # CUDA's fastest-first order puts the H100 (NVML index 0) at ordinal 1 here.
    tc = TorchCuda(gpus={normalize_uuid(H100["uuid"] or ""): _torch_gpu(1, 132),
                         normalize_uuid(A100["uuid"] or ""): _torch_gpu(0, 108)})
    assert tc.match(H100["uuid"], 2, 0) == _torch_gpu(1, 132)
    assert tc.match("gpu-0A0B0C0D-1111-2222-3333-444455556666", 2, 1) == _torch_gpu(0, 108)
    assert tc.match("GPU-ffffffff-0000-0000-0000-000000000000", 2, 1) is None  # hidden or MIG


def test_gpus_paired_by_position_only_without_uuids(monkeypatch: pytest.MonkeyPatch) -> None:
    tc = TorchCuda(by_order=[_torch_gpu(0, 132), _torch_gpu(1, 132)])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert tc.match(None, 2, 1) == _torch_gpu(1, 132)
    assert tc.match(None, 3, 1) is None  # torch sees fewer GPUs than NVML: pairing is ambiguous
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert tc.match(None, 2, 1) is None


def test_fp32_mode_sets_and_restores_tf32_flags() -> None:
    from dspark_plugins_cuda.precision import _new_api, fp32_mode

    matmul = torch.backends.cuda.matmul
    if _new_api(torch):
        before = (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
        with fp32_mode(torch, tf32=False):
            assert (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == ("ieee", "ieee")
        after = (matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    else:
        before = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        with fp32_mode(torch, tf32=False):
            assert (matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, False)
        after = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    assert after == before


# -- bidding ------------------------------------------------------------------


def _mlp_graph(op_type: str = "Relu") -> Graph:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((32,)).astype(np.float32)
    return Graph(
        name="mlp",
        ops=[Op(name="mm", op_type="MatMul", inputs=["x", "w"], outputs=["h"], flops=2 * 4 * 64 * 32),
             Op(name="add", op_type="Add", inputs=["h", "b"], outputs=["hb"], flops=4 * 32),
             Op(name="act", op_type=op_type, inputs=["hb"], outputs=["y"], flops=4 * 32)],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=(4, 64)),
                 "w": TensorSpec(name="w", dtype="float32", shape=(64, 32)),
                 "b": TensorSpec(name="b", dtype="float32", shape=(32,)),
                 "h": TensorSpec(name="h", dtype="float32", shape=(4, 32)),
                 "hb": TensorSpec(name="hb", dtype="float32", shape=(4, 32)),
                 "y": TensorSpec(name="y", dtype="float32", shape=(4, 32))},
        inputs=["x"], outputs=["y"], initializers={"w": w, "b": b},
    )


def _h100() -> Device:
    return records.device_record(H100, SYSTEM, _torch_gpu(0, 132), H100_MEASURED, None)


def test_bid_is_roofline_plus_launch_overhead() -> None:
    sg = _mlp_graph().subgraph()
    b = bid_mod.bid(sg, _h100())
    assert b is not None
    assert (b.device_id, b.runtime, b.precision, b.source) == ("cuda:0", "torch-cuda", "float32", "roofline")
    traffic = (sg.io_bytes() + sg.param_bytes) / 2.9e12
    assert b.latency_s == pytest.approx(max(sg.flops / 5.1e13, traffic) + 3 * bid_mod.LAUNCH_OVERHEAD_S)
    assert b.peak_memory_bytes >= sg.param_bytes + sg.io_bytes()


def test_bid_abstains_when_it_cannot_run_it() -> None:
    device = _h100()
    assert bid_mod.bid(_mlp_graph("NonMaxSuppression").subgraph(), device) is None
    sg = _mlp_graph().subgraph()
    assert bid_mod.bid(sg.model_copy(update={"quantized_by": "npu"}), device) is None
    full = device.model_copy(update={"memory_free_bytes": 1024})
    assert bid_mod.bid(sg, full) is None


# -- on a GPU machine -----------------------------------------------------------


@needs_gpu
def test_real_probe_reports_measured_gpu() -> None:
    host = _host()
    inv = probe(host)
    record = host.records["cuda"]
    assert record.status == PluginStatus.ACTIVE, record.reason
    ours = [drv for d in inv.devices for drv in d.drivers if drv.plugin == "cuda"]
    assert len(ours) + len(record.unavailable) >= torch.cuda.device_count()
    d = ours[0]
    assert d.id.startswith("cuda:") and d.kind == "cuda" and d.runtime == "torch-cuda"
    assert d.name and d.properties["uuid"]
    assert d.memory_total_bytes and d.memory_free_bytes and d.memory_free_bytes <= d.memory_total_bytes
    assert d.peak_flops["float32"] > 1e11 and d.peak_flops["float16"] > 1e11
    assert d.memory_bandwidth_bytes_per_s and d.memory_bandwidth_bytes_per_s > 1e10
    assert d.host_link_bandwidth_bytes_per_s is None or d.host_link_bandwidth_bytes_per_s >= 0.25e9
    assert d.properties["sm_count"] == torch.cuda.get_device_properties(int(d.id.split(":")[1])).multi_processor_count
    # Second probe is served from the cache.
    again = next(drv for drv in probe(host).drivers() if drv.plugin == "cuda")
    assert again.properties["benchmarks"] == "cached"
    assert again.peak_flops == d.peak_flops


def _conv_graph() -> Graph:
    rng = np.random.default_rng(1)
    return Graph(
        name="conv",
        ops=[Op(name="conv", op_type="Conv", inputs=["x", "w"], outputs=["c"],
                attrs={"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}),
             Op(name="relu", op_type="Relu", inputs=["c"], outputs=["r"]),
             Op(name="flat", op_type="Flatten", inputs=["r"], outputs=["f"], attrs={"axis": 1}),
             Op(name="fc", op_type="MatMul", inputs=["f", "fw"], outputs=["y"])],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=(2, 3, 16, 16)),
                 "w": TensorSpec(name="w", dtype="float32", shape=(8, 3, 3, 3)),
                 "c": TensorSpec(name="c", dtype="float32", shape=(2, 8, 16, 16)),
                 "r": TensorSpec(name="r", dtype="float32", shape=(2, 8, 16, 16)),
                 "f": TensorSpec(name="f", dtype="float32", shape=(2, 2048)),
                 "fw": TensorSpec(name="fw", dtype="float32", shape=(2048, 10)),
                 "y": TensorSpec(name="y", dtype="float32", shape=(2, 10))},
        inputs=["x"], outputs=["y"],
        initializers={"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
                      "fw": rng.standard_normal((2048, 10)).astype(np.float32)},
    )


@pytest.mark.parametrize("make", [_mlp_graph, _conv_graph])
def test_executable_wrapper_runs_on_any_torch_device(make: object) -> None:
    # The GPU path with device "cpu": checks the wrapper and the test graphs here;
    # the same graphs run on the GPU below.
    from dspark.sdk.reference.executable import TorchExecutable
    from dspark_plugins_cuda.executable import CudaExecutable

    graph = make()  # type: ignore[operator]
    sg = graph.subgraph()
    x = np.random.default_rng(2).standard_normal(graph.tensors["x"].shape).astype(np.float32)
    got = CudaExecutable(sg, "cpu").run({"x": x})
    want = TorchExecutable(sg, "cpu").run({"x": x})
    assert got.keys() == {"y"} and got["y"].shape == graph.tensors["y"].shape
    np.testing.assert_array_equal(got["y"], want["y"])


@needs_gpu
@pytest.mark.parametrize("make", [_mlp_graph, _conv_graph])
def test_compile_and_run_matches_cpu_reference(make: object) -> None:
    from dspark.sdk.reference.executable import TorchExecutable

    graph = make()  # type: ignore[operator]
    host = _host()
    inv = probe(host)
    device = next(drv for drv in inv.drivers() if drv.plugin == "cuda")
    sg = graph.subgraph()
    bid = host.call("cuda", "dspark_bid", subgraph=sg, device=device)
    assert bid is not None and bid.precision == "float32"
    exe = host.call("cuda", "dspark_compile", subgraph=sg, device=device)
    assert exe is not None, host.records["cuda"].reason
    x = np.random.default_rng(2).standard_normal(graph.tensors["x"].shape).astype(np.float32)
    got = exe.run({"x": x})
    want = TorchExecutable(sg, "cpu").run({"x": x})
    rtol, atol = TOLERANCES["float32"]
    np.testing.assert_allclose(got["y"], want["y"], rtol=rtol, atol=atol * float(np.abs(want["y"]).max()))
