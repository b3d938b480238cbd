"""dspark_bid: prices what :mod:`.support` says the plugin can run.

A float subgraph is timed on the GPU through :func:`.executable.compile_subgraph` (cached,
:mod:`dspark.sdk.calibration`), else priced by a roofline over the measured figures plus
per-op kernel launch cost. The plugin's own quantized variants are timed the same way,
else priced by :func:`roofline_s` over their packed weight bytes.
"""

from __future__ import annotations

from dspark.graph import Subgraph
from dspark.sdk import calibration
from dspark.types import Bid, Device, QuantSpec

from dspark_plugins_cuda import support
from dspark_plugins_cuda.executable import compile_subgraph

# An eager torch op on CUDA costs one or more kernel launches plus Python
# dispatch; this is the prior until calibration replaces it.
LAUNCH_OVERHEAD_S = 7e-6


def bid(subgraph: Subgraph, device: Device) -> Bid | None:
    if support.why_not(subgraph) is not None:
        return None  # another plugin's payload, or ops with no kernel (the host falls back for those)
    memory = support.peak_memory_bytes(subgraph)
    if device.memory_free_bytes is not None and memory > device.memory_free_bytes:
        return None  # would not fit in what is free on the GPU right now
    if subgraph.quantized_by == support.PLUGIN:
        return bid_variant(subgraph, device, memory)
    est = calibration.estimate(subgraph, device, runtime_key=f"{device.runtime} {torch_version()}",
                               compile=_compile(device), op_overhead_s=LAUNCH_OVERHEAD_S)
    return Bid(device_id=device.id, runtime=device.runtime, latency_s=est.latency_s,
               peak_memory_bytes=memory, precision="float32", fixed_overhead_s=est.fixed_overhead_s,
               source=est.source, note=est.note)


def roofline_s(subgraph: Subgraph, device: Device) -> float:
    """A variant's max(compute, traffic) over the packed weight bytes, plus one launch per kernel.

    In decode the packed weights are nearly all the traffic, which is what quantization buys.
    """
    spec: QuantSpec = subgraph.quant_spec
    a8 = spec.activations == "dynamic_int8"
    weight_bytes = sum(p.nbytes for p in subgraph.payload.values())
    io = subgraph.io_bytes()
    # W8A8 reads x again to quantize it and writes/reads the int8 copy: about 2 more passes.
    traffic = io + weight_bytes + (2 * io if a8 else 0)
    bw = device.memory_bandwidth_bytes_per_s
    # int8 tensor cores run at least at the fp16 rate; fp32 activations go through TF32.
    peak = device.peak_flops.get("float16" if a8 else "tf32") or device.peak_flops.get("float32")
    compute = subgraph.flops / peak if peak else 0.0
    launches = len(subgraph.ops) * (2 if a8 else 1)
    return max(compute, traffic / bw if bw else 0.0) + launches * LAUNCH_OVERHEAD_S


def bid_variant(subgraph: Subgraph, device: Device, memory: int) -> Bid:
    """The bid on one of this plugin's own variants: timed when it can be (cached), else :func:`roofline_s`."""
    spec: QuantSpec = subgraph.quant_spec
    runtime_key = f"{device.runtime} {torch_version()} triton {device.properties.get('triton')}"
    est = calibration.estimate(subgraph, device, runtime_key=runtime_key, compile=_compile(device),
                               op_overhead_s=LAUNCH_OVERHEAD_S)
    latency, note = est.latency_s, est.note
    if est.source == "roofline":
        latency = roofline_s(subgraph, device) + est.fixed_overhead_s
        note = f"roofline over int{spec.weight_bits} weight bytes"
    return Bid(device_id=device.id, runtime=device.runtime, latency_s=latency, peak_memory_bytes=memory,
               precision=spec.precision, fixed_overhead_s=est.fixed_overhead_s, source=est.source,
               note=note)


def torch_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _compile(device: Device) -> calibration.Compile:
    """The plugin's ``dspark_compile``, for timing."""
    return lambda sg: compile_subgraph(sg, device)
