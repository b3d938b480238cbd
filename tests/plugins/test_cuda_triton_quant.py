"""The cuda plugin's Triton quantization: kernel layouts, the kernels against the canonical
reference, and the dspark_quantize / dspark_bid / dspark_compile hooks on its variants.

Without a GPU the kernels run in Triton's interpreter on CPU tensors; with one, the same
checks run compiled on the GPU, plus the CUDA-only end-to-end test.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads it once, when triton.language is first imported (nothing in dspark imports
    # Triton before this): its own library functions must be interpreted too.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton.language  # noqa: E402

import dspark_plugins_cuda  # noqa: E402
from dspark.graph.model import Graph, Op, TensorSpec  # noqa: E402
from dspark.sdk.quant import linear_subgraph, quantize_weight, reference_linear  # noqa: E402
from dspark.testing.conformance import compare  # noqa: E402
from dspark.types import Device, QuantSpec  # noqa: E402
from dspark_plugins_cuda import records  # noqa: E402
from dspark_plugins_cuda import triton_quant as tq  # noqa: E402
from dspark_plugins_cuda.bench import Measured  # noqa: E402
from dspark_plugins_cuda.bidding import roofline_s  # noqa: E402
from dspark_plugins_cuda.executable import QuantExecutable  # noqa: E402
from dspark_plugins_cuda.nvml import GpuReading, SystemReading  # noqa: E402
from dspark_plugins_cuda.quantize import why_not  # noqa: E402
from dspark_plugins_cuda.torch_side import TorchGpu  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"
_READY = HAS_CUDA or (tq.interpreted() and type(triton.language.standard.zeros).__name__ == "InterpretedFunction")
needs_kernels = pytest.mark.skipif(
    not _READY, reason="no GPU, and Triton was imported in this process before TRITON_INTERPRET=1 was set, "
                       "so its interpreter cannot run: run this file on its own")
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU on this machine")


def _spec(bits: int, group: int | None = None, act: str = "float") -> QuantSpec:
    if group is None:
        return QuantSpec(weight_bits=bits, granularity="per_channel", activations=act)  # type: ignore[arg-type]
    return QuantSpec(weight_bits=bits, granularity="group", group_size=group, activations=act)  # type: ignore[arg-type]


def _weight(k: int, n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((k, n)) * 0.05).astype(np.float32)


# -- layouts ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [_spec(8), _spec(8, 32), _spec(4), _spec(4, 32), _spec(4, 128)])
@pytest.mark.parametrize(("k", "n"), [(1, 1), (7, 5), (8, 3), (9, 33), (200, 17)])
def test_repack_round_trip_is_exact(spec: QuantSpec, k: int, n: int) -> None:
    qw = quantize_weight(_weight(k, n, seed=k * n), spec)
    packed = tq.repack(qw)
    back = tq.unpack(packed)
    assert back.data.dtype == qw.data.dtype and np.array_equal(back.data, qw.data)
    assert np.array_equal(back.scales, qw.scales) and back.scales.dtype == np.float32
    assert (back.bits, back.group_size, back.shape) == (qw.bits, qw.group_size, qw.shape)
    if spec.weight_bits == 8:
        assert packed.data.dtype == np.int8 and packed.data.shape == (n, k) and packed.data.flags.c_contiguous
    else:
        assert packed.data.dtype == np.int32 and packed.data.shape == (-(-k // 8), n)
    assert packed.nbytes == packed.data.nbytes + packed.scales.nbytes


def test_int4_words_hold_eight_offset_nibbles_along_k() -> None:
    # Per-channel scale 1: the weights are their own quantized values.
    q = np.array([-7, -3, 0, 1, 2, 3, 6, 7, -1], dtype=np.float32)
    w = np.stack([q, -q], axis=1)  # (K=9, N=2)
    packed = tq.repack(quantize_weight(w, _spec(4)))
    words = packed.data.view(np.uint32)
    expect = sum(int(v + 8) << (4 * j) for j, v in enumerate(q[:8]))
    assert int(words[0, 0]) == expect
    assert int(words[1, 0]) == (int(q[8]) + 8) | sum(8 << (4 * j) for j in range(1, 8))  # padding = 0
    assert int(words[0, 1]) == sum(int(-v + 8) << (4 * j) for j, v in enumerate(q[:8]))


def test_repack_rejects_other_bit_widths() -> None:
    qw = quantize_weight(_weight(8, 4), _spec(8))
    with pytest.raises(ValueError, match="2-bit"):
        tq.repack(type(qw)(data=qw.data, scales=qw.scales, bits=2, group_size=8, shape=(8, 4)))


# -- kernels vs the canonical reference ---------------------------------------------------------

# (spec, rows, K, N, activation dtype): ragged M/N/K, decode (1 row) and prefill-like (33 rows).
KERNEL_CASES = [
    (_spec(8), 1, 200, 100, torch.float32),
    (_spec(8), 33, 200, 100, torch.float32),
    (_spec(8), 5, 96, 72, torch.float16),
    (_spec(8, 32), 17, 200, 70, torch.float32),
    (_spec(8, act="dynamic_int8"), 1, 200, 100, torch.float32),
    (_spec(8, act="dynamic_int8"), 33, 130, 70, torch.float32),
    (_spec(8, 64, act="dynamic_int8"), 5, 200, 40, torch.float32),
    (_spec(4, 32), 1, 200, 100, torch.float32),
    (_spec(4, 32), 33, 200, 100, torch.float32),
    (_spec(4, 128), 33, 300, 70, torch.float32),  # 3 groups, the last one partial
    (_spec(4, 128), 3, 100, 24, torch.float32),  # K < group size: one group
    (_spec(4), 7, 101, 50, torch.float16),
]


def _case_id(case: tuple) -> str:  # type: ignore[type-arg]
    spec, m, k, n, dtype = case
    gran = f"g{spec.group_size}" if spec.granularity == "group" else "pc"
    act = "a8" if spec.activations == "dynamic_int8" else str(dtype).removeprefix("torch.")
    return f"w{spec.weight_bits}-{gran}-{act}-{m}x{k}x{n}"


def _tight_rtol(dtype: torch.dtype) -> float:
    # Error relative to max|y|: only float rounding separates the kernel from the float64
    # reference of the same quantized math (fp32 on the GPU goes through TF32).
    return 1e-5 if dtype == torch.float32 and not HAS_CUDA else 4e-3


@needs_kernels
@pytest.mark.parametrize("case", KERNEL_CASES, ids=_case_id)
def test_kernel_matches_reference(case: tuple) -> None:  # type: ignore[type-arg]
    spec, m, k, n, dtype = case
    rng = np.random.default_rng(m * 1000 + k)
    qw = quantize_weight(_weight(k, n, seed=n), spec)
    linear = tq.QuantLinear(tq.repack(qw), DEVICE, dynamic_int8=spec.activations == "dynamic_int8")
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
    y = linear(x.to(DEVICE))
    assert y.dtype == dtype and y.shape == (m, n)
    got = y.float().cpu().numpy()
    want = reference_linear(x.float().numpy(), qw, spec.activations)
    ok, detail = compare({"y": got}, {"y": want}, ["y"], spec.precision)
    assert ok, detail
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=_tight_rtol(dtype) * scale)


@needs_kernels
def test_kernel_keeps_leading_dims_and_takes_empty_and_strided_inputs() -> None:
    spec = _spec(4, 32)
    qw = quantize_weight(_weight(64, 40), spec)
    linear = tq.QuantLinear(tq.repack(qw), DEVICE)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((2, 3, 64)).astype(np.float32)).to(DEVICE)
    y = linear(x)
    assert y.shape == (2, 3, 40)
    want = reference_linear(x.reshape(6, 64).cpu().numpy(), qw)
    np.testing.assert_allclose(y.reshape(6, 40).cpu().numpy(), want, rtol=0,
                               atol=_tight_rtol(torch.float32) * float(np.abs(want).max()))
    wide = torch.zeros((6, 128), device=DEVICE)
    wide[:, ::2] = x.reshape(6, 64)
    np.testing.assert_array_equal(linear(wide[:, ::2]).cpu().numpy(), y.reshape(6, 40).cpu().numpy())
    assert linear(torch.zeros((0, 64), device=DEVICE)).shape == (0, 40)
    with pytest.raises(ValueError, match="64"):
        linear(torch.zeros((1, 63), device=DEVICE))
    with pytest.raises(TypeError, match="float64"):
        linear(torch.zeros((1, 64), dtype=torch.float64, device=DEVICE))


@needs_kernels
def test_activation_quantization_is_exactly_the_reference() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 1500)).astype(np.float32)  # K over one 1024 block
    x[0, :6] = [127.0, 2.5, 3.5, -2.5, -0.5, 0.49999997]  # scale 1: ties round to even
    x[0, 6:] = 0.1
    x[1] = 0.0  # an all-zero row gets scale 1
    xq, xs = tq.quantize_rows(torch.from_numpy(x).to(DEVICE))
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    want = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    assert list(xq[0, :6].cpu().numpy()) == [127, 2, 4, -2, 0, 0]
    np.testing.assert_array_equal(xq.cpu().numpy(), want)
    np.testing.assert_array_equal(xs.cpu().numpy(), scale[:, 0])


# -- hooks ---------------------------------------------------------------------------------------

SYSTEM = SystemReading(driver_version="550.54.15", cuda_driver_version="12.4")
MEASURED = Measured(peak_flops={"float32": 5.1e13, "float16": 6.6e14, "bfloat16": 6.7e14, "tf32": 3.7e14},
                    memory_bandwidth_bytes_per_s=2.9e12)


def _gpu(cc: tuple[int, int] = (9, 0), triton: str | None = "3.9.0", free: int = 84540784640) -> Device:
    """An H100 as the plugin's probe reports it (records.device_record over NVML readings)."""
    reading = GpuReading(
        index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-6f1b2c3d-aaaa-bbbb-cccc-0123456789ab",
        pci_bus_id="00000000:18:00.0", compute_capability=cc, memory_total_bytes=85520809984,
        memory_free_bytes=free, utilization_gpu_percent=0, pcie_current_generation=5, pcie_current_width=16,
        pcie_max_generation=5, pcie_max_width=16)
    gpu = TorchGpu(index=0, sm_count=132, torch_version="2.5.1+cu124", torch_cuda_version="12.4")
    return records.device_record(reading, SYSTEM, gpu, MEASURED, triton)


