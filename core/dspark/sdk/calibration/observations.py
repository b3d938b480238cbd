"""Real run times correct the calibrations a plan was made from.

The executor reports each partition's run time (:func:`observe_run`); any
caller can report one subgraph's (:func:`observe`). Once ``OBSERVE_MIN`` runs
of a subgraph at its hinted shapes were seen, their median is compared with
the entries this process's bids came from (:mod:`.store`):

- the subgraph's own entry, when it differs from the median by more than
  ``OBSERVE_TOLERANCE`` either way, is replaced by it (``source: observed``),
  except that runs slower than the entry while the host is busy prove
  nothing and are not acted on;
- the entry of one of its ops, when that op alone was calibrated slower than
  the whole subgraph runs (beyond the tolerance), is dropped, to be measured
  again by the next plan: contention only ever adds time, so such an entry
  was measured under load.

Runs reported while this process plans beside them (:func:`planning_beside`:
a background re-plan's bids and compiles share the cores with the runs) are
not recorded at all: the host's load, looked at when judging, may have
calmed by then, and such runs would replace an entry with their slowness.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from dspark.graph.model import Graph, Subgraph
from dspark.host.log import get_logger
from dspark.sdk.calibration import config, load, store
from dspark.sdk.calibration.inputs import concrete_shape
from dspark.types import Device

log = get_logger("dspark.sdk.calibration")

Verdict = Literal["pending", "kept", "replaced", "dropped", "uncalibrated"]


@dataclass
class _Watch:
    """The observations of one subgraph on one device, and the entries they are compared with."""

    graph: Graph
    ops: list[str]
    device: Device
    ident: store.Identity
    expected: tuple[tuple[str, tuple[int, ...]], ...]  # input name -> shape the calibration ran at
    times: deque[float] = field(default_factory=lambda: deque(maxlen=config.OBSERVE_WINDOW))
    fresh: int = 0  # observations since the last judgment
    parts: list[store.Identity] | None = None  # the entries of its ops, found on the first judgment

    @classmethod
    def of(cls, subgraph: Subgraph, device: Device) -> _Watch:
        hints = subgraph.graph.dim_hints
        expected = tuple((t, concrete_shape(spec, hints)) for t in subgraph.inputs
                         if (spec := subgraph.graph.tensors.get(t)) is not None and spec.rank_known)
        return cls(subgraph.graph, [op.name for op in subgraph.ops], device,
                   store.identity(subgraph, device), expected)

    def shapes_match(self, env: Mapping[str, Any]) -> bool:
        for name, shape in self.expected:
            value = env.get(name)
            if value is None or tuple(np.shape(value)) != shape:
                return False
        return True

    def add(self, seconds: float) -> float | None:
        """Record one run; the median to judge by when a judgment is due, else None."""
        self.times.append(seconds)
        self.fresh += 1
        if self.fresh < config.OBSERVE_MIN or len(self.times) < config.OBSERVE_MIN:
            return None
        self.fresh = 0
        return statistics.median(self.times)


_lock = threading.Lock()
_watches: dict[store.Identity, _Watch] = {}  # observe()'s, by subgraph identity
# observe_run()'s, by id(compiled plan): per partition id, the partition watched and its watch.
_plans: dict[int, tuple[weakref.ref[Any], dict[int, tuple[Any, _Watch]]]] = {}


_beside = 0  # planning under way in this process beside the runs reported (see planning_beside)


@contextlib.contextmanager
def planning_beside() -> Iterator[None]:
    """Mark planning work (bids, compiles) that runs in this process beside its callers' runs: runs
    reported meanwhile share the cores with it, prove nothing about the runtime, and are not recorded."""
    global _beside
    with _lock:
        _beside += 1
    try:
        yield
    finally:
        with _lock:
            _beside -= 1


def _tolerance(used: store.Used) -> float:
    return config.COLD_OBSERVE_TOLERANCE if used.cold else config.OBSERVE_TOLERANCE


def _judge(watch: _Watch, observed: float) -> Verdict:
    verdict: Verdict = "uncalibrated"
    used = store.lookup(watch.ident)
    if used is not None:
        tol = _tolerance(used)
        verdict = "kept"
        if used.latency_s > tol * observed or (observed > tol * used.latency_s
                                               and not load.busy_now(config.BUSY_LOAD)):
            value = {"latency_s": observed, "source": "observed", "samples": len(watch.times),
                     "replaced_s": used.latency_s, "busy": False, "loadavg": load.loadavg_per_core()}
            store.replace(watch.ident, used, value)
            log.info("calibration.replaced", plugin=watch.device.plugin, device=watch.device.id,
                     ops=used.subgraph, calibrated_ms=round(used.latency_s * 1e3, 4),
                     observed_ms=round(observed * 1e3, 4), runs=len(watch.times))
            verdict = "replaced"
    if len(watch.ops) > 1:
        if watch.parts is None:
            watch.parts = [i for op in watch.ops if (i := store.op_identity(watch.graph, op, watch.device))]
        for ident in watch.parts:
            part = store.lookup(ident)
            if part is not None and part.latency_s > _tolerance(part) * observed \
                    and part.latency_s - observed > config.OBSERVE_MIN_GAP_S:
                store.drop(ident, part)
                log.info("calibration.dropped", plugin=watch.device.plugin, device=watch.device.id,
                         ops=part.subgraph, calibrated_ms=round(part.latency_s * 1e3, 4),
                         whole_subgraph_ms=round(observed * 1e3, 4), subgraph_ops=len(watch.ops))
                verdict = "dropped"
    if verdict in ("replaced", "dropped"):
        watch.times.clear()
    return verdict


def observe(subgraph: Subgraph, device: Device, seconds: float,
            inputs: dict[str, Any] | None = None) -> Verdict:
    """Report one real run of ``subgraph`` on ``device`` (a driver: ``device.plugin`` set) that took
    ``seconds``; what became of the calibrations it is compared with (see the module notes).

    ``inputs``: the run's inputs; a run at other shapes than the calibration's (the dim hints)
    is not comparable and is ignored ("uncalibrated"). "pending": not enough runs yet, or a run
    reported while this process plans beside it (not recorded).
    """
    if not config.enabled():
        return "uncalibrated"
    if _beside:
        return "pending"
    ident = store.identity(subgraph, device)
    with _lock:
        watch = _watches.get(ident)
        if watch is None:
            watch = _watches[ident] = _Watch.of(subgraph, device)
        if inputs is not None and not watch.shapes_match(inputs):
            return "uncalibrated"
        observed = watch.add(seconds)
        return "pending" if observed is None else _judge(watch, observed)


class _Span(Protocol):
    start: float
    end: float


def observe_run(compiled: Any, spans: Mapping[int, _Span], env: Mapping[str, Any]) -> None:
    """:func:`observe` for every partition of one run of a compiled plan (its ``graph``, ``parts``
    and ``devices``), from the run's ``spans`` and tensors ``env``. Cheap when nothing of the plan
    was calibrated in this process: it returns at once."""
    if not config.enabled() or not spans or _beside:
        return
    with _lock:
        held = _plans.get(id(compiled))
        if held is None or held[0]() is not compiled:
            ref = weakref.ref(compiled, functools.partial(_forget_plan, id(compiled)))
            held = _plans[id(compiled)] = (ref, {})
        watches = held[1]
        for pid, span in spans.items():
            part, device = compiled.parts.get(pid), compiled.devices.get(pid)
            if part is None or device is None:
                continue
            held_part, watch = watches.get(pid, (None, None))
            if watch is None or held_part is not part or watch.device is not device:
                if not store.has_any(device.plugin, device.id):
                    continue
                watch = _Watch.of(compiled.graph.subgraph(part.ops), device)
                watches[pid] = (part, watch)
            if not watch.shapes_match(env):
                continue
            observed = watch.add(span.end - span.start)
            if observed is not None:
                _judge(watch, observed)


def _forget_plan(key: int, _ref: object) -> None:
    _plans.pop(key, None)  # the compiled plan is gone; its id may be reused


def forget() -> None:
    """Drop every observation (after the cache was cleared)."""
    with _lock:
        _watches.clear()
        _plans.clear()
