"""The placer: bids in, an explained plan out.

1. Every target (plugin, device) bids on every op, and on the maximal
   connected runs of ops it supports (its candidate subgraphs); a run's bid
   scales its ops' costs, so a runtime that fuses well is credited for it.
2. Transfers: a tensor crossing targets costs its bytes over the link between
   the devices (host memory bandwidth when both are host-resident) plus the
   destination runtime's per-call overhead, which is the measured boundary
   cost of entering a partition of that runtime.
3. The assignment minimising predicted latency under the memory budgets is
   solved exactly (:mod:`dspark.placement.placer_ilp`), ops are fused into acyclic
   partitions, each partition is re-bid whole by its owner, and a gate keeps
   the best single target whenever the split is not predicted faster.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from dspark.placement.bidding import collect_bids
from dspark.graph.model import Graph
from dspark.host.inventory import Inventory
from dspark.host.log import get_logger
from dspark.placement.partition import fuse
from dspark.placement.placer_ilp import HOST, Problem, TensorFlow, solve
from dspark.placement.plan import BidSummary, Partition, Plan, Target, graph_fingerprint, hardware_fingerprint
from dspark.host.plugin_manager import PluginHost
from dspark.placement.switching import switch_matrix
from dspark.types import Bid, Device

log = get_logger("dspark.placement.placer")

MEMORY_HEADROOM = 0.9  # of a device's free memory the plan may fill
RATIO_WINDOW = 5  # recent measured/predicted ratios whose median feeds a correction
FreeMemory = Callable[[], Mapping[str, int | None]]  # device id -> free bytes (None: unknown)


class PlacementError(ValueError):
    """No valid plan: the message names the op or budget that made it impossible."""


@dataclass
class BidTable:
    """Single-op and whole-graph bids per target, and corrections from measurement."""

    targets: list[Device]
    op_bids: dict[str, dict[str, Bid]] = field(default_factory=dict)  # op -> target key -> bid
    correction: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (plugin, device, op_type)

    def factor(self, target: Device, op_type: str) -> float:
        return self.correction.get((target.plugin, target.id, op_type), 1.0)


def target_key(d: Device) -> str:
    return f"{d.plugin}@{d.id}"


def _host_resident(inv: Inventory, device_id: str) -> bool:
    return inv.device(device_id).kind == "cpu"


def link_seconds(inv: Inventory, nbytes: int, src: str | None, dst: str | None) -> float:
    """Seconds to move ``nbytes`` between devices (None = host memory)."""
    if src == dst:
        return 0.0
    cost = 0.0
    for dev in (src, dst):
        if dev is None:
            continue
        entry = inv.device(dev)
        if entry.kind == "cpu":
            bw = entry.memory_bandwidth_bytes_per_s or 1e10
        else:
            bw = entry.host_link_bandwidth_bytes_per_s or 1.6e10
        cost += nbytes / bw
    return cost


def collect_op_bids(host: PluginHost, inv: Inventory, graph: Graph,
                    targets: list[Device] | None = None) -> BidTable:
    targets = targets if targets is not None else inv.drivers()
    table = BidTable(targets=targets)
    keys = {target_key(t) for t in targets}
    for op in graph.ops:
        sub = graph.subgraph([op.name])
        table.op_bids[op.name] = {target_key(d): b for d, b in collect_bids(host, inv, sub)
                                  if target_key(d) in keys}
    return table


def build_problem(graph: Graph, inv: Inventory, table: BidTable,
                  run_bids: dict[str, dict[tuple[str, ...], Bid]] | None = None,
                  switch: np.ndarray | None = None) -> Problem:
    targets = table.targets
    keys = [target_key(t) for t in targets]
    n_ops, n_t = len(graph.ops), len(targets)
    cost = np.full((n_ops, n_t), math.inf)
    overhead = np.zeros(n_t)
    for j, (t, k) in enumerate(zip(targets, keys, strict=True)):
        fixed = [table.op_bids[op.name][k].fixed_overhead_s for op in graph.ops if k in table.op_bids[op.name]]
        overhead[j] = statistics.median(fixed) if fixed else 0.0
        for i, op in enumerate(graph.ops):
            bid = table.op_bids[op.name].get(k)
            if bid is not None:
                cost[i, j] = max(bid.latency_s - bid.fixed_overhead_s, 0.0) * table.factor(t, op.op_type)
        # A runtime that runs a fused run faster than its ops one by one gets that credit.
        for run, bid in (run_bids or {}).get(k, {}).items():
            idx = [i for i, op in enumerate(graph.ops) if op.name in set(run)]
            separate = float(cost[idx, j].sum())
            if separate > 0 and math.isfinite(separate):
                # ``separate`` carries the learned corrections; give ``fused`` the same.
                factor = statistics.fmean(table.factor(t, graph.ops[i].op_type) for i in idx)
                fused = max(bid.latency_s - bid.fixed_overhead_s, 0.0) * factor
                cost[idx, j] *= min(max(fused / separate, 0.05), 1.5)
    index = {op.name: i for i, op in enumerate(graph.ops)}
    tensors: list[TensorFlow] = []
    names: list[str] = []
    for tname in list(graph.inputs) + [t for op in graph.ops for t in op.outputs if t]:
        consumers = sorted({index[c] for c in graph.consumers.get(tname, [])})
        spec = graph.tensors.get(tname)
        nbytes = (spec.nbytes(graph.dim_hints) if spec else None) or 0
        producer = HOST if tname in graph.inputs else index[graph.producers[tname]]
        if not consumers and tname not in graph.outputs:
            continue
        tensors.append(TensorFlow(producer=producer, consumers=consumers, nbytes=nbytes,
                                  is_output=tname in graph.outputs))
        names.append(tname)
    devices: list[str | None] = [None if _host_resident(inv, t.id) else t.id for t in targets]
    transfer = np.zeros((len(tensors), n_t + 1, n_t + 1))
    places = list(range(n_t)) + [HOST]
    for s, tf in enumerate(tensors):
        for a in places:
            for b in places:
                if a == b:
                    continue
                src = None if a == HOST else devices[a]
                dst = None if b == HOST else devices[b]
                # Same host memory, different runtimes: one copy at memory bandwidth.
                if src is None and dst is None and a != HOST and b != HOST:
                    transfer[s, a, b] = tf.nbytes / (inv.device(targets[a].id).memory_bandwidth_bytes_per_s or 1e10)
                    if switch is not None:
                        transfer[s, a, b] += switch[a, b]  # measured hand-over between the two runtimes
                else:
                    transfer[s, a, b] = link_seconds(inv, tf.nbytes, src, dst)
    mem = np.array([[float(op.param_bytes)] * n_t for op in graph.ops]) if n_ops else None
    budgets: dict[str, float] = {}
    for d in {t.id for t in targets}:
        free = inv.device(d).memory_free_bytes
        if free is not None:
            budgets[d] = free * MEMORY_HEADROOM
    return Problem(ops=[op.name for op in graph.ops], targets=keys, cost=cost, tensors=tensors,
                   transfer=transfer, entry_overhead=overhead, mem=mem, device_of=[t.id for t in targets],
                   budgets=budgets)


def candidate_runs(graph: Graph, table: BidTable) -> dict[str, list[list[str]]]:
    """Per target: maximal connected, acyclic runs of ops it bid on (its candidate subgraphs)."""
    runs: dict[str, list[list[str]]] = {}
    for t in table.targets:
        k = target_key(t)
        parts = fuse(graph, lambda op, k=k: k if k in table.op_bids[op] else None)
        runs[k] = [p for p in parts if len(p) > 1 and all(k in table.op_bids[o] for o in p)]
    return runs


def plan(graph: Graph, host: PluginHost, inv: Inventory, *, table: BidTable | None = None,
         time_limit_s: float = 20.0) -> Plan:
    """Place ``graph`` on the inventory's targets; see the module docstring."""
    return candidates(graph, host, inv, table=table, time_limit_s=time_limit_s)[0]