def _relu_graph() -> Graph:
    return Graph(name="relu", ops=[Op(name="r", op_type="Relu", inputs=["x"], outputs=["y"])],
                 tensors={n: TensorSpec(name=n, dtype="float32", shape=(4, 8)) for n in ("x", "y")},
                 inputs=["x"], outputs=["y"])


def _mlp_graph() -> Graph:
    w = _weight(16, 8)
    return Graph(
        name="mlp",
        ops=[Op(name="mm", op_type="MatMul", inputs=["x", "w"], outputs=["h"]),
             Op(name="act", op_type="Relu", inputs=["h"], outputs=["y"])],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=(4, 16)),
                 "w": TensorSpec(name="w", dtype="float32", shape=(16, 8)),
                 "h": TensorSpec(name="h", dtype="float32", shape=(4, 8)),
                 "y": TensorSpec(name="y", dtype="float32", shape=(4, 8))},
        inputs=["x"], outputs=["y"], initializers={"w": w})


def _two_matmuls() -> Graph:
    return Graph(
        name="two",
        ops=[Op(name="a", op_type="MatMul", inputs=["x", "w1"], outputs=["h"], flops=2 * 3 * 64 * 96),
             Op(name="b", op_type="MatMul", inputs=["h", "w2"], outputs=["y"], flops=2 * 3 * 96 * 40)],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=("tokens", 64)),
                 "w1": TensorSpec(name="w1", dtype="float32", shape=(64, 96)),
                 "h": TensorSpec(name="h", dtype="float32", shape=("tokens", 96)),
                 "w2": TensorSpec(name="w2", dtype="float32", shape=(96, 40)),
                 "y": TensorSpec(name="y", dtype="float32", shape=("tokens", 40))},
        inputs=["x"], outputs=["y"], initializers={"w1": _weight(64, 96, 1), "w2": _weight(96, 40, 2)},
        dim_hints={"tokens": 3})


