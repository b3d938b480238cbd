"""The torch plugin's quantized kernels (dspark.sdk.reference.quant_kernels) against the canonical reference.

The kernels take bfloat16 activations (their float32 paths are scalar code),
so they match ``reference_linear`` within the int8/int4 tolerances, not to
float32 rounding; the packing is pinned by checking that a weight whose
values are exact in bfloat16 comes out to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from dspark.sdk import calibration
from dspark.builtin import torch_ref
from dspark.sdk.reference import quant_kernels as torch_quant
from dspark.graph.model import Subgraph
from dspark.sdk.quant import QuantizedWeight, linear_subgraph, quantize_weight, reference_linear
from dspark.testing import compare, op_case
from dspark.testing.conformance import MLP_CASE, reference_outputs
from dspark.types import Bid, Device, QuantSpec, torch_runner

K, N = 200, 40  # K ragged for groups of 32 and 128 (and not a multiple of 8 once cut to 37); N not a multiple of 16
ROWS = (1, 37)
W = (np.random.default_rng(5).standard_normal((K, N)) / np.sqrt(K)).astype(np.float32)  # outputs ~ N(0, 1)

SPECS: dict[str, QuantSpec] = {
    "int8": QuantSpec(weight_bits=8),
    "int8_dynamic": QuantSpec(weight_bits=8, activations="dynamic_int8"),
    "int4_g32": QuantSpec(weight_bits=4, granularity="group", group_size=32),
    "int4_g128": QuantSpec(weight_bits=4, granularity="group", group_size=128),
    "int4_g256": QuantSpec(weight_bits=4, granularity="group", group_size=256),  # one group: K < 256
    "int4_per_channel": QuantSpec(weight_bits=4),
}
UNSUPPORTED: dict[str, QuantSpec] = {
    "int8_g64": QuantSpec(weight_bits=8, granularity="group", group_size=64),
    "int4_g24": QuantSpec(weight_bits=4, granularity="group", group_size=24),
    "int4_dynamic": QuantSpec(weight_bits=4, granularity="group", group_size=32, activations="dynamic_int8"),
}


@pytest.fixture(scope="module")
def cpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Device]:
    """The torch CPU device, with bids calibrated into a cache only this module writes."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSPARK_CACHE_DIR", str(tmp_path_factory.mktemp("torch-quant-cache")))
        mp.delenv("DSPARK_CALIBRATE", raising=False)
        yield next(d for d in torch_ref.dspark_probe_devices(refresh=False) if d.id == "cpu")


def _x(rows: int, k: int = K) -> np.ndarray:
    return np.random.default_rng(100 + rows).standard_normal((rows, k)).astype(np.float32)


def _variant(cpu: Device, spec: QuantSpec, w: np.ndarray = W) -> Subgraph:
    variant = torch_ref.dspark_quantize(linear_subgraph("proj", w), cpu, spec)
    assert variant is not None, f"no variant for {spec}"
    assert variant.quantized_by == "torch" and variant.quant_spec == spec
    return variant


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("shape", [(K, N), (37, 17)], ids=["200x40", "37x17"])
def test_variants_match_the_reference(cpu: Device, name: str, shape: tuple[int, int]) -> None:
    spec = SPECS[name]
    w = W[: shape[0], : shape[1]]
    exe = torch_ref.dspark_compile(_variant(cpu, spec, w), cpu)
    assert isinstance(exe, torch_ref.LinearExecutable)
    qw = quantize_weight(w, spec)
    for rows in ROWS:
        x = _x(rows, shape[0])
        ok, detail = compare(exe.run({"x": x}), {"y": reference_linear(x, qw, spec.activations)}, ["y"],
                             spec.precision)
        assert ok, f"{name} {shape}, {rows} rows: {detail}"


