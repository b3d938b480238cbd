"""Measured choices between close bids: plans whose predictions are within the cost model's
error are timed against each other on the caller's inputs before one is committed.

A prediction is a calibrated bid plus a model of hand-overs; its error on a
whole plan is a few percent to a few tens of percent (docs/benchmarks.md), so
two plans predicted within that error of each other are a coin toss for the
placer. Instead the rivals are compiled and raced: rounds in which each runs
a short block on the same inputs, the block's first run dropped (it pays for
the previous runtime's worker threads going idle, a cost of alternating that
a committed plan never pays), so drifting load hits every rival alike. The
lowest median wins; :attr:`Plan.decision` says by how much and on what.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dspark.host.log import get_logger
from dspark.placement.plan import Plan

log = get_logger("dspark.placement.trial")


class CompiledPlanLike(Protocol):
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


DEFAULT_ERROR = 0.25  # the cost model's relative error before any run corrected it (its target, issue 3)
MIN_ERROR = 0.03  # a corrected model is never trusted closer than this
# A shape bucket's bids come from other sizes (scaled by the roofline) or are timed alone at its own, and
# runtimes differ in what a batch gains them (docs/benchmarks.md, "Serving any model"): plans predicted
# within 2x of the best are raced on the bucket's first run.
BUCKET_ERROR = 1.0
MAX_RIVALS = 3
ROUNDS = 6
BLOCK = 3
BUDGET_S = 2.0  # a race stops after the round that crosses this
TIE = 0.03  # medians this close are a tie, which the plan with fewer partitions (hand-overs) wins


@dataclass(frozen=True)
class Lap:
    """One rival's result in a race."""

    label: str
    predicted_ms: float
    median_ms: float
    runs: int


def release_garbage() -> None:
    """Collect now what planning left in reference cycles: compiled runtimes of calibrations and of
    the plans that lost hold worker threads that slowed the winner's runs until the collector ran."""
    gc.collect()


def label(plan: Plan) -> str:
    """``cpu@cpu`` for a one-target plan, ``split cpu@cpu+npu@cpu (3 partitions)`` otherwise."""
    keys = list(dict.fromkeys(p.target.key for p in plan.partitions))
    if len(plan.partitions) == 1:
        return keys[0]
    return f"split {'+'.join(keys)} ({len(plan.partitions)} partitions)"


def assignment_key(plan: Plan) -> str:
    """The plan's op -> target assignment as one hashable string."""
    return repr(sorted(plan.assignment().items()))


def close_rivals(ranked: Sequence[Plan], error: float = DEFAULT_ERROR) -> list[Plan]:
    """The plans after ``ranked[0]`` (the predicted best) predicted within ``error`` of it; and, when the
    best is a split, the fastest one-target plan whatever its prediction.

    A split's prediction is a sum of partitions each timed alone, and it misses what alternating
    runtimes cost each other (thread pools waking and spinning in turn), which grows with the number
    of hand-overs: the split is raced against one runtime running it all, so a plan is never slower
    than the best single runtime measured on the caller's inputs.
    """
    if not ranked:
        return []
    best = ranked[0]
    margin = max(error, MIN_ERROR)
    seen = {assignment_key(best)}
    rivals: list[Plan] = []
    for p in ranked[1:]:
        key = assignment_key(p)
        if key in seen or p.predicted_total_ms > best.predicted_total_ms * (1 + margin):
            continue
        seen.add(key)
        rivals.append(p)
    rivals = rivals[:MAX_RIVALS]
    if len(best.partitions) > 1 and not any(len(p.partitions) == 1 for p in rivals):
        single = next((p for p in ranked[1:] if len(p.partitions) == 1 and assignment_key(p) not in seen), None)
        if single is not None:
            rivals.append(single)
    return rivals


def race(runs: Sequence[Callable[[], object]], *, rounds: int = ROUNDS, block: int = BLOCK,
         budget_s: float = BUDGET_S) -> list[list[float]]:
    """Interleaved timings (ms) of each callable: per round, one dropped run then ``block`` timed."""
    samples: list[list[float]] = [[] for _ in runs]
    t_end = time.perf_counter() + budget_s
    for r in range(rounds):
        for i, fn in enumerate(runs):
            fn()
            for _ in range(block):
                t = time.perf_counter()
                fn()
                samples[i].append((time.perf_counter() - t) * 1e3)
        if r >= 1 and time.perf_counter() > t_end:
            break
    return samples