LINEAR = linear_subgraph("proj", _weight(256, 96))


@pytest.mark.parametrize(("subgraph", "device", "spec", "why"), [
    (_relu_graph().subgraph(), _gpu(), _spec(8), "not a MatMul"),
    (_mlp_graph().subgraph(), _gpu(), _spec(8), "not a MatMul"),
    (LINEAR, _gpu(), QuantSpec(weight_bits=8, symmetric=False), "asymmetric"),
    (LINEAR, _gpu(), _spec(4, 32, act="dynamic_int8"), "weight-only"),
    (LINEAR, _gpu(), _spec(4, 48), "multiple of 32"),
    (LINEAR, _gpu(cc=(7, 0)), _spec(8), "compute capability 7.0"),
    (LINEAR, _gpu(triton=None), _spec(8), "Triton"),
], ids=["relu", "matmul+relu", "asymmetric", "int4-a8", "group48", "volta", "no-triton"])
def test_quantize_abstains_without_a_kernel(subgraph, device, spec, why) -> None:  # type: ignore[no-untyped-def]
    assert why in (why_not(subgraph, device, spec) or "")
    assert dspark_plugins_cuda.dspark_quantize(subgraph=subgraph, device=device, spec=spec) is None


def test_quantize_abstains_for_a_cpu_device_and_weight_on_the_left() -> None:
    cpu = _gpu().model_copy(update={"id": "cpu", "kind": "cpu"})
    assert dspark_plugins_cuda.dspark_quantize(subgraph=LINEAR, device=cpu, spec=_spec(8)) is None
    g = LINEAR.graph
    swapped = g.model_copy(update={"ops": [g.ops[0].model_copy(update={"inputs": ["proj.weight", "x"]})]})
    assert dspark_plugins_cuda.dspark_quantize(subgraph=swapped.subgraph(), device=_gpu(), spec=_spec(8)) is None


