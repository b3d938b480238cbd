"""Default cost estimates: a roofline over the probed device figures, and timing helpers."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from dspark.graph.model import Subgraph
from dspark.types import Device

# Per-op dispatch overhead of a runtime when no measurement is known yet.
DEFAULT_OP_OVERHEAD_S = 5e-6


def roofline(subgraph: Subgraph, device: Device, dtype: str = "float32",
             op_overhead_s: float = DEFAULT_OP_OVERHEAD_S, call_overhead_s: float = 0.0) -> float:
    """Predicted seconds for one run: max(compute, memory traffic) plus overheads.

    Compute is the subgraph's FLOPs over the device's peak for ``dtype``
    (falling back to float32's); traffic is boundary activations plus weights
    over the device's memory bandwidth. Unknown figures count as zero.
    """
    peak = device.peak_flops.get(dtype) or device.peak_flops.get("float32")
    compute = subgraph.flops / peak if peak else 0.0
    bw = device.memory_bandwidth_bytes_per_s
    traffic = (subgraph.io_bytes() + subgraph.param_bytes) / bw if bw else 0.0
    return max(compute, traffic) + op_overhead_s * len(subgraph.ops) + call_overhead_s


def time_call(fn: Callable[[], object], *, warmup: int = 1, repeat: int = 5, budget_s: float = 1.0) -> float:
    """Median wall time of ``fn`` in seconds, stopping early once ``budget_s`` is spent."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if time.perf_counter() > deadline:
            break
    return statistics.median(samples)
