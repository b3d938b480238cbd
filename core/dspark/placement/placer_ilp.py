"""The placement problem in numbers, its exact solver, and a brute-force check.

Ops are assigned to targets so that predicted end-to-end latency is lowest:
the sum of each op's cost on its target, plus, for every tensor that crosses
from one target to another, the copy (bytes over the link bandwidth) and the
overhead of entering the destination's partition, under each device's memory
budget. Assigning to more than two targets with pairwise transfer costs is
NP-hard in general (Stone 1977 covers two: a min cut), so it is solved as a
0-1 integer program with HiGHS (scipy.optimize.milp), which returns the
proven optimum of the model for graphs of the sizes here and the best found
within a time limit otherwise (the gap is reported).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

HOST = -1  # where graph inputs come from and outputs go to: host memory


@dataclass
class TensorFlow:
    producer: int  # op index, or HOST for a graph input
    consumers: list[int]
    nbytes: int
    is_output: bool = False


@dataclass
class Problem:
    ops: list[str]
    targets: list[str]
    cost: np.ndarray  # (ops, targets) seconds; inf where the target abstained
    tensors: list[TensorFlow]
    transfer: np.ndarray  # (tensors, targets + 1, targets + 1) seconds; index -1 = HOST
    entry_overhead: np.ndarray  # (targets,) seconds charged per tensor entering a target
    mem: np.ndarray | None = None  # (ops, targets) bytes resident on the target's device
    device_of: list[str] = field(default_factory=list)  # per target
    budgets: dict[str, float] = field(default_factory=dict)  # device -> bytes

    def allowed(self, v: int) -> list[int]:
        return [t for t in range(len(self.targets)) if math.isfinite(self.cost[v, t])]


def assignment_cost(p: Problem, a: list[int] | np.ndarray) -> float:
    """Objective value of an assignment (op index -> target index); inf if infeasible."""
    total = 0.0
    for v, t in enumerate(a):
        total += p.cost[v, t]
    for s, tf in enumerate(p.tensors):
        src = HOST if tf.producer == HOST else int(a[tf.producer])
        dests = {int(a[c]) for c in tf.consumers}
        if tf.is_output:
            dests.add(HOST)
        for dst in dests:
            if dst != src:
                total += p.transfer[s, src, dst] + (p.entry_overhead[dst] if dst != HOST else 0.0)
    if p.mem is not None and p.budgets:
        used: dict[str, float] = {}
        for v, t in enumerate(a):
            used[p.device_of[t]] = used.get(p.device_of[t], 0.0) + float(p.mem[v, t])
        if any(used.get(d, 0.0) > b for d, b in p.budgets.items()):
            return math.inf
    return float(total)


def brute_force(p: Problem) -> tuple[list[int], float]:
    """Exhaustive optimum, for checking the solver on small problems."""
    best: tuple[list[int], float] = ([], math.inf)
    for a in itertools.product(*(p.allowed(v) for v in range(len(p.ops)))):
        c = assignment_cost(p, a)
        if c < best[1]:
            best = (list(a), c)
    return best


def solve(p: Problem, time_limit_s: float = 20.0) -> tuple[list[int], float, str]:
    """Optimal assignment of the model by 0-1 integer programming; (assignment, cost, status)."""
    from scipy.optimize import LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n_ops, n_t = p.cost.shape
    for v in range(n_ops):
        if not p.allowed(v):
            raise ValueError(f"no target can run op {p.ops[v]!r}")
    var_cost: list[float] = []
    x: dict[tuple[int, int], int] = {}
    for v in range(n_ops):
        for t in p.allowed(v):
            x[v, t] = len(var_cost)
            var_cost.append(float(p.cost[v, t]))
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lb: list[float] = []
    ub: list[float] = []

    def constraint(terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(lb)
        for col, val in terms:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lb.append(lo)
        ub.append(hi)

    for v in range(n_ops):  # each op on exactly one target
        constraint([(x[v, t], 1.0) for t in p.allowed(v)], 1.0, 1.0)
    for s, tf in enumerate(p.tensors):
        if tf.producer == HOST:
            for b in range(n_t):
                users = [c for c in tf.consumers if (c, b) in x]
                if not users:
                    continue
                y = len(var_cost)  # the input enters target b
                var_cost.append(float(p.transfer[s, HOST, b] + p.entry_overhead[b]))
                for c in users:
                    constraint([(y, 1.0), (x[c, b], -1.0)], 0.0, math.inf)
            continue
        u = tf.producer
        if tf.is_output:
            for a in p.allowed(u):
                var_cost[x[u, a]] += float(p.transfer[s, a, HOST])
        for a in p.allowed(u):
            for b in range(n_t):
                if b == a:
                    continue
                users = [c for c in tf.consumers if (c, b) in x]
                if not users:
                    continue
                z = len(var_cost)  # the tensor moves from a to b (once, whatever the number of users)
                var_cost.append(float(p.transfer[s, a, b] + p.entry_overhead[b]))
                for c in users:
                    constraint([(z, 1.0), (x[u, a], -1.0), (x[c, b], -1.0)], -1.0, math.inf)
    if p.mem is not None and p.budgets:
        for device, budget in p.budgets.items():
            terms = [(x[v, t], float(p.mem[v, t])) for (v, t) in x if p.device_of[t] == device]
            if terms:
                constraint(terms, -math.inf, float(budget))
    n_var = len(var_cost)
    A = coo_matrix((vals, (rows, cols)), shape=(len(lb), n_var)).tocsr()
    res = milp(np.array(var_cost), integrality=np.ones(n_var), bounds=(0, 1),
               constraints=LinearConstraint(A, np.array(lb), np.array(ub)),
               options={"time_limit": time_limit_s, "mip_rel_gap": 1e-6})
    if res.x is None:
        raise ValueError(f"no placement satisfies the memory budgets ({res.message})")
    assignment = [max(p.allowed(v), key=lambda t, v=v: res.x[x[v, t]]) for v in range(n_ops)]
    status = "optimal" if res.status == 0 else f"time limit, gap {getattr(res, 'mip_gap', float('nan')):.2%}"
    return assignment, assignment_cost(p, assignment), status