def candidates(graph: Graph, host: PluginHost, inv: Inventory, *, table: BidTable | None = None,
               time_limit_s: float = 20.0) -> list[Plan]:
    """The plan :func:`plan` picks, then its rivals (the solver's split and every single target
    that can run the whole model within its budget) from predicted fastest to slowest: what a
    measured choice between close bids (:mod:`dspark.placement.adaptive.trial`) picks from."""
    table = table or collect_op_bids(host, inv, graph)
    by_key = {target_key(t): t for t in table.targets}
    for op in graph.ops:
        if not table.op_bids[op.name]:
            raise PlacementError(f"no plugin bids on op {op.name!r} ({op.op_type}); "
                                 f"active plugins: {', '.join(host.active())}")
    run_bids: dict[str, dict[tuple[str, ...], Bid]] = {}
    for k, runs in candidate_runs(graph, table).items():
        t = by_key[k]
        for run in runs:
            bid = host.call(t.plugin, "dspark_bid", subgraph=graph.subgraph(run), device=t)
            if bid is not None:
                run_bids.setdefault(k, {})[tuple(run)] = bid
    switch = switch_matrix(host, table.targets, [_host_resident(inv, t.id) for t in table.targets])
    problem = build_problem(graph, inv, table, run_bids, switch)
    try:
        assignment, _, status = solve(problem, time_limit_s=time_limit_s)
    except ValueError as exc:
        raise PlacementError(str(exc)) from None
    chosen = {op.name: problem.targets[a] for op, a in zip(graph.ops, assignment, strict=True)}
    split = _explain(graph, host, inv, table, chosen, solver=f"milp ({status})", switch=switch)
    singles = []
    weights = sum(op.param_bytes for op in graph.ops)
    for k, t in by_key.items():
        budget = problem.budgets.get(t.id)
        if budget is not None and weights > budget:
            continue  # the whole model does not fit this device
        if all(k in table.op_bids[op.name] for op in graph.ops):
            singles.append(_explain(graph, host, inv, table, {op.name: k for op in graph.ops},
                                    solver="single target"))
    if not singles:
        split.gate = "no single target can run every op within its memory budget: split required"
        return [split]
    singles.sort(key=lambda p: p.predicted_total_ms)
    best = singles[0]
    for p in (split, *singles):
        p.best_single_target, p.best_single_ms = best.partitions[0].target.key, best.predicted_total_ms
    for p in singles[1:]:
        p.gate = f"single target {p.partitions[0].target.key} predicted {p.predicted_total_ms:.3f} ms"
    if split.predicted_total_ms < best.predicted_total_ms and len(split.partitions) > 1:
        split.gate = (f"split predicted {split.predicted_total_ms:.3f} ms < best single target "
                      f"{best.partitions[0].target.key} {best.predicted_total_ms:.3f} ms")
        return [split, *singles]
    best.gate = (f"single target {best.partitions[0].target.key} predicted {best.predicted_total_ms:.3f} ms "
                 f"<= split {split.predicted_total_ms:.3f} ms")
    best.solver = split.solver
    rest = list(singles[1:])
    if len(split.partitions) > 1:
        split.gate = f"split predicted {split.predicted_total_ms:.3f} ms"
        rest.append(split)
    return [best, *sorted(rest, key=lambda p: p.predicted_total_ms)]


