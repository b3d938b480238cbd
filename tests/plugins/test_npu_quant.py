"""The npu plugin's quantized variants, run for real on ONNX Runtime's CPU EP against the canonical reference.

``dspark.sdk.quant.reference_linear`` (float64 over the canonical int8/int4
weights) is what every variant must compute, within ``TOLERANCES`` of its
precision; a format given its exact settings must match it to float32
rounding, which pins down the packing.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import dspark_plugins_npu as npu
from dspark import Device, Unavailable
from dspark.graph.model import Graph, Subgraph
from dspark.sdk.quant import linear_subgraph, quantize_weight, reference_linear
from dspark.testing import compare, op_case
from dspark.types import QuantSpec
from dspark_plugins_npu import models, quantize, session
from dspark_plugins_npu.executable import OrtExecutable
from dspark_plugins_npu.quantize import QuantPayload

CPU_EP = "CPUExecutionProvider"
K, N = 200, 48  # K is ragged for groups of 32 and 128 (and 24, 64)
ROWS = (1, 37)
W = (np.random.default_rng(11).standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)  # outputs ~ N(0, 1)

SPECS: dict[str, QuantSpec] = {
    "int8_dynamic": QuantSpec(weight_bits=8, activations="dynamic_int8"),
    "int8_weight_only": QuantSpec(weight_bits=8),
    "int8_g64": QuantSpec(weight_bits=8, granularity="group", group_size=64),
    "int4_g32": QuantSpec(weight_bits=4, granularity="group", group_size=32),
    "int4_g128": QuantSpec(weight_bits=4, granularity="group", group_size=128),
    "int4_g32_dynamic": QuantSpec(weight_bits=4, granularity="group", group_size=32, activations="dynamic_int8"),
    "int4_per_channel": QuantSpec(weight_bits=4),
    "int4_g24": QuantSpec(weight_bits=4, granularity="group", group_size=24),  # no power-of-two block fits
}
# What the CPU EP gets: ORT's contrib MatMulNBits wherever a block size fits the groups.
EXPECTED_FORMAT = {name: "qdq" if name == "int4_g24" else "matmul_nbits" for name in SPECS}


@pytest.fixture(scope="module")
def probed() -> list[Device | Unavailable]:
    return npu.dspark_probe_devices(refresh=False)


@pytest.fixture(scope="module")
def cpu(probed: list[Device | Unavailable]) -> Device:
    return next(d for d in probed if isinstance(d, Device) and d.properties["execution_provider"] == CPU_EP)


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + rows).standard_normal((rows, K)).astype(np.float32)


def _assert_matches(out: dict[str, np.ndarray], x: np.ndarray, spec: QuantSpec, precision: str,
                    activations: str | None = None) -> None:
    ref = reference_linear(x, quantize_weight(W, spec), activations or spec.activations)
    ok, detail = compare(out, {"y": ref}, ["y"], precision)
    assert ok, detail


def _variant(cpu: Device, spec: QuantSpec) -> Subgraph:
    variant = npu.dspark_quantize(linear_subgraph("proj", W), cpu, spec)
    assert variant is not None, f"no variant for {spec}"
    return variant


# -- the hook, end to end ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SPECS))
def test_variant_matches_reference_at_any_row_count(name: str, cpu: Device) -> None:
    spec = SPECS[name]
    float_sg = linear_subgraph("proj", W)
    variant = _variant(cpu, spec)
    assert variant.quantized_by == "npu" and variant.quant_spec == spec
    assert variant.inputs == float_sg.inputs and variant.outputs == float_sg.outputs
    payload = variant.payload
    assert isinstance(payload, QuantPayload)
    assert payload.format == EXPECTED_FORMAT[name] and payload.execution_provider == CPU_EP
    assert payload.weights == ("proj.weight",)
    exe = npu.dspark_compile(variant, cpu)
    assert exe is not None
    for rows in ROWS:  # one compiled session, a symbolic row count
        x = _x(rows)
        _assert_matches(exe.run({"x": x}), x, spec, spec.precision)


@pytest.mark.parametrize("name", ["int8_dynamic", "int4_g128"])
def test_run_torch_equals_run(name: str, cpu: Device) -> None:
    exe = npu.dspark_compile(_variant(cpu, SPECS[name]), cpu)
    assert isinstance(exe, OrtExecutable)
    x = _x(37)
    expected = exe.run({"x": x})["y"]
    xt = torch.from_numpy(np.asfortranarray(x))  # a strided view: copied once to contiguous, not refused
    got = exe.run_torch({"x": xt})["y"]
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu" and got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(expected))
    with_grad = torch.from_numpy(x.copy()).requires_grad_()  # the general path: detached, not refused
    assert torch.equal(exe.run_torch({"x": with_grad})["y"], got)


@pytest.mark.parametrize("name", ["int8_dynamic", "int4_g32"])
def test_bid_on_own_variant(name: str, cpu: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_CALIBRATE", "1")
    spec = SPECS[name]
    float_bid = npu.dspark_bid(linear_subgraph("proj", W), cpu)
    bid = npu.dspark_bid(_variant(cpu, spec), cpu)
    assert bid is not None and float_bid is not None
    assert bid.precision == spec.precision and float_bid.precision == "float32"
    assert bid.runtime == f"onnxruntime/{CPU_EP}" and bid.device_id == "cpu"
    assert bid.source == "calibrated" and bid.latency_s > 0  # timed through dspark_compile
    assert bid.peak_memory_bytes < float_bid.peak_memory_bytes  # the packed weights, not the float ones


def test_variant_runs_on_the_ep_in_its_quantized_kernel(cpu: Device) -> None:
    # The plugin's sessions refuse a fallback (session.create); here we also see which kernels ran.
    exe = OrtExecutable(_variant(cpu, SPECS["int4_g32"]), cpu, record_assignment=True)
    assert exe.session.get_providers() == [CPU_EP]
    placed = [(sg.ep_name, n.op_type) for sg in exe.session.get_provider_graph_assignment_info()
              for n in sg.get_nodes()]
    assert placed == [(CPU_EP, "MatMulNBits")], placed


def test_chain_with_nd_activations(cpu: Device) -> None:
    """MatMul -> Add -> Relu on [batch, seq, K]: the quantized node sits inside a larger subgraph."""
    b = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, K])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, N])],
                          initializer=[helper.make_tensor("W", TensorProto.FLOAT, [K, N], W.tobytes(), raw=True),
                                       helper.make_tensor("b", TensorProto.FLOAT, [N], b.tobytes(), raw=True)])
    graph = Graph.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.random.default_rng(4).standard_normal((2, 3, K)).astype(np.float32)
    for spec in (SPECS["int8_dynamic"], SPECS["int4_g32"]):
        variant = npu.dspark_quantize(graph.subgraph(), cpu, spec)
        assert variant is not None and variant.payload.weights == ("W",)
        exe = npu.dspark_compile(variant, cpu)
        assert exe is not None
        lin = reference_linear(x.reshape(-1, K), quantize_weight(W, spec), spec.activations).reshape(2, 3, N)
        ok, detail = compare(exe.run({"x": x}), {"y": np.maximum(lin + b, 0)}, ["y"], spec.precision)
        assert ok, detail


# -- every ORT format, on the CPU EP ----------------------------------------------------------

# (format, spec, accuracy level, precision to hold, activations of the reference). The exact settings
# (fp32 compute for MatMulNBits, per-token MatMulInteger) must reproduce the reference to float32
# rounding: that pins the packing, zero points and block scales. The QDQ models are checked twice: as
# written (graph optimizations off, so DequantizeLinear really runs: exact), and as ORT runs them (it fuses
# them into MatMulNBits with int8 activations where a block size fits: the spec's tolerance).
FORMAT_CASES = [
    ("matmul_nbits", "int8_weight_only", 0, "float32", "float"),
    ("matmul_nbits", "int8_g64", 0, "float32", "float"),
    ("matmul_nbits", "int4_g32", 0, "float32", "float"),
    ("matmul_nbits", "int4_g128", 0, "float32", "float"),
    ("matmul_nbits", "int4_per_channel", 0, "float32", "float"),
    ("matmul_nbits", "int8_dynamic", 4, "int8", None),
    ("matmul_nbits", "int4_g32_dynamic", 4, "int4", None),
    ("matmul_integer", "int8_dynamic", 0, "float32", None),
    ("qdq", "int8_weight_only", 0, "int8", None),
    ("qdq", "int8_g64", 0, "int8", None),
    ("qdq", "int4_g32", 0, "int4", None),
    ("qdq", "int4_g128", 0, "int4", None),
    ("qdq", "int4_g24", 0, "int4", None),
]


@pytest.mark.parametrize(("fmt", "name", "level", "precision", "activations"), FORMAT_CASES,
                         ids=[f"{c[0]}-{c[1]}-L{c[2]}" for c in FORMAT_CASES])
def test_each_ort_format_on_the_cpu_ep(fmt: str, name: str, level: int, precision: str,
                                       activations: str | None) -> None:
    spec = SPECS[name]
    built = quantize.build_model(linear_subgraph("proj", W), spec, fmt, accuracy_level=level)
    assert built is not None
    model, replaced, param_bytes = built
    assert replaced == ("proj.weight",) and 0 < param_bytes < W.nbytes
    sessions = [(session.create(model, CPU_EP), precision, activations)]
    if fmt == "qdq":
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        sessions.append((ort.InferenceSession(model, so, providers=[CPU_EP]), "float32", "float"))
    for sess, prec, act in sessions:
        for rows in ROWS:
            x = _x(rows, seed=5)
            _assert_matches({"y": sess.run(None, {"x": x})[0]}, x, spec, prec, act)


def test_matmul_nbits_layout() -> None:
    spec = SPECS["int4_g32"]
    qw = quantize_weight(W, spec)
    assert quantize.nbits_block(qw) == 32
    packed, scales = quantize.pack_matmul_nbits(qw, 32)
    blocks = -(-K // 32)
    assert packed.shape == (N, blocks, 16) and packed.dtype == np.uint8
    assert scales.shape == (N, blocks) and np.array_equal(scales, qw.scales.T)
    q = quantize._int_values(qw)
    # Column 5, block 1, byte 3 holds K rows 32 + 6 (low nibble) and 32 + 7 (high), offset by 8.
    assert int(packed[5, 1, 3]) == (int(q[38, 5]) + 8) | ((int(q[39, 5]) + 8) << 4)
    # Per-channel scales repeat per block; group 24 has no power-of-two block inside its groups.
    assert quantize.nbits_block(quantize_weight(W, SPECS["int4_per_channel"])) == 128
    assert quantize.nbits_block(quantize_weight(W, SPECS["int8_g64"])) == 64
    assert quantize.nbits_block(quantize_weight(W, SPECS["int4_g24"])) is None


# -- abstaining ---------------------------------------------------------------------------------


def test_quantize_returns_none_for_what_it_has_no_kernel_for(cpu: Device) -> None:
    sg = linear_subgraph("proj", W)
    assert npu.dspark_quantize(sg, cpu, QuantSpec(weight_bits=8, symmetric=False)) is None
    variant = _variant(cpu, SPECS["int8_dynamic"])
    assert npu.dspark_quantize(variant, cpu, SPECS["int4_g32"]) is None  # already quantized
    softmax = op_case("Softmax").graph.subgraph()
    assert npu.dspark_quantize(softmax, cpu, SPECS["int8_dynamic"]) is None  # no weight
    gemm = op_case("Gemm").graph.subgraph()  # weight read transposed: not a MatMul weight
    assert npu.dspark_quantize(gemm, cpu, SPECS["int8_dynamic"]) is None
    torch_cpu = cpu.model_copy(update={"runtime": "torch", "properties": {}})
    assert npu.dspark_quantize(sg, torch_cpu, SPECS["int8_dynamic"]) is None  # not one of our devices
    # The exact per-token format takes per-channel int8 with dynamic activations only.
    assert quantize.build_model(sg, SPECS["int8_weight_only"], "matmul_integer") is None
    assert quantize.build_model(sg, SPECS["int4_g32_dynamic"], "matmul_integer") is None
    assert "matmul_integer" not in quantize.formats_for(CPU_EP, SPECS["int8_g64"])


@pytest.mark.filterwarnings("ignore:Specified provider:UserWarning")  # ORT's note on an EP it lacks
@pytest.mark.parametrize("ep", ["CUDAExecutionProvider", "QNNExecutionProvider"])
def test_an_ep_that_cannot_run_it_gets_no_variant(ep: str, cpu: Device) -> None:
    """No silent fallback: every format is tried on the EP itself (strictly), none runs, so None."""
    if ep in ort.get_available_providers():
        try:
            with session.quiet_ort():
                session.create(models.PROBE_MODEL, ep, strict=False)
            pytest.skip(f"{ep} is usable here")
        except session.EpUnusable:
            pass
    fake = cpu.model_copy(update={"id": "npu:0", "kind": "npu", "runtime": f"onnxruntime/{ep}",
                                  "properties": {**cpu.properties, "execution_provider": ep}})
    with session.quiet_ort():
        for spec in (SPECS["int8_dynamic"], SPECS["int4_g32"]):
            assert npu.dspark_quantize(linear_subgraph("proj", W), fake, spec) is None


def test_format_order_per_ep() -> None:
    assert quantize.formats_for(CPU_EP, SPECS["int8_dynamic"]) == ["matmul_nbits", "qdq", "matmul_integer"]
    assert quantize.formats_for("CUDAExecutionProvider", SPECS["int4_g32"]) == ["matmul_nbits", "qdq"]
    assert quantize.formats_for("QNNExecutionProvider", SPECS["int8_dynamic"])[0] == "qdq"
    assert quantize.formats_for("OpenVINOExecutionProvider", SPECS["int4_g128"]) == ["qdq", "matmul_nbits"]


# -- on a GPU, when there is one ----------------------------------------------------------------


def _usable_gpu(probed: list[Device | Unavailable]) -> Device | None:
    return next((d for d in probed if isinstance(d, Device)
                 and d.properties.get("execution_provider") == "CUDAExecutionProvider"), None)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["int8_dynamic", "int4_g32", "int4_g128"])
def test_cuda_ep_variants(name: str, probed: list[Device | Unavailable]) -> None:
    gpu = _usable_gpu(probed)
    if gpu is None:
        pytest.skip("no usable CUDA GPU for ONNX Runtime's CUDA execution provider")
    spec = SPECS[name]
    variant = npu.dspark_quantize(linear_subgraph("proj", W), gpu, spec)
    assert variant is not None and variant.payload.execution_provider == "CUDAExecutionProvider"
    exe = npu.dspark_compile(variant, gpu)
    assert exe is not None
    for rows in ROWS:
        x = _x(rows)
        _assert_matches(exe.run({"x": x}), x, spec, spec.precision)
