"""The adaptive runner: see the package docstring (:mod:`dspark.placement.adaptive`)."""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from typing import Literal

import numpy as np
from dspark.placement import placer
from dspark.placement.adaptive import trial
from dspark.placement.placer import FreeMemory, PartCost, host_free_memory, over_budget
from dspark.placement.shapes import BucketKey, ShapeRouter
from dspark.placement.executor import CompiledPlan, PartitionFailed, Span, compile_plan, random_inputs
from dspark.placement.fallback import plan_around
from dspark.graph.model import Graph
from dspark.host.inventory import Inventory
from dspark.host.log import get_logger
from dspark.placement.plan import Plan
from dspark.placement.adaptive.plan_store import PlanStore
from dspark.placement.adaptive.records import (LEARN_ALL, LEARN_EVERY, RECHECK_DRIFT, Active, Key, RunRecord,
                                              StageFailed)
from dspark.host.plugin_manager import PluginHost
from dspark.sdk.calibration.observations import planning_beside

log = get_logger("dspark.placement.adaptive")

class AdaptiveRunner:
    """Plan, compile and run ``graph``; correct the cost model from measurements and re-plan."""

    def __init__(self, graph: Graph, host: PluginHost, inv: Inventory, *, threshold: float = 0.1,
                 min_runs: int = 3, replan_every: int | None = None, alpha: float = 0.3,
                 free_memory: FreeMemory | None = None, table: placer.BidTable | None = None,
                 lock_by: Literal["device", "target"] = "device", warmup: bool = True,
                 memory_every_s: float = 0.5, measure_close: bool = True, max_shapes: int = 4,
                 plans: PlanStore | None = None, first_error: float = trial.DEFAULT_ERROR) -> None:
        """``plans`` keeps plans across processes (:mod:`dspark.placement.adaptive.plan_store`): a plan found there
        for this graph (at its sizes) and these targets is compiled and run as is, with the corrections
        measured beside it, and the bids are collected only when a re-plan needs them (a warm start);
        every plan committed (placed, raced, re-planned, recovered) is handed back to it. ``first_error``: the
        cost model's relative error before runs corrected it, which decides the plans raced on the first run
        (a shape bucket's runner is given :data:`~dspark.placement.adaptive.trial.BUCKET_ERROR`)."""
        self.graph, self.host = graph, host
        self.inv = inv.model_copy(deep=True)  # free memory is updated in place on this copy
        self.threshold, self.min_runs, self.alpha = threshold, min_runs, alpha
        self.replan_every = replan_every or min_runs
        self.free_memory = free_memory or host_free_memory(self.inv)
        self.lock_by, self.warmup, self.memory_every_s, self.measure_close = lock_by, warmup, memory_every_s, measure_close
        self.first_error = first_error
        self._table = table  # collected when first needed: a warm start may never need it
        self.plans = plans
        kept = plans.load(graph, self.inv) if plans is not None else None
        self.replans: list[str] = []
        self.history: deque[RunRecord] = deque(maxlen=10_000)  # the runs learned from
        self._samples: deque[placer.Sample] = deque(maxlen=10_000)
        self._ratio: dict[Key, float] = dict(kept.corrections) if kept is not None else {}
        self._swap, self._stats = threading.Lock(), threading.Lock()  # guard _active; ratios, records, counters
        self._adapting = threading.Lock()  # one re-plan at a time; others keep running
        self._recovering = threading.Lock()  # one recovery from a failed partition at a time
        self._racing = threading.Lock()  # one race between close plans at a time
        self._background: threading.Thread | None = None
        self._runs, self._next_check, self._next_memory, self._backoff = 0, self.replan_every, 0.0, 1
        self._rivals: list[Plan | Active] = []  # close plans to race on the next caller's inputs
        self._raced: set[frozenset[str]] = set()  # pairs of assignments already raced
        self._checked: dict[Key, float] = {}  # the corrections the last re-plan check saw
        self._scored: list[tuple[str, Plan, list[PartCost]]] = []  # the placer's ranked plans, re-scorable
        self._refresh_memory()
        self.plan_source: Literal["kept", "planned"] = "planned"  # "kept": started on a plan from ``plans``
        self._active = self._install_kept(kept.plan) if kept is not None else self._install_fresh(version=0)
        self._shapes: ShapeRouter[AdaptiveRunner] = ShapeRouter(graph, self._for_shape, max_entries=max_shapes,
                                                                on_evict=lambda _k, r: r.close())
        self._home = self._shapes.probe
        trial.release_garbage()  # what calibrating and compiling left behind, before the first run

    # -- public --------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        return self._active.plan

    @property
    def compiled(self) -> CompiledPlan:
        return self._active.compiled

    @property
    def table(self) -> placer.BidTable:
        """Every target's bids for every op, collected on first use, corrected by the runs learned from."""
        if self._table is None:
            table = placer.collect_op_bids(self.host, self.inv, self.graph)
            with self._stats:
                table.correction.update(self._ratio)
            self._table = table
        return self._table

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once on the current plan, learn from the timings, maybe swap the plan for later runs.

        When close plans wait to be raced (see the module notes), this run races them first. Inputs
        at sizes of another shape bucket (:mod:`dspark.placement.shapes`) run on that bucket's plan,
        bid and placed at its sizes when first seen; sizes the graph cannot take raise ShapeMismatch."""
        n = (active := self._active).runs
        # A run not learned from, with no race waiting, on sizes seen in the home bucket: the lean path,
        # reading as few objects through as few calls as it takes (docs/benchmarks.md, "Per-run overhead").
        if n >= LEARN_ALL and (n + 1) % LEARN_EVERY and not self._rivals:
            one, seen, home = self._home
            if seen.get((getattr(inputs.get(one), "shape", None),)) is home if one else self._shapes.at_home(inputs):
                active.runs, self._runs = n + 1, self._runs + 1  # under the GIL; a lost count only shifts sampling
                try:
                    return lean(inputs)[0] if (lean := active.compiled.lean_run) else active.compiled.run(inputs)
                except PartitionFailed as exc:
                    self._recover(active, exc)
        if not self._shapes.at_home(inputs) and (other := self._shapes.route(inputs)) is not None:
            return other.run(inputs)
        if self._rivals:
            self._race(inputs)
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
            self._adapt_in_background(reason)
        return outputs

    def close(self) -> None:
        """Release every compiled plan (this one's and its other shape buckets')."""
        self._shapes.plans.clear()
        self.settle()
        self._active.compiled.close()

    def _for_shape(self, key: BucketKey, graph: Graph) -> AdaptiveRunner:
        home = dict(self._shapes.home)
        runner = AdaptiveRunner(graph, self.host, self.inv, threshold=self.threshold,
                                min_runs=self.min_runs, replan_every=self.replan_every, alpha=self.alpha,
                                free_memory=self.free_memory, lock_by=self.lock_by, warmup=self.warmup,
                                memory_every_s=self.memory_every_s, measure_close=self.measure_close,
                                plans=self.plans, first_error=max(self.first_error, trial.BUCKET_ERROR))
        how = "ran the plan kept for them" if runner.plan_source == "kept" else "re-bid and re-planned at them"
        self.replans.append(f"input sizes {dict(key)} are outside the plan's {home}: {how}")
        log.info("adaptive.shape_bucket", bucket=dict(key), home=home, plan_source=runner.plan_source)
        return runner

    def bucket_plans(self) -> dict[str, Plan]:
        """The plan of each input-size bucket that has one now (``"batch=16"``), besides :attr:`plan`."""
        return {",".join(f"{k}={v}" for k, v in key): r.plan for key, r in self._shapes.plans.items()}

    def settle(self, timeout: float | None = 60.0) -> None:
        """Wait for a re-plan running in the background (tests, and callers about to read ``plan``)."""
        if (thread := self._background) is not None:
            thread.join(timeout)

    @property
    def exploring(self) -> bool:
        """A re-plan runs in the background, or rivals wait to race on the next run."""
        return bool(self._rivals) or (self._background is not None and self._background.is_alive())

    def prediction_error(self, target: str | None = None) -> dict[str, float | int | None]:
        """The cost model's error on this runner's runs (:func:`placer.prediction_error`); ``target``
        (``plugin@device``) narrows it."""
        with self._stats:
            samples = [s for s in self._samples if target is None or s.target == target]
        return placer.prediction_error(samples)

    def corrections(self) -> dict[Key, float]:
        with self._stats:
            return dict(self._ratio)

    def adapt(self, reason: str = "check") -> bool:
        """Re-plan on the corrected model now; swap when it pays (see module docs). True if swapped."""
        if not self._adapting.acquire(blocking=False):
            return False  # another thread is re-planning; this one keeps serving
        try:
            with planning_beside():  # the runs beside it are not calibration's evidence
                return self._adapt(reason)
        finally:
            self._adapting.release()

    # -- internals -----------------------------------------------------------

    def _ranked(self) -> tuple[list[Plan], dict[Key, float]]:
        """Plans on the corrected model, predicted best first, and the corrections they were made with."""
        with self._stats:
            ratios = dict(self._ratio)
        table = placer.BidTable(targets=self.table.targets, op_bids=self.table.op_bids, correction=ratios)
        ranked = placer.candidates(self.graph, self.host, self.inv, table=table)  # within the budgets
        return [p for p in ranked if not over_budget(self.graph, p, self.inv)] or ranked[:1], ratios

    def _error(self) -> float:
        """The cost model's current relative error: measured once runs corrected it, else the default."""
        corrected = self.prediction_error()["corrected"]
        return self.first_error if corrected is None else float(corrected)

    def _drop(self, exc: PartitionFailed, stage: Literal["compile", "run"]) -> None:
        """Charge a failed partition to its plugin and take its target's bids for those ops out."""
        part = exc.partition
        cause = plan_around(self.host, self.graph, self.table, exc, stage)
        self.replans.append(f"{stage} of partition {part.id} on {part.target.key} failed ({cause}); "
                            "re-planning without that bid")
        log.warning("adaptive.partition_failed", stage=stage, partition=part.id, target=part.target.key,
                    reason=cause)

    def _install_fresh(self, version: int) -> Active:
        """Plan and install, planning around partitions that fail (each failure drops at least one bid);
        rivals predicted within the model's error are left to race on the first caller's inputs."""
        while True:
            ranked, ratios = self._ranked()
            try:
                active = self._install(ranked[0], ratios, version=version)
            except StageFailed as failed:
                self._drop(failed.exc, failed.stage)
                continue
            self._score(ranked, ratios)
            error = self._error()
            self._rivals = list(trial.close_rivals(ranked, error)) if self.measure_close else []
            if not self._rivals:  # decided by prediction; with rivals, the race decides and commits
                active.plan.decision = trial.predicted(ranked[0], ranked[1] if len(ranked) > 1 else None, error)
                self._committed(active.plan)
            return active

    def _install_kept(self, plan: Plan) -> Active:
        """Install a plan made earlier; if it no longer compiles or runs, charge that and plan afresh."""
        with self._stats:
            ratios = dict(self._ratio)
        try:
            active = self._install(plan, ratios, version=0)
            self.plan_source = "kept"
            return active
        except StageFailed as failed:
            self._drop(failed.exc, failed.stage)
            return self._install_fresh(version=0)

    def _committed(self, plan: Plan) -> None:
        if self.plans is None:
            return
        # A plugin that failed as a whole (a timeout, say) may be back at the next start: a plan made
        # without it is not the healthy plan, and the next start bids afresh rather than reuse it.
        gone = sorted({d.plugin for d in self.inv.drivers()} - set(self.host.active()))
        if gone:
            log.info("adaptive.plan_not_kept", reason=f"made while plugins {gone} had failed")
            return
        with self._stats:
            ratios = dict(self._ratio)
        try:
            self.plans.save(self.graph, self.inv, plan, ratios)
        except Exception as exc:  # a store that fails loses a warm start, never a run
            log.warning("adaptive.plan_not_kept", error=f"{type(exc).__name__}: {exc}")

    def _score(self, ranked: list[Plan], ratios: dict[Key, float]) -> None:
        """Keep the placer's ranked plans re-scorable under later corrections (see _rival_close)."""
        self._scored = [(trial.assignment_key(p), p, placer.part_costs(self.graph, p, ratios)) for p in ranked]

    def _race(self, inputs: dict[str, np.ndarray]) -> None:
        """Race the waiting rivals against the current plan on ``inputs``; commit the fastest."""
        if not self._racing.acquire(blocking=False):
            return  # another caller is racing; this one runs on the current plan
        try:
            rivals, self._rivals = self._rivals, []
            with self._swap:
                current = self._active
            installed: list[Active] = []
            with self._stats:
                ratios = dict(self._ratio)
            for rival in rivals:
                if isinstance(rival, Active):
                    installed.append(rival)
                    continue
                try:
                    installed.append(self._install(rival, ratios, version=current.version + 1))
                except StageFailed as failed:
                    self._drop(failed.exc, failed.stage)
            contenders = [current, *installed]
            for a in installed:
                self._raced.add(frozenset((trial.assignment_key(current.plan), trial.assignment_key(a.plan))))
            if len(contenders) < 2:
                return
            try:
                win, laps = trial.decide([a.plan for a in contenders],
                                         [lambda c=a.compiled: c.run(inputs) for a in contenders], self._error())
            except PartitionFailed as exc:  # charged; the caller's run then recovers if it was the current plan
                self._drop(exc, "run")
                win, laps = 0, []
            for a, lap in zip(contenders, laps, strict=False):  # every rival measured alike: all teach the model
                with self._stats:
                    for part in a.parts:
                        timed = list(a.compiled.history[part.id])[-lap.runs:]
                        if timed and part.raw_ms > 0:
                            self._learn(part, statistics.median(timed) / part.raw_ms)
            for i, a in enumerate(contenders):
                if i != win and a is not current:
                    a.compiled.close()
            trial.release_garbage()
            winner = contenders[win]
            if not winner.plan.decision:
                return
            self.replans.append(winner.plan.decision)
            log.info("adaptive.raced", decision=winner.plan.decision)
            if winner is not current:
                winner.version = current.version + 1
                with self._swap:
                    self._active = winner
                with self._stats:
                    self._backoff, self._next_check = 1, self.replan_every
            self._committed(winner.plan)
        finally:
            self._racing.release()

    def _recover(self, failed: Active, exc: PartitionFailed) -> None:
        with self._recovering:
            if self._active is not failed:
                return  # another caller recovered already; run again on its plan
            self._drop(exc, "run")
            installed = self._install_fresh(version=failed.version + 1)
            with self._swap:
                self._active = installed

    def _install(self, plan: Plan, ratios: dict[Key, float], version: int) -> Active:
        try:
            compiled = compile_plan(self.graph, plan, self.host, self.inv, lock_by=self.lock_by)
        except PartitionFailed as exc:
            raise StageFailed(exc, "compile") from exc
        if self.warmup:  # first calls pay one-off costs (allocation, kernel selection)
            try:
                compiled.run_timed(random_inputs(self.graph))
            except PartitionFailed as exc:
                compiled.close()
                raise StageFailed(exc, "run") from exc
        return Active(version=version, plan=plan, compiled=compiled, parts=placer.part_costs(self.graph, plan, ratios))

    def _observe(self, active: Active, spans: dict[int, Span]) -> str | None:
        """Update the corrections from one run; return why to re-plan, if it is time to."""
        ratios = self._ratio
        # A re-plan compiling beside this run slows it: such spans would teach the model contention.
        busy = self._background is not None and self._background.is_alive()
        with self._stats:
            self._runs += 1
            active.runs += 1
            parts: dict[int, tuple[float, float]] = {}
            for part in active.parts:
                span = spans.get(part.id)
                if span is None or part.raw_ms <= 0:
                    continue
                ms = (span.end - span.start) * 1e3
                known = any(k in ratios for k, _ in part.keys)
                predicted = part.corrected(ratios)
                self._samples.append(placer.Sample(part.target, part.raw_ms, predicted, ms, known))
                parts[part.id] = (predicted, ms)
                if not busy:
                    part.recent.append(ms / part.raw_ms)
                    self._learn(part, statistics.median(part.recent))
            total = (max(s.end for s in spans.values()) - min(s.start for s in spans.values())) * 1e3 if spans else 0.0
            self.history.append(RunRecord(self._runs, active.version, total, parts))
            if active is not self._active:
                return None  # a run that finished on a replaced plan triggers nothing
            memory = self._memory_due(active)
            if memory is not None:
                return memory
            if active.runs >= self.min_runs and active.runs >= self._next_check:
                self._next_check = active.runs + self.replan_every * self._backoff
                if self._drifted() and self._rival_close(active):
                    return "check"
                self._backoff = min(self._backoff * 2, 64)
        return None

    def _memory_due(self, active: Active) -> str | None:
        """Why to re-plan for memory, when a look (costly: at most every memory_every_s) finds it (under _stats)."""
        now = time.monotonic()
        if now < self._next_memory or active is not self._active:
            return None
        self._next_memory = now + self.memory_every_s
        return "memory: " + "; ".join(memory) if (memory := self._memory_problems(active)) else None

    def _learn(self, part: PartCost, ratio: float) -> None:
        """Fold one measured / raw ratio into the corrections of the partition's op types (under _stats)."""
        for k, _ in part.keys:
            old = self._ratio.get(k)
            self._ratio[k] = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio
            if self._table is not None:
                self._table.correction[k] = self._ratio[k]

    def _rival_close(self, active: Active) -> bool:
        """Whether a plan the placer ranked, re-scored under the current corrections, comes within the
        model's error of the current one (under _stats): only then is the placer worth running again.
        Once a race was run, its laps corrected the model: a rival must then be predicted faster."""
        mine = trial.assignment_key(active.plan)
        bar = placer.corrected_total(active.plan, active.parts, self._ratio) * (
            1.0 if self._raced else 1 + trial.DEFAULT_ERROR)
        return any(key != mine and placer.corrected_total(p, costs, self._ratio) < bar
                   for key, p, costs in self._scored)

    def _drifted(self) -> bool:
        """Whether a correction moved by more than RECHECK_DRIFT since the last re-plan looked (under
        _stats): the placer costs far more than a run, so it only runs when its inputs changed."""
        seen = self._checked
        moved = any(k not in seen or abs(v / seen[k] - 1) > RECHECK_DRIFT for k, v in self._ratio.items())
        if moved:
            self._checked = dict(self._ratio)
        return moved

    def _adapt_in_background(self, reason: str) -> None:
        thread = self._background
        if thread is not None and thread.is_alive():
            return  # a re-plan is under way; this check is moot
        # Not a daemon: the interpreter waits for it at exit rather than kill it inside a runtime's compile.
        self._background = threading.Thread(target=self.adapt, args=(reason,),
                                            name=f"dspark-replan-{self.graph.name}")
        self._background.start()

    def _refresh_memory(self) -> None:
        for dev_id, free in self.free_memory().items():
            try:
                entry = self.inv.device(dev_id)
            except KeyError:
                continue
            entry.memory_free_bytes = free
            for d in entry.drivers:
                d.memory_free_bytes = free

    def _memory_problems(self, active: Active) -> list[str]:
        self._refresh_memory()
        return over_budget(self.graph, active.plan, self.inv)

    def _corrected_total(self, active: Active) -> float:
        with self._stats:
            ratios = dict(self._ratio)
        return placer.corrected_total(active.plan, active.parts, ratios)

    def _adapt(self, reason: str) -> bool:
        active = self._active
        self._refresh_memory()
        t0 = time.perf_counter()
        try:
            ranked, ratios = self._ranked()
            new = ranked[0]
            self._score(ranked, ratios)
        except placer.PlacementError as exc:
            self.replans.append(f"{reason}; no feasible plan, keeping the current one: {exc}")
            log.warning("adaptive.no_plan", reason=reason, error=str(exc))
            return False
        plan_s = time.perf_counter() - t0
        current = self._corrected_total(active)
        memory, error = reason.startswith("memory"), self._error()
        same = new.assignment() == active.plan.assignment()
        faster = new.predicted_total_ms < current * (1 - self.threshold)
        # After a race, the model carries its measurements: only a rival predicted faster is worth another
        # race (each costs the caller's time, and one split differing by a partition is not news).
        close = new.predicted_total_ms < current * (1.0 if self._raced else 1 + error)
        pair = frozenset((trial.assignment_key(new), trial.assignment_key(active.plan)))
        if not same and not memory and (close or faster) and self.measure_close:
            if pair in self._raced:  # measured already, and the race taught the model: no flip-flop
                self._backoff = min(self._backoff * 2, 64)
                return False
            # A swap is a measured choice: the two race on the next caller's inputs.
            try:
                rival = self._install(new, ratios, version=active.version + 1)
            except StageFailed as failed:
                self._drop(failed.exc, failed.stage)
                return False
            self._raced.add(pair)
            self._rivals = [rival]
            return False
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
        except StageFailed as failed:
            self._drop(failed.exc, failed.stage)  # the next check plans without that bid
            return False
        new.decision = f"re-planned ({reason}): {why}"
        with self._swap:
            self._active = installed
        with self._stats:
            self._backoff, self._next_check = 1, self.replan_every
        self._committed(new)
        moved = sorted({p.target.key for p in new.partitions})
        self.replans.append(f"{why} -> {', '.join(moved)}")
        log.info("adaptive.swap", reason=why, targets=moved, plan_s=round(plan_s, 3),
                 compile_s=round(installed.compiled.compile_s, 3))
        return True