def _explain(graph: Graph, host: PluginHost, inv: Inventory, table: BidTable,
             chosen: dict[str, str], solver: str, switch: np.ndarray | None = None) -> Plan:
    by_key = {target_key(t): t for t in table.targets}
    index = {target_key(t): i for i, t in enumerate(table.targets)}
    groups = fuse(graph, chosen.get)
    where = {op: i for i, g in enumerate(groups) for op in g}
    partitions: list[Partition] = []
    transfer_s = 0.0
    for i, ops in enumerate(groups):
        t = by_key[chosen[ops[0]]]
        sub = graph.subgraph(ops)
        bid = host.call(t.plugin, "dspark_bid", subgraph=sub, device=t)
        if bid is None:  # the owner bid on each op but not on their union: cost them one by one
            latency = sum(table.op_bids[o][chosen[o]].latency_s for o in ops)
            precision = table.op_bids[ops[0]][chosen[ops[0]]].precision
        else:
            latency, precision = bid.latency_s, bid.precision
        latency *= statistics.fmean(table.factor(t, graph.op(o).op_type) for o in ops)
        deps = sorted({where[graph.producers[x]] for x in sub.inputs if x in graph.producers})
        bytes_in = 0
        for x in sub.inputs:
            spec = graph.tensors.get(x)
            nbytes = (spec.nbytes(graph.dim_hints) if spec else 0) or 0
            src_part = where.get(graph.producers.get(x, ""), None)
            src_dev = None if src_part is None else by_key[chosen[groups[src_part][0]]].id
            src = None if src_dev is None or _host_resident(inv, src_dev) else src_dev
            dst = None if _host_resident(inv, t.id) else t.id
            transfer_s += link_seconds(inv, nbytes, src, dst)
            if switch is not None and src_part is not None and src is None and dst is None:
                transfer_s += switch[index[chosen[groups[src_part][0]]], index[chosen[ops[0]]]]
            bytes_in += nbytes
        beaten = []
        for k, other in by_key.items():
            if k == chosen[ops[0]] or not all(k in table.op_bids[o] for o in ops):
                continue
            whole = host.call(other.plugin, "dspark_bid", subgraph=sub, device=other)
            if whole is not None:  # the same ops as one partition there, not op by op
                beaten.append(BidSummary(target=k, latency_ms=1e3 * whole.latency_s, precision=whole.precision))
        partitions.append(Partition(
            id=i, target=Target(plugin=t.plugin, device_id=t.id, runtime=t.runtime), ops=ops,
            inputs=sub.inputs, outputs=sub.outputs, predicted_ms=latency * 1e3, precision=precision,
            depends_on=deps, beaten_bids=beaten, boundary_bytes_in=bytes_in,
        ))
    total_ms = sum(p.predicted_ms for p in partitions) + transfer_s * 1e3
    return Plan(model=graph.name, graph_fingerprint=graph_fingerprint(graph),
                hardware_fingerprint=hardware_fingerprint(
                    [Target(plugin=t.plugin, device_id=t.id, runtime=t.runtime) for t in table.targets]),
                partitions=partitions, predicted_total_ms=total_ms, transfer_ms=transfer_s * 1e3, solver=solver)


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
        if free is not None and need > free * MEMORY_HEADROOM:
            problems.append(f"{dev} needs {need} B of weights > budget {int(free * MEMORY_HEADROOM)} B "
                            f"({MEMORY_HEADROOM:.0%} of {free} B free)")
    return problems


