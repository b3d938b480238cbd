"""dspark_bid: the subgraph timed on the GPU through dspark_compile (cached, :mod:`dspark.sdk.calibration`),
else a roofline over the measured figures plus per-op kernel launch cost. The plugin's own
quantized variants are bid on in :mod:`dspark_plugins_cuda.quantize`."""

from __future__ import annotations

from dspark.sdk import calibration
from dspark.graph.model import Subgraph
from dspark.types import Bid, Device

# An eager torch op on CUDA costs one or more kernel launches plus Python
# dispatch; ~7 us is typical before calibration replaces it.
LAUNCH_OVERHEAD_S = 7e-6


def unsupported_ops(subgraph: Subgraph) -> list[str]:
    from dspark.builtin.op_names import TORCH_KERNEL_OPS as KERNELS

    return [op.op_type for op in subgraph.ops if op.domain not in ("", "ai.onnx") or op.op_type not in KERNELS]


def peak_memory_bytes(subgraph: Subgraph) -> int:
    """Weights + inputs + every tensor the ops produce: an upper bound, since
    eager execution keeps intermediates alive until the run ends."""
    tensors = subgraph.graph.tensors
    produced = [t for op in subgraph.ops for t in op.outputs if t]
    act = sum((tensors[t].nbytes() or 0) for t in subgraph.inputs + produced if t in tensors)
    return subgraph.param_bytes + act


def bid(subgraph: Subgraph, device: Device) -> Bid | None:
    if subgraph.quantized_by == "cuda":
        from dspark_plugins_cuda.quantize import bid_variant

        return bid_variant(subgraph, device)  # its own Triton-quantized variant
    if subgraph.quantized_by is not None:
        return None  # another plugin's quantized payload; this plugin has no such kernels
    if unsupported_ops(subgraph):
        return None  # no CUDA kernel; the torch reference falls back to the host for those
    memory = peak_memory_bytes(subgraph)
    if device.memory_free_bytes is not None and memory > device.memory_free_bytes:
        return None  # would not fit in what is free on the GPU right now
    est = calibration.estimate(subgraph, device, runtime_key=f"{device.runtime} {_torch_version()}",
                               compile=_compile(device), op_overhead_s=LAUNCH_OVERHEAD_S)
    return Bid(device_id=device.id, runtime=device.runtime, latency_s=est.latency_s,
               peak_memory_bytes=memory, precision="float32", fixed_overhead_s=est.fixed_overhead_s,
               source=est.source, note=est.note)


def _torch_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _compile(device: Device) -> calibration.Compile:
    """The plugin's ``dspark_compile`` hook, for timing."""
    import dspark_plugins_cuda

    return lambda sg: dspark_plugins_cuda.dspark_compile(sg, device)
