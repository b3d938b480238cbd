"""Adaptive execution: measured latency corrects the cost model, and the plan follows.

Every run records each partition's measured latency. Per (plugin, device, op
type) an exponentially weighted average of measured / predicted is kept and
written into the bid table's ``correction`` factors; a partition's ratio is
given to each op type it holds, since one measurement cannot tell its ops
apart. The average is fed the median of the last few ratios, so one run
slowed by a neighbour process does not swing the model. Every few runs the placer runs again on the corrected table; when the
new plan is predicted faster than the current one (both under the corrected
model) by more than ``threshold``, or when a device's free memory drops
below what the current plan keeps there, the new plan is compiled, warmed up
and swapped in between runs: a run in flight finishes on the plan it started
with, and callers never wait for a re-plan done by another thread.

A partition whose compile or run fails is charged to its plugin (see
:mod:`dspark.host.faults`), its target's bids for those ops leave the bid
table, and the runner re-plans and goes on: a long-running process does not
lose a runtime, or stop, because one subgraph would not compile or run.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
from dspark.placement import placer
from dspark.placement.executor import CompiledPlan, PartitionFailed, Span, compile_plan, random_inputs
from dspark.graph.model import Graph
from dspark.host.inventory import Inventory
from dspark.host.log import get_logger
from dspark.placement.plan import Plan
from dspark.host.plugin_manager import PluginHost

log = get_logger("dspark.placement.adaptive")

FreeMemory = Callable[[], Mapping[str, int | None]]  # device id -> free bytes (None: unknown)
Key = tuple[str, str, str]  # (plugin, device id, op type)
RATIO_WINDOW = 5  # recent measured/predicted ratios whose median feeds the average


@dataclass
class RunRecord:
    """One run: which plan served it, and per partition (predicted ms at the time, measured ms)."""

    index: int
    plan_version: int
    total_ms: float  # first partition start to last partition end
    partitions: dict[int, tuple[float, float]]


@dataclass
class _Active:
    version: int
    plan: Plan
    compiled: CompiledPlan
    raw_ms: dict[int, float]  # partition id -> prediction without any correction
    runs: int = 0


class _StageFailed(Exception):
    """A partition failed while installing a plan: at compile or at the warm-up run."""

    def __init__(self, exc: PartitionFailed, stage: Literal["compile", "run"]) -> None:
        super().__init__(str(exc))
        self.exc, self.stage = exc, stage


@dataclass
class _Sample:
    target: str
    raw_ms: float
    corrected_ms: float  # with the corrections known before this run
    measured_ms: float
    was_corrected: bool


def plan_memory_needs(graph: Graph, plan: Plan) -> dict[str, int]:
    """Bytes of weights each device holds under ``plan`` (the placer's memory model)."""
    need: dict[str, int] = {}
    for part in plan.partitions:
        need[part.device] = need.get(part.device, 0) + sum(graph.op(o).param_bytes for o in part.ops)
    return need


def over_budget(graph: Graph, plan: Plan, inv: Inventory) -> list[str]:
    """Why ``plan`` does not fit the inventory's free memory (empty when it fits)."""
    problems = []
    for dev, need in plan_memory_needs(graph, plan).items():
        free = inv.device(dev).memory_free_bytes
        if free is not None and need > free * placer.MEMORY_HEADROOM:
            problems.append(f"{dev} needs {need} B of weights > budget {int(free * placer.MEMORY_HEADROOM)} B "
                            f"({placer.MEMORY_HEADROOM:.0%} of {free} B free)")
    return problems


def host_free_memory(inv: Inventory) -> FreeMemory:
    """Cheap default: current available host memory for host-resident devices, others as probed."""
    import psutil

    def free() -> dict[str, int | None]:
        avail = int(psutil.virtual_memory().available)
        return {d.id: avail if d.kind == "cpu" else d.memory_free_bytes for d in inv.devices}

    return free


def _median_rel_error(pairs: list[tuple[float, float]]) -> float | None:
    errs = [abs(p - m) / m for p, m in pairs if m > 0]
    return float(statistics.median(errs)) if errs else None


class AdaptiveRunner:
    """Plan, compile and run ``graph``; correct the cost model from measurements and re-plan."""

    def __init__(self, graph: Graph, host: PluginHost, inv: Inventory, *, threshold: float = 0.1,
                 min_runs: int = 3, replan_every: int | None = None, alpha: float = 0.3,
                 free_memory: FreeMemory | None = None, table: placer.BidTable | None = None,
                 lock_by: Literal["device", "target"] = "device", warmup: bool = True) -> None:
        self.graph, self.host = graph, host
        self.inv = inv.model_copy(deep=True)  # free memory is updated in place on this copy
        self.threshold, self.min_runs, self.alpha = threshold, min_runs, alpha
        self.replan_every = replan_every or min_runs
        self.free_memory = free_memory or host_free_memory(self.inv)
        self.lock_by, self.warmup = lock_by, warmup
        self.table = table or placer.collect_op_bids(host, self.inv, graph)
        self.replans: list[str] = []
        self.history: deque[RunRecord] = deque(maxlen=10_000)
        self._samples: deque[_Sample] = deque(maxlen=10_000)
        self._ratio: dict[Key, float] = {}
        self._recent: dict[Key, deque[float]] = {}
        self._swap = threading.Lock()  # guards self._active
        self._stats = threading.Lock()  # guards ratios, samples, history, counters
        self._adapting = threading.Lock()  # one re-plan at a time; others keep running
        self._recovering = threading.Lock()  # one recovery from a failed partition at a time
        self._runs = 0
        self._next_check = self.replan_every
        self._backoff = 1
        self._refresh_memory()
        self._active = self._install_fresh(version=0)

    # -- public --------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        return self._active.plan

    @property
    def compiled(self) -> CompiledPlan:
        return self._active.compiled

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once on the current plan, learn from the timings, maybe swap the plan for later runs."""
        while True:
            with self._swap:
                active = self._active
            try:
                outputs, spans = active.compiled.run_timed(inputs)
                break
            except PartitionFailed as exc:
                self._recover(active, exc)
        reason = self._observe(active, spans)
        if reason is not None:
            self.adapt(reason)
        return outputs

    def prediction_error(self, target: str | None = None) -> dict[str, float | int | None]:
        """Median absolute relative error of partition predictions vs measurements.

        ``uncorrected``: the bids as plugins made them; ``corrected``: the
        prediction with the corrections learned from earlier runs only (out
        of sample), over the runs where a correction existed, compared with
        ``uncorrected_same_runs``. ``target`` (``plugin@device``) narrows it.
        """
        with self._stats:
            samples = [s for s in self._samples if target is None or s.target == target]
        corrected = [s for s in samples if s.was_corrected]
        return {
            "samples": len(samples),
            "uncorrected": _median_rel_error([(s.raw_ms, s.measured_ms) for s in samples]),
            "corrected": _median_rel_error([(s.corrected_ms, s.measured_ms) for s in corrected]),
            "uncorrected_same_runs": _median_rel_error([(s.raw_ms, s.measured_ms) for s in corrected]),
        }

    def corrections(self) -> dict[Key, float]:
        with self._stats:
            return dict(self._ratio)

    def adapt(self, reason: str = "check") -> bool:
        """Re-plan on the corrected model now; swap when it pays (see module docs). True if swapped."""
        if not self._adapting.acquire(blocking=False):
            return False  # another thread is re-planning; this one keeps serving
        try:
            return self._adapt(reason)
        finally:
            self._adapting.release()

    # -- internals -----------------------------------------------------------

    def _factor(self, plugin: str, device: str, op_types: list[str], ratios: Mapping[Key, float]) -> float:
        return float(statistics.fmean(ratios.get((plugin, device, t), 1.0) for t in op_types))

    def _op_types(self, ops: list[str]) -> list[str]:
        return [self.graph.op(o).op_type for o in ops]

    def _plan(self) -> tuple[Plan, dict[Key, float]]:
        """A plan on the corrected model, and the corrections it was made with."""
        with self._stats:
            ratios = dict(self._ratio)
        table = placer.BidTable(targets=self.table.targets, op_bids=self.table.op_bids, correction=ratios)
        new = placer.plan(self.graph, self.host, self.inv, table=table)
        if over_budget(self.graph, new, self.inv) and len({p.target.key for p in new.partitions}) == 1:
            # The placer's single-target gate does not check memory budgets: plan
            # again without that target rather than run a plan that cannot fit.
            key = new.partitions[0].target.key
            rest = [t for t in table.targets if placer.target_key(t) != key]
            if rest:
                table = placer.BidTable(targets=rest, op_bids={
                    op: {k: b for k, b in bids.items() if k != key} for op, bids in table.op_bids.items()},
                    correction=table.correction)
                new = placer.plan(self.graph, self.host, self.inv, table=table)
        return new, ratios

    def _drop(self, exc: PartitionFailed, stage: Literal["compile", "run"]) -> None:
        """Charge a failed partition to its plugin and take its target's bids for those ops out."""
        part = exc.partition
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        if stage == "run":  # a compile failure was charged by the host call itself
            self.host.charge(part.target.plugin, "run", f"run raised {type(cause).__name__}: {cause}",
                             subgraph=self.graph.subgraph(part.ops), device=part.target.device_id)
        for op in part.ops:
            self.table.op_bids.get(op, {}).pop(part.target.key, None)
        self.replans.append(f"{stage} of partition {part.id} on {part.target.key} failed ({cause}); "
                            "re-planning without that bid")
        log.warning("adaptive.partition_failed", stage=stage, partition=part.id, target=part.target.key,
                    reason=str(cause))

    def _install_fresh(self, version: int) -> _Active:
        """Plan and install, planning around partitions that fail (each failure drops at least one bid)."""
        while True:
            try:
                return self._install(*self._plan(), version=version)
            except _StageFailed as failed:
                self._drop(failed.exc, failed.stage)

    def _recover(self, failed: _Active, exc: PartitionFailed) -> None:
        with self._recovering:
            if self._active is not failed:
                return  # another caller recovered already; run again on its plan
            self._drop(exc, "run")
            installed = self._install_fresh(version=failed.version + 1)
            with self._swap:
                self._active = installed

    def _install(self, plan: Plan, ratios: dict[Key, float], version: int) -> _Active:
        try:
            compiled = compile_plan(self.graph, plan, self.host, self.inv, lock_by=self.lock_by)
        except PartitionFailed as exc:
            raise _StageFailed(exc, "compile") from exc
        if self.warmup:  # first calls pay one-off costs (allocation, kernel selection)
            try:
                compiled.run_timed(random_inputs(self.graph))
            except PartitionFailed as exc:
                compiled.close()
                raise _StageFailed(exc, "run") from exc
        # predicted_ms already carries the corrections the plan was made with; keep the raw bid.
        raw = {p.id: p.predicted_ms / self._factor(p.plugin, p.device, self._op_types(p.ops), ratios)
               for p in plan.partitions}
        return _Active(version=version, plan=plan, compiled=compiled, raw_ms=raw)

    def _observe(self, active: _Active, spans: dict[int, Span]) -> str | None:
        """Update the corrections from one run; return why to re-plan, if it is time to."""
        with self._stats:
            self._runs += 1
            active.runs += 1
            parts: dict[int, tuple[float, float]] = {}
            for part in active.plan.partitions:
                span = spans.get(part.id)
                raw = active.raw_ms[part.id]
                if span is None or raw <= 0:
                    continue
                types = self._op_types(part.ops)
                keys = [(part.plugin, part.device, t) for t in dict.fromkeys(types)]
                known = any(k in self._ratio for k in keys)
                predicted = raw * self._factor(part.plugin, part.device, types, self._ratio)
                self._samples.append(_Sample(part.target.key, raw, predicted, span.ms, known))
                parts[part.id] = (predicted, span.ms)
                for k in keys:
                    recent = self._recent.setdefault(k, deque(maxlen=RATIO_WINDOW))
                    recent.append(span.ms / raw)
                    ratio = statistics.median(recent)
                    old = self._ratio.get(k)
                    self._ratio[k] = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio
            self.table.correction.update(self._ratio)
            total = (max(s.end for s in spans.values()) - min(s.start for s in spans.values())) * 1e3 if spans else 0.0
            self.history.append(RunRecord(self._runs, active.version, total, parts))
            if active is not self._active:
                return None  # a run that finished on a replaced plan triggers nothing
            memory = self._memory_problems(active)
            if memory:
                return "memory: " + "; ".join(memory)
            if active.runs >= self.min_runs and active.runs >= self._next_check:
                self._next_check = active.runs + self.replan_every * self._backoff
                return "check"
        return None

    def _refresh_memory(self) -> None:
        for dev_id, free in self.free_memory().items():
            try:
                entry = self.inv.device(dev_id)
            except KeyError:
                continue
            entry.memory_free_bytes = free
            for d in entry.drivers:
                d.memory_free_bytes = free

    def _memory_problems(self, active: _Active) -> list[str]:
        self._refresh_memory()
        return over_budget(self.graph, active.plan, self.inv)

    def _corrected_total(self, active: _Active) -> float:
        with self._stats:
            ratios = dict(self._ratio)
        parts = sum(active.raw_ms[p.id] * self._factor(p.plugin, p.device, self._op_types(p.ops), ratios)
                    for p in active.plan.partitions)
        return parts + active.plan.transfer_ms

    def _adapt(self, reason: str) -> bool:
        active = self._active
        self._refresh_memory()
        t0 = time.perf_counter()
        try:
            new, ratios = self._plan()
        except placer.PlacementError as exc:
            self.replans.append(f"{reason}; no feasible plan, keeping the current one: {exc}")
            log.warning("adaptive.no_plan", reason=reason, error=str(exc))
            return False
        plan_s = time.perf_counter() - t0
        current = self._corrected_total(active)
        memory = reason.startswith("memory")
        same = new.assignment() == active.plan.assignment()
        faster = new.predicted_total_ms < current * (1 - self.threshold)
        if same or not (memory or faster):
            self._backoff = min(self._backoff * 2, 64)  # steady state: check less and less often
            return False
        if over_budget(self.graph, new, self.inv):
            self.replans.append(f"{reason}; the new plan does not fit either, keeping the current one")
            return False
        why = reason if memory else (f"faster: corrected prediction {new.predicted_total_ms:.3f} ms vs current "
                                     f"plan {current:.3f} ms ({1 - new.predicted_total_ms / current:.0%} less)")
        try:
            installed = self._install(new, ratios, version=active.version + 1)
        except _StageFailed as failed:
            self._drop(failed.exc, failed.stage)  # the next check plans without that bid
            return False
        with self._swap:
            self._active = installed
        with self._stats:
            self._backoff = 1
            self._next_check = self.replan_every
        moved = sorted({p.target.key for p in new.partitions})
        self.replans.append(f"{why} -> {', '.join(moved)}")
        log.info("adaptive.swap", reason=why, targets=moved, plan_s=round(plan_s, 3),
                 compile_s=round(installed.compiled.compile_s, 3))
        return True

