"""``dspark_bid``: for subgraphs OpenVINO can run, the subgraph timed on OpenVINO (cached),
else a roofline over the measured device figures (:mod:`dspark.sdk.calibration`).

Weight-bound linears (:func:`dspark.sdk.calibration.streams_weights`), float or
quantized by this plugin, are timed with cold caches, corrected by a tiny
linear of the same kind: in an LLM decode step their weights come from DRAM
while the runtime stays hot, and a warm loop would flatter the float layout.
"""

from __future__ import annotations

from dspark.graph import Subgraph
from dspark.sdk import DEFAULT_OP_OVERHEAD_S, calibration
from dspark.types import Bid, Device, DType
from dspark_plugins_cpu import runtime, support
from dspark_plugins_cpu.quantize import PLUGIN_NAME, quantize


def bid(subgraph: Subgraph, device: Device) -> Bid | None:
    if subgraph.quantized_by not in (None, PLUGIN_NAME):
        return None  # another plugin's packed weights
    if not device.peak_flops:
        return None  # no measured figures: a bid would be a guess
    ov_name = runtime.ov_device(device)
    if support.unsupported_reason(subgraph, ov_name) is not None:
        return None
    compute = runtime.precision(ov_name)  # what the compile config makes the device compute in
    cold = calibration.streams_weights(subgraph)
    # The probe measured the call and per-op overheads on a persistent request, as the executable
    # runs: they stay the fixed part of every bid.
    est = calibration.estimate(
        subgraph, device, runtime_key=f"{device.runtime} {runtime.version()}", compile=_compile(device),
        dtype=compute, op_overhead_s=float(device.properties.get("op_overhead_s", DEFAULT_OP_OVERHEAD_S)),
        call_overhead_s=float(device.properties.get("call_overhead_s", 0.0)), measure_overheads=False,
        flush_caches=cold, cold_baseline=calibration.linear_baseline(
            subgraph, lambda base: quantize(base, device, subgraph.quant_spec)) if cold else None,
    )
    precision = subgraph.quant_spec.precision if subgraph.quantized_by else _precision(subgraph, compute)
    return Bid(device_id=device.id, runtime=device.runtime, latency_s=est.latency_s,
               precision=precision, fixed_overhead_s=est.fixed_overhead_s,
               peak_memory_bytes=_weight_bytes(subgraph) + subgraph.io_bytes(), source=est.source, note=est.note)


def _weight_bytes(subgraph: Subgraph) -> int:
    """What the compiled subgraph holds: a quantized weight at its packed size."""
    if not subgraph.quantized_by:
        return subgraph.param_bytes
    packed = subgraph.payload or {}
    inits = subgraph.graph.initializers
    return sum(int(packed[p].nbytes) if p in packed else int(inits[p].nbytes) for p in subgraph.params)


def _compile(device: Device) -> calibration.Compile:
    """The plugin's ``dspark_compile`` path, for timing."""
    from dspark_plugins_cpu.executable import compile_subgraph

    return lambda sg: compile_subgraph(sg, device)


def _precision(subgraph: Subgraph, compute: DType) -> DType:
    """The precision results carry: a model whose tensors are f16/bf16 rounds to them
    whatever the device computes in, so its bid must claim that tolerance."""
    tensors = subgraph.graph.tensors
    dtypes = {tensors[t].dtype for op in subgraph.ops for t in op.inputs + op.outputs if t in tensors}
    lower: tuple[DType, ...] = ("bfloat16", "float16")
    return next((low for low in lower if low in dtypes), compute)
