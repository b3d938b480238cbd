"""Where the ingress and operators find the replicas: their metrics endpoints, nodes, pids and engine state.

A named Ray actor per app. Each replica reports on every routing-stats period
(Ray Serve calls ``record_routing_stats`` on it), so an entry that stops
arriving belongs to a replica that died or was stopped; ``entries`` leaves
such entries out after ``max_age_s``.
"""

from __future__ import annotations

import time
from typing import Any

import ray

STALE_S = 6.0  # three routing-stats periods


def registry_name(app_name: str) -> str:
    return f"{app_name}-replicas"


@ray.remote(num_cpus=0, max_restarts=-1)
class ReplicaRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Any]] = {}

    def report(self, replica: str, entry: dict[str, Any]) -> None:
        self._entries[replica] = {**entry, "replica": replica, "seen": time.time()}

    def drop(self, replica: str) -> None:
        self._entries.pop(replica, None)

    def entries(self, max_age_s: float = STALE_S) -> list[dict[str, Any]]:
        now = time.time()
        for k in [k for k, e in self._entries.items() if now - e["seen"] > 10 * max_age_s]:
            del self._entries[k]  # long gone: forget it
        return sorted((e for e in self._entries.values() if now - e["seen"] <= max_age_s),
                      key=lambda e: e["replica"])


def get_registry(app_name: str, namespace: str) -> Any:
    """The app's registry actor, created on first use (detached: it outlives whoever created it)."""
    return ReplicaRegistry.options(name=registry_name(app_name), namespace=namespace, lifetime="detached",
                                   get_if_exists=True).remote()
