"""The measured cost of switching between two runtimes on the same host.

Handing a tensor from one runtime to another on the same CPU costs more than
the copy and the second runtime's warm call overhead: each runtime keeps its
own thread pool, and the pool that just went idle spins or sleeps while the
other one wakes up. That cost is measured here for each pair of runtimes by
running a small but multi-threaded subgraph (a 256x512x512 MatMul + Relu)
alternately on both and subtracting each one's time alone. Cached on disk per
pair and host.
"""

from __future__ import annotations

import numpy as np

from dspark.host import cache, hostinfo
from dspark.graph.model import Graph, Op, TensorSpec
from dspark.host.plugin_manager import PluginHost
from dspark.types import Device

NAMESPACE = "switch-overhead-v1"


def _probe_graph() -> Graph:
    rng = np.random.default_rng(0)
    return Graph(
        name="switch_probe",
        ops=[Op(name="mm", op_type="MatMul", inputs=["x", "w"], outputs=["h"]),
             Op(name="relu", op_type="Relu", inputs=["h"], outputs=["y"])],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=(256, 512)),
                 "w": TensorSpec(name="w", dtype="float32", shape=(512, 512)),
                 "h": TensorSpec(name="h", dtype="float32", shape=(256, 512)),
                 "y": TensorSpec(name="y", dtype="float32", shape=(256, 512))},
        inputs=["x"], outputs=["y"],
        initializers={"w": (rng.standard_normal((512, 512)) / 20).astype(np.float32)},
    )


def _key(a: Device, b: Device) -> dict[str, object]:
    pair = sorted([f"{a.plugin}/{a.runtime}", f"{b.plugin}/{b.runtime}"])
    return {"pair": pair, **hostinfo.fingerprint()}


def switch_overhead(host: PluginHost, a: Device, b: Device, rounds: int = 30) -> float:
    """Extra seconds per hand-over between the runtimes of ``a`` and ``b`` (0 if they are the same)."""
    if a.plugin == b.plugin and a.id == b.id:
        return 0.0
    key = _key(a, b)
    if (hit := cache.load(NAMESPACE, key)) is not None:
        return float(hit)
    from dspark.sdk.cost import time_call

    sub = _probe_graph().subgraph()
    exes = [host.call(d.plugin, "dspark_compile", subgraph=sub, device=d) for d in (a, b)]
    if any(e is None for e in exes):
        return 0.0  # cannot measure; transfers still count the copy and the call overhead
    feed = {"x": np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32)}
    for d, exe in zip((a, b), exes, strict=True):
        try:
            exe.run(feed)
        except Exception as exc:  # the plugin's fault, charged to it; planning goes on without the figure
            host.charge(d.plugin, "run", f"run raised {type(exc).__name__}: {exc}", subgraph=sub, device=d.id)
            return 0.0
    ea, eb = exes
    with hostinfo.cpu_benchmark_lock:
        t_a = time_call(lambda: ea.run(feed), warmup=3, repeat=rounds, budget_s=1.0)
        t_b = time_call(lambda: eb.run(feed), warmup=3, repeat=rounds, budget_s=1.0)
        t_ab = time_call(lambda: (ea.run(feed), eb.run(feed)), warmup=3, repeat=rounds, budget_s=2.0)
    value = max(0.0, (t_ab - t_a - t_b) / 2)  # one alternation is two hand-overs
    cache.store(NAMESPACE, key, value)
    return value


def switch_matrix(host: PluginHost, targets: list[Device], host_resident: list[bool]) -> np.ndarray:
    """(targets, targets) seconds per hand-over between host-resident runtimes; 0 elsewhere."""
    n = len(targets)
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            if host_resident[i] and host_resident[j]:
                out[i, j] = out[j, i] = switch_overhead(host, targets[i], targets[j])
    return out