def host_free_memory(inv: Inventory) -> FreeMemory:
    """Cheap default: current available host memory for host-resident devices, others as probed."""
    import psutil

    def free() -> dict[str, int | None]:
        avail = int(psutil.virtual_memory().available)
        return {d.id: avail if d.kind == "cpu" else d.memory_free_bytes for d in inv.devices}

    return free


@dataclass
class PartCost:
    """A partition's prediction without corrections, and the correction keys of its ops: what
    re-scoring a plan under new corrections, and learning from a run's span, need (computed once)."""

    id: int
    target: str
    raw_ms: float
    keys: list[tuple[tuple[str, str, str], int]]  # (plugin, device, op type), ops of that type
    n_ops: int
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=RATIO_WINDOW))  # measured / raw

    def corrected(self, ratios: Mapping[tuple[str, str, str], float]) -> float:
        return self.raw_ms * sum(ratios.get(k, 1.0) * n for k, n in self.keys) / self.n_ops


@dataclass
class Sample:
    """One partition's run against its prediction."""

    target: str
    raw_ms: float
    corrected_ms: float  # with the corrections known before this run
    measured_ms: float
    was_corrected: bool


def prediction_error(samples: list[Sample]) -> dict[str, float | int | None]:
    """Median absolute relative error of predictions vs measurements: ``uncorrected``, the bids as
    plugins made them; ``corrected``, with the corrections learned from earlier runs only (out of
    sample), over the runs where a correction existed, beside ``uncorrected_same_runs``."""
    corrected = [s for s in samples if s.was_corrected]
    return {"samples": len(samples),
            "uncorrected": _median_rel_error([(s.raw_ms, s.measured_ms) for s in samples]),
            "corrected": _median_rel_error([(s.corrected_ms, s.measured_ms) for s in corrected]),
            "uncorrected_same_runs": _median_rel_error([(s.raw_ms, s.measured_ms) for s in corrected])}


def _median_rel_error(pairs: list[tuple[float, float]]) -> float | None:
    errs = [abs(p - m) / m for p, m in pairs if m > 0]
    return float(statistics.median(errs)) if errs else None


def part_costs(graph: Graph, plan: Plan, ratios: Mapping[tuple[str, str, str], float]) -> list[PartCost]:
    """``plan``'s partitions as :class:`PartCost`; ``ratios``: the corrections it was made with."""
    out = []
    for p in plan.partitions:
        n = max(len(p.ops), 1)
        keys = [((p.plugin, p.device, t), c) for t, c in Counter(graph.op(o).op_type for o in p.ops).items()]
        # predicted_ms already carries the corrections the plan was made with; keep the raw bid.
        out.append(PartCost(p.id, p.target.key, p.predicted_ms * n / sum(ratios.get(k, 1.0) * c for k, c in keys),
                            keys, n))
    return out


def corrected_total(plan: Plan, costs: list[PartCost], ratios: Mapping[tuple[str, str, str], float]) -> float:
    """``plan``'s predicted total under ``ratios``."""
    return sum(c.corrected(ratios) for c in costs) + plan.transfer_ms
