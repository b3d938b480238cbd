"""``dspark_bid``: a roofline over the measured device figures, for subgraphs OpenVINO can run."""

from __future__ import annotations

from dspark.cost import DEFAULT_OP_OVERHEAD_S, roofline
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
    latency = roofline(
        subgraph, device, compute,
        op_overhead_s=float(device.properties.get("op_overhead_s", DEFAULT_OP_OVERHEAD_S)),
        call_overhead_s=float(device.properties.get("call_overhead_s", 0.0)),
    )
    return Bid(device_id=device.id, runtime=device.runtime, latency_s=latency,
               precision=_precision(subgraph, compute),
               peak_memory_bytes=subgraph.param_bytes + subgraph.io_bytes(), source="roofline")


def _precision(subgraph: Subgraph, compute: DType) -> DType:
    """The precision results carry: a model whose tensors are f16/bf16 rounds to them
    whatever the device computes in, so its bid must claim that tolerance."""
    tensors = subgraph.graph.tensors
    dtypes = {tensors[t].dtype for op in subgraph.ops for t in op.inputs + op.outputs if t in tensors}
    lower: tuple[DType, ...] = ("bfloat16", "float16")
    return next((low for low in lower if low in dtypes), compute)