@pytest.mark.parametrize("spec", [_spec(8), _spec(8, 64), _spec(8, act="dynamic_int8"), _spec(4, 32),
                                  _spec(4, 128), _spec(4, 48)])
def test_quantize_returns_a_variant_with_packed_weights(spec: QuantSpec) -> None:
    # Group 48 is refused for K=256 (above); for K=40 it is one group, i.e. per channel.
    sg = linear_subgraph("small", _weight(40, 24)) if spec.group_size == 48 else LINEAR
    variant = dspark_plugins_cuda.dspark_quantize(subgraph=sg, device=_gpu(), spec=spec)
    assert variant is not None
    assert (variant.quantized_by, variant.quant_spec) == ("cuda", spec)
    assert variant.op_names == sg.op_names and variant.outputs == sg.outputs and variant.inputs == sg.inputs
    wname = next(iter(sg.graph.initializers))
    assert list(variant.payload) == [wname]
    packed = variant.payload[wname]
    assert isinstance(packed, tq.PackedWeight)
    canonical = quantize_weight(sg.graph.initializers[wname], spec)
    back = tq.unpack(packed)
    assert np.array_equal(back.data, canonical.data) and np.array_equal(back.scales, canonical.scales)
    assert variant.signature() != sg.signature()


def test_bid_on_own_variant_counts_packed_weight_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_CALIBRATE", "0")  # the pure roofline: no GPU to time on here
    device = _gpu()
    sg = linear_subgraph("up", _weight(768, 4096))  # decode: 1 row, weight traffic dominates
    float_bid = dspark_plugins_cuda.dspark_bid(subgraph=sg, device=device)
    assert float_bid is not None
    bids = {}
    for name, spec in {"int8": _spec(8), "int4": _spec(4, 128), "w8a8": _spec(8, act="dynamic_int8")}.items():
        variant = dspark_plugins_cuda.dspark_quantize(subgraph=sg, device=device, spec=spec)
        bid = dspark_plugins_cuda.dspark_bid(subgraph=variant, device=device)
        assert bid is not None and bid.source == "roofline" and bid.precision == spec.precision
        assert bid.device_id == "cuda:0" and bid.runtime == "torch-cuda"
        assert bid.latency_s == pytest.approx(roofline_s(variant, device))
        packed = variant.payload["up.weight"].nbytes
        assert packed < sg.param_bytes / 3
        assert packed <= bid.peak_memory_bytes < sg.param_bytes
        bids[name] = bid.latency_s
    assert bids["int4"] < bids["int8"] < float_bid.latency_s
    assert bids["w8a8"] > bids["int8"]  # one more launch per call
    full = device.model_copy(update={"memory_free_bytes": 1 << 20})
    variant = dspark_plugins_cuda.dspark_quantize(subgraph=sg, device=device, spec=_spec(8))
    assert dspark_plugins_cuda.dspark_bid(subgraph=variant, device=full) is None


