"""The placer's solver against brute force on small random graphs (up to 12 ops, 3 targets)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dspark.placement.placer_ilp import HOST, Problem, TensorFlow, assignment_cost, brute_force, solve


def random_problem(seed: int, n_ops: int, n_t: int = 3, budget: bool = False) -> Problem:
    rng = np.random.default_rng(seed)
    cost = rng.uniform(1e-4, 5e-3, size=(n_ops, n_t))
    cost[rng.uniform(size=cost.shape) < 0.15] = math.inf  # some targets cannot run some ops
    for v in range(n_ops):
        if not np.isfinite(cost[v]).any():
            cost[v, rng.integers(n_t)] = 1e-3
    tensors = [TensorFlow(producer=HOST, consumers=[0], nbytes=int(rng.integers(1e3, 1e6)))]
    for v in range(n_ops):  # a random DAG: each op feeds 1-3 later ops
        later = list(range(v + 1, n_ops))
        users = sorted(rng.choice(later, size=min(len(later), int(rng.integers(1, 4))), replace=False)) if later else []
        tensors.append(TensorFlow(producer=v, consumers=[int(u) for u in users],
                                  nbytes=int(rng.integers(1e3, 1e6)), is_output=not users))
    bw = rng.uniform(1e9, 2e10, size=(n_t + 1, n_t + 1))
    transfer = np.stack([tf.nbytes / bw for tf in tensors])
    for s in range(len(tensors)):
        for t in list(range(n_t)) + [HOST]:
            transfer[s, t, t] = 0.0
    device_of = ["cpu", "gpu", "npu"][:n_t]
    mem = rng.uniform(0, 100, size=(n_ops, n_t))
    budgets = {"gpu": 0.3 * mem[:, 1].sum()} if budget else {}
    return Problem(ops=[f"op{i}" for i in range(n_ops)], targets=[f"t{i}" for i in range(n_t)], cost=cost,
                   tensors=tensors, transfer=transfer, entry_overhead=rng.uniform(1e-5, 5e-4, n_t),
                   mem=mem, device_of=device_of, budgets=budgets)


@pytest.mark.parametrize("seed", range(12))
def test_solver_within_2_percent_of_brute_force(seed: int) -> None:
    n_ops = 6 + seed % 7  # 6..12 ops
    p = random_problem(seed, n_ops, budget=seed % 3 == 0)
    best_a, best = brute_force(p) if n_ops <= 9 else _brute_force_numpy(p)
    a, c, status = solve(p)
    assert status == "optimal"
    assert c == pytest.approx(assignment_cost(p, a))
    assert math.isfinite(c)
    assert c <= best * 1.02, (c, best, a, best_a)


def _brute_force_numpy(p: Problem) -> tuple[list[int], float]:
    """Brute force for up to 12 ops x 3 targets (531,441 assignments), vectorised."""
    n_ops, n_t = p.cost.shape
    grids = np.array(np.meshgrid(*[np.arange(n_t)] * n_ops, indexing="ij")).reshape(n_ops, -1).T
    total = p.cost[np.arange(n_ops), grids].sum(axis=1)
    for s, tf in enumerate(p.tensors):
        src = np.full(len(grids), n_t) if tf.producer == HOST else grids[:, tf.producer]  # n_t = HOST column
        dest_sets = [grids[:, c] for c in tf.consumers] + ([np.full(len(grids), n_t)] if tf.is_output else [])
        tr = np.concatenate([p.transfer[s], p.transfer[s][-1:]], axis=0)  # index n_t maps to HOST (-1)
        tr = np.concatenate([tr, tr[:, -1:]], axis=1)
        overhead = np.append(p.entry_overhead, 0.0)
        for dst in range(n_t + 1):
            reaches = np.zeros(len(grids), bool)
            for d in dest_sets:
                reaches |= d == dst
            moves = reaches & (src != dst)
            total = total + np.where(moves, tr[src, dst] + overhead[dst], 0.0)
    if p.budgets:
        for device, budget in p.budgets.items():
            ts = [t for t in range(n_t) if p.device_of[t] == device]
            used = sum(np.where(grids == t, p.mem[np.arange(n_ops), t], 0.0) for t in ts).sum(axis=1)
            total = np.where(used > budget, np.inf, total)
    i = int(np.argmin(total))
    return grids[i].tolist(), float(total[i])


def test_numpy_brute_force_agrees_with_the_plain_one() -> None:
    p = random_problem(99, 7, budget=True)
    assert _brute_force_numpy(p)[1] == pytest.approx(brute_force(p)[1])


def test_memory_budget_is_respected() -> None:
    p = random_problem(5, 8)
    p.cost[:, 1] = 1e-6  # the "gpu" is much faster for everything...
    p.budgets = {"gpu": float(p.mem[:, 1].sum()) * 0.4}  # ...but only 40% of the weights fit
    a, c, _ = solve(p)
    used = sum(p.mem[v, 1] for v, t in enumerate(a) if t == 1)
    assert used <= p.budgets["gpu"] + 1e-9
    assert any(t == 1 for t in a) and any(t != 1 for t in a)


def test_op_nobody_runs_is_named() -> None:
    p = random_problem(1, 5)
    p.cost[3, :] = math.inf
    with pytest.raises(ValueError, match="op3"):
        solve(p)
