"""``dspark_bid``: a roofline over the measured device figures, for subgraphs OpenVINO can run."""

from __future__ import annotations

from dspark.cost import DEFAULT_OP_OVERHEAD_S, roofline
from dspark.graph import Subgraph
from dspark.types import Bid, Device
from dspark_plugins_cpu import runtime, support


def bid(subgraph: Subgraph, device: Device) -> Bid | None:
    if subgraph.quantized_by is not None:
        return None  # another plugin's packed weights; this plugin has no quantize hook
    if not device.peak_flops:
        return None  # no measured figures: a bid would be a guess
    ov_name = runtime.ov_device(device)
    if support.unsupported_reason(subgraph, ov_name) is not None:
        return None
    precision = runtime.precision(ov_name)
    latency = roofline(
        subgraph, device, precision,
        op_overhead_s=float(device.properties.get("op_overhead_s", DEFAULT_OP_OVERHEAD_S)),
        call_overhead_s=float(device.properties.get("call_overhead_s", 0.0)),
    )
    return Bid(device_id=device.id, runtime=device.runtime, latency_s=latency, precision=precision,  # type: ignore[arg-type]
               peak_memory_bytes=subgraph.param_bytes + subgraph.io_bytes(), source="roofline")
