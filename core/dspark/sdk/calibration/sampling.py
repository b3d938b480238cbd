"""Timing executables: a warm-up, then batches of timed runs with the host's load during each.

Contention only ever adds time, so batches are compared with the lowest
median among them: a batch more than ``OUTLIER_FACTOR`` over it is an outlier
and is taken again after a pause (up to ``EXTRA_BATCHES`` more), until
``BATCHES`` batches agree. The result is the lowest of the agreeing batches'
medians (a runtime still settling after its first runs, or a burst of load,
only slows a batch down), with the host's CPU contention during them (:mod:`.load`): a
measurement whose every kept batch ran on a busy host is marked ``busy``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from dspark.host import hostinfo
from dspark.sdk.calibration import config, load
from dspark.types import Executable

Feeds = dict[str, np.ndarray]

# Seams: tests script time and the host's load through these.
clock: Callable[[], float] = time.perf_counter
pause: Callable[[float], None] = time.sleep


@dataclass(frozen=True)
class Batch:
    """One batch: the median seconds per executable, its rounds, the host's contention (0..1)."""

    medians: tuple[float, ...]
    rounds: int
    load: float


@dataclass(frozen=True)
class Measurement:
    """What :func:`measure` found: per executable the lowest batch median (seconds) of the agreeing batches."""

    medians: tuple[float, ...]
    samples: int  # timed rounds over every batch taken
    batches: tuple[Batch, ...]  # every batch taken, in order
    kept: tuple[Batch, ...]  # the agreeing ones the medians come from
    busy: bool  # every kept batch ran while the host was busy

    @property
    def load(self) -> float:
        return max(b.load for b in self.kept)

    @property
    def remeasured(self) -> int:
        """Batches taken beyond the planned ones (outliers re-taken)."""
        return max(0, len(self.batches) - config.BATCHES)

    def record(self) -> dict[str, Any]:
        """The facts stored with a cache entry (besides the latency)."""
        return {"samples": self.samples, "load": round(self.load, 3), "busy": self.busy,
                "loadavg": load.loadavg_per_core(), "batch_medians_s": [b.medians[0] for b in self.batches],
                "batch_loads": [round(b.load, 3) for b in self.batches]}


class _Hold:
    """The CPU benchmark lock (or nothing), released during pauses so other probes go on."""

    def __init__(self, lock: hostinfo.BenchmarkLock | None) -> None:
        self._lock = lock

    def __enter__(self) -> Self:
        if self._lock is not None:
            self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.release()

    def pause(self, seconds: float) -> None:
        if self._lock is not None:
            self._lock.release()
        try:
            pause(seconds)
        finally:
            if self._lock is not None:
                self._lock.acquire()


def _batch(runs: list[tuple[Executable, Feeds]], budget_s: float, min_rounds: int, max_rounds: int,
           flush: Callable[[], None] | None) -> Batch:
    window = load.start_window()
    samples: list[list[float]] = [[] for _ in runs]
    start = clock()
    deadline = start + budget_s
    min_window = config.MIN_WINDOW_S / config.BATCHES * len(runs)
    rounds = 0
    while True:
        for (exe, feed), out in zip(runs, samples, strict=True):
            if flush is not None:
                flush()
            t = clock()
            exe.run(feed)
            out.append(clock() - t)
        rounds += 1
        now = clock()
        if now >= deadline or rounds >= max_rounds or (rounds >= min_rounds and now - start >= min_window):
            break
    return Batch(tuple(statistics.median(x) for x in samples), rounds, window.stop())


def agreeing(batches: list[Batch]) -> list[Batch]:
    """The batches within ``OUTLIER_FACTOR`` of the lowest median (of the first executable)."""
    best = min(b.medians[0] for b in batches)
    return [b for b in batches if b.medians[0] <= config.OUTLIER_FACTOR * best]


def measure(exes: list[Executable], feeds: Feeds | list[Feeds], budget_s: float, on_cpu: bool,
            flush: Callable[[], None] | None = None) -> Measurement:
    """Time ``run(feeds)`` of each executable after a warm-up, within ``budget_s`` (plus re-taken batches).

    Several executables are run in turn, round by round, so that they share
    whatever load the host is under while they are compared; ``feeds`` is one
    dict for all, or one per executable. ``flush`` (not timed) runs before
    each timed run. CPU timings hold :data:`dspark.host.hostinfo.cpu_benchmark_lock`.
    """
    runs = list(zip(exes, feeds if isinstance(feeds, list) else [feeds] * len(exes), strict=True))
    with _Hold(hostinfo.cpu_benchmark_lock if on_cpu else None) as hold:
        window = load.start_window()
        t0 = clock()
        for exe, feed in runs:
            exe.run(feed)  # the first run allocates and primes caches
        first = clock() - t0
        if first >= budget_s:
            # The first run pays allocations, lazy compilation, or a burst of load: one more says
            # whether a single run really is all the budget allows.
            t0 = clock()
            for exe, feed in runs:
                exe.run(feed)
            first = clock() - t0
            if first >= budget_s:
                only = Batch(tuple([first / len(exes)] * len(exes)), 1, window.stop())
                return Measurement(only.medians, 1, (only,), (only,), only.load > config.BUSY_LOAD)
            first = 0.0  # the budget starts now
        elif first * 4 < budget_s:
            for exe, feed in runs:
                exe.run(feed)
        per_batch = (budget_s - first) / config.BATCHES
        min_rounds = math.ceil(config.MIN_SAMPLES / config.BATCHES)
        max_rounds = max(1, config.MAX_SAMPLES // config.BATCHES)
        batches = [_batch(runs, per_batch, min_rounds, max_rounds, flush) for _ in range(config.BATCHES)]
        for _ in range(config.EXTRA_BATCHES):
            if len(agreeing(batches)) >= config.BATCHES:
                break
            hold.pause(config.RETRY_PAUSE_S)
            batches.append(_batch(runs, per_batch, min_rounds, max_rounds, flush))
    kept = agreeing(batches)
    medians = tuple(min(b.medians[i] for b in kept) for i in range(len(exes)))
    return Measurement(medians, sum(b.rounds for b in batches), tuple(batches), tuple(kept),
                       all(b.load > config.BUSY_LOAD for b in kept))