@pytest.mark.parametrize("bits", [8, 4])
def test_packing_is_exact(bits: int) -> None:
    """Integers and power-of-two scales are exact in bfloat16: any packing slip shows up."""
    rng = np.random.default_rng(1)
    qmax = 127 if bits == 8 else 7
    k, n, group = 96, 48, 32
    q = rng.integers(-qmax, qmax + 1, size=(k, n)).astype(np.int8)
    scales = (2.0 ** rng.integers(-6, 0, size=(1 if bits == 8 else k // group, n))).astype(np.float32)
    if bits == 4:
        nib = (q & 0x0F).astype(np.uint8)
        data = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
        spec = QuantSpec(weight_bits=4, granularity="group", group_size=group)
    else:
        data, group, spec = q, k, QuantSpec(weight_bits=8)
    qw = QuantizedWeight(data=data, scales=scales, bits=bits, group_size=group, shape=(k, n))
    x = rng.integers(-3, 4, size=(5, k)).astype(np.float32)
    got = torch_quant.apply(torch_quant.pack(qw, spec), torch.from_numpy(x)).numpy()
    ok, detail = compare({"y": got}, {"y": reference_linear(x, qw)}, ["y"], "bfloat16")
    assert ok, detail
    # Each output is a sum of exact terms; only the kernel's bfloat16 result rounds (8 bits).
    np.testing.assert_allclose(got, reference_linear(x, qw), rtol=2**-8, atol=1e-6)


def test_dynamic_activations_are_quantized_per_token(cpu: Device) -> None:
    """Rows of very different scales: per-tensor quantization would wipe out the small row."""
    exe = torch_ref.dspark_compile(_variant(cpu, SPECS["int8_dynamic"]), cpu)
    x = _x(3)
    x[1] *= 1e-3
    x[2] = 0.0
    qw = quantize_weight(W, SPECS["int8_dynamic"])
    ref = reference_linear(x, qw, "dynamic_int8")
    got = exe.run({"x": x})["y"]
    np.testing.assert_allclose(got[1], ref[1], rtol=0.05, atol=1e-4)
    assert not got[2].any(), "an all-zero row must give zeros"
    ok, detail = compare({"y": got}, {"y": ref}, ["y"], "int8")
    assert ok, detail


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_specs_without_a_kernel_get_none(cpu: Device, name: str) -> None:
    assert torch_quant.unsupported_reason(UNSUPPORTED[name])
    assert torch_ref.dspark_quantize(linear_subgraph("proj", W), cpu, UNSUPPORTED[name]) is None


def test_no_variant_without_weights_or_off_the_cpu(cpu: Device) -> None:
    sg = linear_subgraph("proj", W)
    no_weight = sg.model_copy(update={"graph": sg.graph.model_copy(update={"initializers": {}})})
    assert torch_ref.dspark_quantize(no_weight, cpu, SPECS["int8"]) is None
    gpu = cpu.model_copy(update={"id": "cuda:0", "kind": "cuda"})
    assert torch_ref.dspark_quantize(sg, gpu, SPECS["int8"]) is None


def test_run_torch_equals_run(cpu: Device) -> None:
    exe = torch_ref.dspark_compile(_variant(cpu, SPECS["int4_g32"]), cpu)
    run_torch = torch_runner(exe)
    assert run_torch is not None
    for rows in ROWS:
        x = _x(rows)
        got = run_torch({"x": torch.from_numpy(x)})["y"]
        assert got.dtype == torch.float32 and got.shape == (rows, N)
        np.testing.assert_array_equal(got.numpy(), exe.run({"x": x})["y"])
    x3 = torch.from_numpy(_x(6)).reshape(2, 3, K)  # leading dims are kept
    np.testing.assert_array_equal(run_torch({"x": x3})["y"].numpy().reshape(6, N), exe.run({"x": _x(6)})["y"])


def test_float_linear_runs_lean_and_unchanged(cpu: Device) -> None:
    """The float x @ W compiles to the same lean executable as its variants (so their bids compare
    kernels, not interpreters), and computes what the op-by-op executable does."""
    sg = linear_subgraph("proj", W)
    exe = torch_ref.dspark_compile(sg, cpu)
    assert isinstance(exe, torch_ref.LinearExecutable)
    x = _x(37)
    np.testing.assert_array_equal(exe.run({"x": x})["y"], torch_ref.TorchExecutable(sg, "cpu").run({"x": x})["y"])


def test_a_subgraph_with_more_ops_runs_its_matmul_quantized(cpu: Device) -> None:
    case = op_case(MLP_CASE)
    sg = case.graph.subgraph()
    variant = torch_ref.dspark_quantize(sg, cpu, SPECS["int8"])
    assert variant is not None
    exe = torch_ref.dspark_compile(variant, cpu)
    assert isinstance(exe, torch_ref.TorchExecutable)
    (weight,) = variant.payload
    assert weight not in exe.weights, "the float weight is not kept beside the packed one"
    ok, detail = compare(exe.run(case.inputs), reference_outputs(case), sg.outputs, "int8")
    assert ok, detail


def test_float_and_int8_bids_of_a_big_linear_are_measured_alike(cpu: Device) -> None:
    w = (np.random.default_rng(2).standard_normal((384, 8192)) / np.sqrt(384)).astype(np.float32)  # lm_head
    sg = linear_subgraph("lm_head", w)
    assert calibration.streams_weights(sg)
    float_bid = torch_ref.dspark_bid(sg, cpu)
    int8_bid = torch_ref.dspark_bid(_variant(cpu, SPECS["int8"], w), cpu)
    for bid, precision in ((float_bid, "float32"), (int8_bid, "int8")):
        assert isinstance(bid, Bid) and bid.precision == precision
        assert bid.source == "calibrated" and "cold caches less a baseline" in bid.note, bid
        assert 0 < bid.latency_s < 0.5
    assert int8_bid.peak_memory_bytes < float_bid.peak_memory_bytes / 3


def test_streams_weights_and_cold_keys(cpu: Device) -> None:
    small = linear_subgraph("small", W)  # 32 KB: timed warm
    big = linear_subgraph("big", np.zeros((384, 640), np.float32))
    assert not calibration.streams_weights(small) and calibration.streams_weights(big)
    assert calibration.streams_weights(torch_ref.dspark_quantize(big, cpu, SPECS["int4_g32"]))
    assert not calibration.streams_weights(op_case("chain_attention").graph.subgraph())
    prefill = linear_subgraph("big", np.zeros((384, 640), np.float32), representative_tokens=128)
    assert not calibration.streams_weights(prefill), "128 rows are compute-bound: timed warm"
    base = calibration.linear_baseline(big)
    assert base is not None and base.graph.dim_hints == big.graph.dim_hints
    assert calibration.linear_baseline(op_case(MLP_CASE).graph.subgraph()) is None
    warm = calibration.cache_key(big, cpu, "torch")
    assert "cold" not in warm and calibration.cache_key(big, cpu, "torch", cold=True) != warm
    flusher = calibration.CacheFlusher()
    assert flusher.buffer.nbytes >= min(2 * calibration.largest_cache_bytes(), 512 << 20)
    flusher()
