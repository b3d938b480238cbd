"""Plans kept across processes, so a warm start runs the plan an earlier run chose without planning again.

A plan is kept under the model's fingerprint (structure, shapes, dim hints,
weights: :func:`~dspark.placement.plan.graph_fingerprint`) and the device
inventory's (every (plugin, device, runtime) target, and each plugin's
version), with the cost model's corrections measured beside it. A changed
model, device, plugin or plugin version is a different key: that start plans
afresh. Entries live in the disk cache (:mod:`dspark.host.cache`, namespace
``plans``), so ``dspark cache list`` shows them and ``dspark cache clear -n
plans`` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dspark.graph.model import Graph
from dspark.host import cache
from dspark.host.inventory import Inventory
from dspark.host.log import get_logger
from dspark.placement.plan import Plan, Target, graph_fingerprint, hardware_fingerprint

log = get_logger("dspark.placement.adaptive.plan_store")

NAMESPACE = "plans"
# Part of every kept plan's key: bumped when placement decides differently (2: a split is always raced
# against the fastest single runtime; 3: a shape bucket races plans within 2x of its best), so that plans
# kept by an older placer are made again, not reused.
PLACER_VERSION = 3
Key = tuple[str, str, str]  # (plugin, device id, op type): the adaptive runner's correction keys


@dataclass(frozen=True)
class KeptPlan:
    plan: Plan
    corrections: dict[Key, float]


class PlanStore(Protocol):
    """Where an :class:`~dspark.placement.adaptive.AdaptiveRunner` finds and keeps its plans."""

    def load(self, graph: Graph, inv: Inventory) -> KeptPlan | None: ...

    def save(self, graph: Graph, inv: Inventory, plan: Plan, corrections: dict[Key, float]) -> None: ...


def inventory_fingerprint(inv: Inventory) -> str:
    """The targets a plan can use, as :func:`hardware_fingerprint` names them, with each plugin's version
    (a plugin's new release may bid and compile differently)."""
    versions = {p.name: p.version for p in inv.plugins}
    targets = [Target(plugin=d.plugin, device_id=d.id, runtime=f"{d.runtime}/{versions.get(d.plugin, '')}")
               for d in inv.drivers()]
    return hardware_fingerprint(targets)


class DiskPlanStore:
    """Plans in the disk cache, one entry per (model fingerprint, inventory fingerprint, placer version)."""

    def __init__(self, namespace: str = NAMESPACE) -> None:
        self.namespace = namespace
        self._fingerprints: dict[int, str] = {}  # id(graph) -> fingerprint: hashing weights is not free

    def key(self, graph: Graph, inv: Inventory) -> dict[str, str]:
        fp = self._fingerprints.get(id(graph))
        if fp is None:
            fp = self._fingerprints[id(graph)] = graph_fingerprint(graph)
        return {"model": fp, "devices": inventory_fingerprint(inv), "placer": str(PLACER_VERSION)}

    def load(self, graph: Graph, inv: Inventory) -> KeptPlan | None:
        value = cache.load(self.namespace, self.key(graph, inv))
        if not isinstance(value, dict):
            return None
        try:
            plan = Plan.model_validate(value["plan"])
            corrections = {(str(p), str(d), str(o)): float(r) for p, d, o, r in value.get("corrections", [])}
        except (KeyError, TypeError, ValueError) as exc:  # an entry from another version: plan afresh
            log.warning("plan_store.unreadable", namespace=self.namespace, error=str(exc)[:200])
            return None
        log.info("plan_store.hit", model=plan.model, partitions=len(plan.partitions))
        return KeptPlan(plan=plan, corrections=corrections)

    def save(self, graph: Graph, inv: Inventory, plan: Plan, corrections: dict[Key, float]) -> None:
        cache.store(self.namespace, self.key(graph, inv), {
            "plan": plan.model_dump(mode="json"),
            "corrections": [[p, d, o, r] for (p, d, o), r in sorted(corrections.items())]})
