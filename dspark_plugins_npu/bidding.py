"""Bids: how long an execution provider takes on a subgraph it supports.

Whether it can run the subgraph (and answer right) is :mod:`.support`'s
verdict, asked first; this module only prices. Our own quantized variants are
bid on at their precision, timed like float subgraphs; weight-bound linears
(:func:`dspark.sdk.calibration.streams_weights`), float or quantized, are timed
with cold caches on a CPU, as in an LLM decode step (their weights come from
DRAM there, and a warm loop would flatter the float layout).
"""

from __future__ import annotations

from dspark.graph import Subgraph
from dspark.sdk import calibration, get_logger
from dspark.types import Bid, Device
from dspark_plugins_npu import providers, session, support
from dspark_plugins_npu.executable import compile_subgraph, ep_of

log = get_logger("dspark_plugins_npu")


def bid(subgraph: Subgraph, device: Device, plugin: str) -> Bid | None:
    if subgraph.quantized_by not in (None, plugin):
        return None  # another plugin's packed weights mean nothing to ONNX Runtime
    if "execution_provider" not in device.properties:
        return None
    ep, index = ep_of(device)
    if (reason := support.why_not(subgraph, ep, index)) is not None:
        log.debug("bid.abstain", ep=ep, ops=[op.op_type for op in subgraph.ops][:8], reason=reason)
        return None
    quantized = subgraph.quantized_by is not None
    compute = subgraph.quant_spec.precision if quantized else providers.info(ep).precision
    # A quantized variant carries its spec's precision; a float one what its tensors and kernels keep.
    precision = compute if quantized else support.result_precision(subgraph, compute)
    params = subgraph.payload.param_bytes if quantized else subgraph.param_bytes
    # The probe measured the call and per-op overheads on sessions of this provider: reused as they are.
    est = calibration.estimate(
        subgraph, device, runtime_key=f"{providers.runtime_name(ep)} {session.ort().__version__}",
        compile=_compile(device, plugin), dtype=compute,
        op_overhead_s=float(device.properties.get("op_overhead_s", 2e-6)),
        call_overhead_s=float(device.properties.get("call_overhead_s", 0.0)), measure_overheads=False,
        flush_caches=calibration.streams_weights(subgraph),
    )
    return Bid(device_id=device.id, runtime=providers.runtime_name(ep), latency_s=est.latency_s,
               peak_memory_bytes=params + subgraph.io_bytes(), precision=precision,
               fixed_overhead_s=est.fixed_overhead_s, source=est.source, note=est.note)


def _compile(device: Device, plugin: str) -> calibration.Compile:
    """The plugin's ``dspark_compile`` hook, for timing."""
    return lambda sg: compile_subgraph(sg, device, plugin)
