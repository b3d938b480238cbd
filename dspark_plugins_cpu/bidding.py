"""``dspark_bid``: for subgraphs OpenVINO can run, the subgraph timed on OpenVINO (cached),
else a roofline over the measured device figures (:mod:`dspark.calibration`)."""

from __future__ import annotations

from dspark import calibration
from dspark.cost import DEFAULT_OP_OVERHEAD_S
from dspark.graph import Subgraph
from dspark.types import Bid, Device, DType
from dspark_plugins_cpu import runtime, support


def bid(subgraph: Subgraph, device: Device) -> Bid | None:
    if subgraph.quantized_by is not None:
        return None  # another plugin's packed weights; this plugin has no quantize hook
    if not device.peak_flops:
        return None  # no measured figures: a bid would be a guess
    ov_name = runtime.ov_device(device)
    if support.unsupported_reason(subgraph, ov_name) is not None:
        return None
    compute = runtime.precision(ov_name)  # what the compile config makes the device compute in
    # The probe measured the call and per-op overheads on a persistent request, as the executable
    # runs: they stay the fixed part of every bid.
    est = calibration.estimate(
        subgraph, device, runtime_key=f"{device.runtime} {runtime.version()}", compile=_compile(device),
        dtype=compute, op_overhead_s=float(device.properties.get("op_overhead_s", DEFAULT_OP_OVERHEAD_S)),
        call_overhead_s=float(device.properties.get("call_overhead_s", 0.0)), measure_overheads=False,
    )
    return Bid(device_id=device.id, runtime=device.runtime, latency_s=est.latency_s,
               precision=_precision(subgraph, compute), fixed_overhead_s=est.fixed_overhead_s,
               peak_memory_bytes=subgraph.param_bytes + subgraph.io_bytes(), source=est.source, note=est.note)


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