def test_hooks_leave_other_plugins_variants_alone() -> None:
    other = LINEAR.model_copy(update={"quantized_by": "torch", "quant_spec": _spec(8), "payload": {}})
    assert dspark_plugins_cuda.dspark_bid(subgraph=other, device=_gpu()) is None
    assert dspark_plugins_cuda.dspark_compile(subgraph=other, device=_gpu()) is None


@needs_kernels
@pytest.mark.parametrize("spec", [_spec(8), _spec(8, act="dynamic_int8"), _spec(4, 32)])
def test_executable_runs_the_variant(spec: QuantSpec) -> None:
    # The executable dspark_compile returns, on DEVICE (the interpreter here): chained MatMuls,
    # a symbolic row count, host arrays through run() and tensors through run_torch().
    graph = _two_matmuls()
    variant = dspark_plugins_cuda.dspark_quantize(subgraph=graph.subgraph(), device=_gpu(), spec=spec)
    assert variant is not None
    exe = QuantExecutable(variant, DEVICE)
    for rows in (1, 3):
        x = np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32)
        got = exe.run({"x": x})
        h = reference_linear(x, tq.unpack(variant.payload["w1"]), spec.activations)
        want = reference_linear(h, tq.unpack(variant.payload["w2"]), spec.activations)
        ok, detail = compare(got, {"y": want}, ["y"], spec.precision)
        assert ok, detail
        torch_out = exe.run_torch({"x": torch.from_numpy(x).to(DEVICE)})
        assert list(torch_out) == ["y"] and torch_out["y"].device.type == DEVICE
        np.testing.assert_array_equal(torch_out["y"].cpu().numpy(), got["y"])


def test_kernels_refuse_the_wrong_device() -> None:
    packed = tq.repack(quantize_weight(_weight(32, 8), _spec(8)))
    if tq.interpreted():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET is set"):
            tq.QuantLinear(packed, "cuda:0")
    else:
        with pytest.raises(RuntimeError, match="need CUDA tensors"):
            tq.QuantLinear(packed, "cpu")


# -- on a GPU -------------------------------------------------------------------------------------

@needs_gpu
def test_gpu_variants_through_the_plugin_host() -> None:
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost
    from dspark.host.settings import PluginSettings

    host = PluginHost(PluginSettings.from_env(env={})).load()
    device = next(d for d in probe(host).drivers() if d.plugin == "cuda")
    sg = linear_subgraph("qkv", _weight(384, 640))
    for spec in (_spec(8), _spec(8, act="dynamic_int8"), _spec(4, 128), _spec(4, 32)):
        variant = host.call("cuda", "dspark_quantize", subgraph=sg, device=device, spec=spec)
        assert variant is not None, host.records["cuda"].reason
        bid = host.call("cuda", "dspark_bid", subgraph=variant, device=device)
        assert bid is not None and bid.precision == spec.precision, host.records["cuda"].reason
        exe = host.call("cuda", "dspark_compile", subgraph=variant, device=device)
        assert exe is not None, host.records["cuda"].reason
        qw = tq.unpack(variant.payload["qkv.weight"])
        for rows in (1, 7, 128, 513):
            x = np.random.default_rng(rows).standard_normal((rows, 384)).astype(np.float32)
            got = exe.run({"x": x})
            ok, detail = compare(got, {"y": reference_linear(x, qw, spec.activations)}, ["y"], spec.precision)
            assert ok, f"{spec} rows={rows}: {detail}"
            y = exe.run_torch({"x": torch.from_numpy(x).to(device.id)})["y"]
            assert y.is_cuda
            np.testing.assert_array_equal(y.cpu().numpy(), got["y"])
            for dtype in (torch.float16, torch.bfloat16):
                xh = torch.from_numpy(x).to(device.id, dtype)
                yh = exe.run_torch({"x": xh})["y"]
                assert yh.dtype == dtype
                want = reference_linear(xh.float().cpu().numpy(), qw, spec.activations)
                ok, detail = compare({"y": yh.float().cpu().numpy()}, {"y": want}, ["y"], spec.precision)
                assert ok, f"{spec} rows={rows} {dtype}: {detail}"
