"""Every node's devices and plugins, probed on the node itself (``dspark devices --cluster``).

One zero-CPU Ray task per live node, pinned there, runs the same probe as
``dspark devices`` with that node's installed plugins and environment (e.g. a
node started with ``DSPARK_PLUGINS=no:npu``), so what it lists is what a
replica placed on that node will bid with.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def _probe_here() -> dict[str, Any]:
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost
    from dspark.host.settings import PluginSettings

    host = PluginHost(PluginSettings.from_env()).load()
    return probe(host).to_json_dict()


def cluster_devices(address: str | None = None, timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """One entry per node: id, address, Ray resources, and its probe (devices, plugins) or the error it hit."""
    started = not ray.is_initialized()
    if started:
        ray.init(address=address or "auto", log_to_driver=False)
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        task = ray.remote(num_cpus=0, max_retries=0)(_probe_here)
        refs = [task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
                for n in nodes]
        out = []
        for n, ref in zip(nodes, refs, strict=True):
            entry: dict[str, Any] = {"node_id": n["NodeID"], "address": n["NodeManagerAddress"],
                                     "resources": n.get("Resources", {})}
            try:
                entry.update(ray.get(ref, timeout=timeout_s))
            except Exception as e:  # noqa: BLE001 (one node's failure is reported on that node, not fatal)
                entry.update(devices=[], plugins=[], error=f"{type(e).__name__}: {e}")
            out.append(entry)
        return out
    finally:
        if started:
            ray.shutdown()
