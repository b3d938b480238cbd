"""Running a plan that survives its plugins: re-plan without a bid whose compile or run failed.

When a partition fails to compile, or its executable raises (or returns
something wrong) when run, the failure is charged to the plugin (see
:mod:`dspark.host.faults`), that target's bids for the partition's ops are
dropped from the bid table (:func:`plan_around`, which the adaptive runner
uses too), and the placer plans again on what is left; the
new plan is compiled and the run goes on. Each fallback drops at least one
bid, so this ends: with a plan that runs, or with a :class:`PlacementError`
naming the op no target is left for and every failure on the way.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from dspark.graph.model import Graph
from dspark.host.inventory import Inventory
from dspark.host.log import get_logger
from dspark.host.plugin_manager import PluginHost
from dspark.placement import placer
from dspark.placement.executor import (
    CompiledPlan,
    PartitionFailed,
    Span,
    abbreviate,
    compile_plan,
)
from dspark.placement.plan import Plan

log = get_logger("dspark.placement.fallback")


@dataclass
class Fallback:
    """One partition that failed, and was planned around."""

    stage: Literal["compile", "run"]
    partition: int
    target: str
    ops: list[str]
    reason: str

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cause(exc: PartitionFailed) -> str:
    cause = exc.__cause__
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(exc)


def plan_around(host: PluginHost, graph: Graph, table: placer.BidTable, exc: PartitionFailed,
                stage: Literal["compile", "run"]) -> str:
    """The one routine that takes a failed partition out of the bids, used by every runner that re-plans.

    A run failure is charged to the partition's plugin (a compile failure was charged by the host
    call itself); that target's bids for the partition's ops leave ``table``, and with them every
    bid of a plugin that has failed as a whole or lost the device (its refusal). The caller then
    plans again on what is left. Returns the failure's cause, for the caller's record."""
    part = exc.partition
    reason = _cause(exc)
    if stage == "run":
        host.charge(part.target.plugin, "run", f"run raised {reason}",
                    subgraph=graph.subgraph(part.ops), device=part.target.device_id)
    for op in part.ops:
        table.op_bids.get(op, {}).pop(part.target.key, None)
    active = set(host.active())
    gone = {placer.target_key(t) for t in table.targets
            if t.plugin not in active or host.faults.refusal(t.plugin, None, t.id)}
    for bids in table.op_bids.values():
        for key in gone:
            bids.pop(key, None)
    return reason


class ResilientPlan:
    """A compiled plan that re-plans without a failed partition's bid and goes on.

    ``plan`` is the plan to start from (a fresh one is made when None);
    ``table`` the bids it was made from (collected on the first failure when
    None). ``fallbacks`` lists every failure planned around, oldest first;
    ``plan`` and ``compiled`` are always the current ones.
    """

    def __init__(self, graph: Graph, host: PluginHost, inv: Inventory, plan: Plan | None = None, *,
                 table: placer.BidTable | None = None, lock_by: Literal["device", "target"] = "device") -> None:
        self.graph, self.host, self.inv, self.table, self.lock_by = graph, host, inv, table, lock_by
        self.fallbacks: list[Fallback] = []
        self.compile_s = 0.0
        self._swap = threading.Lock()
        self.plan = plan if plan is not None else placer.plan(graph, host, inv, table=self._table())
        self.compiled = self._compile()

    def _table(self) -> placer.BidTable:
        if self.table is None:
            self.table = placer.collect_op_bids(self.host, self.inv, self.graph)
        return self.table

    def _compile(self) -> CompiledPlan:
        while True:
            t0 = time.perf_counter()
            try:
                compiled = compile_plan(self.graph, self.plan, self.host, self.inv, lock_by=self.lock_by)
            except PartitionFailed as exc:
                self.compile_s += time.perf_counter() - t0
                self._replan(exc, "compile")
                continue
            self.compile_s += compiled.compile_s
            return compiled

    def _replan(self, exc: PartitionFailed, stage: Literal["compile", "run"]) -> None:
        part = exc.partition
        table = self._table()
        reason = plan_around(self.host, self.graph, table, exc, stage)
        self.fallbacks.append(Fallback(stage=stage, partition=part.id, target=part.target.key,
                                       ops=list(part.ops), reason=reason))
        log.warning("placement.fallback", stage=stage, partition=part.id, target=part.target.key,
                    ops=abbreviate(part.ops), reason=reason)
        try:
            self.plan = placer.plan(self.graph, self.host, self.inv, table=table)
        except placer.PlacementError as err:
            failed = "; ".join(f"{f.stage} of partition {f.partition} on {f.target}: {f.reason}"
                               for f in self.fallbacks)
            raise placer.PlacementError(f"{err} (after planning around failures: {failed})") from exc

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph once; a failing partition is planned around and the run retried."""
        return self.run_timed(inputs)[0]

    def run_timed(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[int, Span]]:
        while True:
            compiled = self.compiled
            try:
                return compiled.run_timed(inputs)
            except PartitionFailed as exc:
                with self._swap:
                    if self.compiled is compiled:  # else another caller has planned around it already
                        self._replan(exc, "run")
                        self.compiled = self._compile()
                        compiled.close()

    def close(self) -> None:
        self.compiled.close()


def compile_with_fallback(graph: Graph, host: PluginHost, inv: Inventory, plan: Plan | None = None, *,
                          table: placer.BidTable | None = None,
                          lock_by: Literal["device", "target"] = "device") -> ResilientPlan:
    """Plan (unless ``plan`` is given) and compile ``graph``, planning around partitions that fail."""
    return ResilientPlan(graph, host, inv, plan, table=table, lock_by=lock_by)