def decide(plans: Sequence[Plan], runs: Sequence[Callable[[], object]], error: float,
           inputs: str = "the caller's inputs") -> tuple[int, list[Lap]]:
    """Race ``runs`` (one per plan, ``plans[0]`` the predicted best); the winner's index, and its
    :attr:`Plan.decision` written on every plan (each rival's says who beat it)."""
    samples = race(runs)
    laps = [Lap(label(p), p.predicted_total_ms, statistics.median(xs), len(xs))
            for p, xs in zip(plans, samples, strict=True)]
    fastest = int(np.argmin([lap.median_ms for lap in laps]))
    tied = [i for i, lap in enumerate(laps) if lap.median_ms <= laps[fastest].median_ms * (1 + TIE)]
    win = min(tied, key=lambda i: (len(plans[i].partitions), laps[i].median_ms))
    w = laps[win]
    others = "; ".join(f"{lap.label} {lap.median_ms:.3f} ms (predicted {lap.predicted_ms:.3f})"
                       for i, lap in enumerate(laps) if i != win)
    tie = "" if win == fastest else (f"; a tie within {TIE:.0%}, kept for its fewer partitions "
                                     f"(fewer hand-overs)")
    margin = max(error, MIN_ERROR)
    why = (f"the predictions were within the cost model's error ({margin:.0%})"
           if all(p.predicted_total_ms <= plans[0].predicted_total_ms * (1 + margin) for p in plans)
           else "a split is always raced against the fastest single runtime")
    text = (f"measured: {w.label} {w.median_ms:.3f} ms (predicted {w.predicted_ms:.3f}) beat {others}{tie}; "
            f"medians of {w.runs} interleaved runs each on {inputs}, raced because {why}")
    for p in plans:
        p.decision = text
    return win, laps


def predicted(plan: Plan, runner_up: Plan | None, error: float) -> str:
    """The decision text of a plan that won on prediction alone."""
    if runner_up is None:
        return f"predicted: {label(plan)} {plan.predicted_total_ms:.3f} ms, no rival plan"
    return (f"predicted: {label(plan)} {plan.predicted_total_ms:.3f} ms; the next best, {label(runner_up)} "
            f"{runner_up.predicted_total_ms:.3f} ms, is beyond the cost model's error ({max(error, MIN_ERROR):.0%})")


def choose(ranked: Sequence[Plan], compile: Callable[[Plan], CompiledPlanLike], inputs: dict[str, np.ndarray],
           error: float = DEFAULT_ERROR, what: str = "the caller's inputs") -> Plan:
    """The plan to commit from ``ranked`` (predicted best first): raced against its close rivals on
    ``inputs`` when it has any (compiled with ``compile``; a rival that fails to compile or run is
    left out), else the predicted best. Its :attr:`Plan.decision` says which and why."""
    best = ranked[0]
    rivals = close_rivals(ranked, error)
    if not rivals:
        best.decision = predicted(best, ranked[1] if len(ranked) > 1 else None, error)
        return best
    entrants: list[Plan] = []
    compiled: list[CompiledPlanLike] = []
    for p in [best, *rivals]:
        try:
            c = compile(p)
            c.run(inputs)  # warm-up; also proves the plan runs
        except Exception as exc:  # noqa: BLE001 - a rival that fails is left out; the failure was charged
            if p is best:
                raise
            log.warning("trial.rival_failed", plan=label(p), error=f"{type(exc).__name__}: {exc}")
            continue
        entrants.append(p)
        compiled.append(c)
    try:
        if len(entrants) < 2:
            best.decision = f"predicted: {label(best)}; its close rivals failed to compile or run"
            return best
        win, _ = decide(entrants, [lambda c=c: c.run(inputs) for c in compiled], error, what)
        return entrants[win]
    finally:
        for c in compiled:
            c.close()
        release_garbage()
