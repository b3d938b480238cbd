"""Running a plan: each partition on the runtime that won it, in dependency order.

Partitions with no dependency between them run concurrently when they are on
different devices; partitions sharing a device take turns (one lock per
device, shared by every concurrent ``run`` of the same compiled plan), since
two runtimes racing for the same silicon mostly slow each other down.
Tensors cross partition boundaries as host numpy arrays, cast to the dtype
the graph declares, so a runtime that hands back float16 or int32 cannot leak
a surprise into its neighbour; an array that already has the declared dtype
and a C layout is passed on as it is, never copied.

The hot path is lean: a one-partition plan runs its executable in the
caller's thread with nothing but the dtype check, the lock and two clock
reads around it, all in one closure (``CompiledPlan.lean_run``) that holds
what it reads; the runtime-time feedback to calibration
(:func:`dspark.sdk.calibration.observe_run`) sees every run of a plan's
first ``OBSERVE_ALL`` and then one in ``OBSERVE_EVERY``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

import numpy as np
from dspark.placement.bidding import compile_on
from dspark.graph.model import Graph, numpy_dtype
from dspark.host.inventory import Inventory
from dspark.placement.plan import Partition, Plan
from dspark.host.plugin_manager import PluginHost
from dspark.types import Device, Executable

HISTORY_LEN = 1000  # measurements kept per partition
OBSERVE_ALL = 32  # runs of a compiled plan that all feed calibration's observations
OBSERVE_EVERY = 128  # after those, one run in this many (a sampled run is slow enough to move the median)


class PlanError(ValueError):
    """The plan does not fit the graph or the inventory (missing op, unknown target)."""


class PartitionFailed(RuntimeError):
    """A partition raised or returned something wrong at run time; names partition, target and ops."""

    def __init__(self, part: Partition, message: str) -> None:
        self.partition = part
        super().__init__(f"partition {part.id} on {part.target.key} ({part.target.runtime or '?'}) "
                         f"running ops {abbreviate(part.ops)}: {message}")


def abbreviate(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return f"[{shown}{f', ... (+{len(names) - limit})' if len(names) > limit else ''}]"


@dataclass
class Span:
    """When one partition ran (``time.perf_counter`` seconds) and on which thread."""

    start: float
    end: float
    thread: str

    @property
    def ms(self) -> float:
        return (self.end - self.start) * 1e3


def dependencies(graph: Graph, plan: Plan) -> dict[int, set[int]]:
    """Partition id -> ids of the partitions producing its inputs, from the graph itself.

    Recomputed rather than read from ``Partition.depends_on`` so a hand-built
    plan needs only ``ops`` and ``target``. Raises :class:`PlanError` when the
    plan misses or repeats an op, or its partitions depend on each other in a cycle.
    """
    owner: dict[str, int] = {}
    for part in plan.partitions:
        for op in part.ops:
            if op in owner:
                raise PlanError(f"op {op!r} is in partitions {owner[op]} and {part.id}")
            graph.op(op)
            owner[op] = part.id
    missing = [op.name for op in graph.ops if op.name not in owner]
    if missing:
        raise PlanError(f"plan {plan.model!r} does not place ops {abbreviate(missing)} of graph {graph.name!r}")
    deps: dict[int, set[int]] = {p.id: set() for p in plan.partitions}
    for part in plan.partitions:
        for t in graph.subgraph(part.ops).inputs:
            producer = graph.producers.get(t)
            if producer is not None and owner[producer] != part.id:
                deps[part.id].add(owner[producer])
    # Kahn's algorithm: a leftover means a cycle between partitions.
    indeg = {k: len(v) for k, v in deps.items()}
    ready = [k for k, n in indeg.items() if n == 0]
    seen = 0
    users = {k: [j for j, d in deps.items() if k in d] for k in deps}
    while ready:
        k = ready.pop()
        seen += 1
        for j in users[k]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    if seen != len(deps):
        raise PlanError("partitions depend on each other in a cycle: "
                        + ", ".join(str(k) for k, n in indeg.items() if n))
    return deps


def find_driver(inv: Inventory, part: Partition) -> Device:
    for d in inv.drivers():
        if d.plugin == part.target.plugin and d.id == part.target.device_id:
            return d
    have = ", ".join(f"{d.plugin}@{d.id}" for d in inv.drivers())
    raise PlanError(f"partition {part.id} targets {part.target.key}, which this inventory lacks (have {have})")


def _declared_dtype(graph: Graph, name: str) -> np.dtype | None:
    """The numpy dtype the graph declares for tensor ``name``; None when it has none (bfloat16, int4)."""
    spec = graph.tensors.get(name)
    if spec is None:
        return None
    try:
        return np.dtype(numpy_dtype(spec.dtype))
    except KeyError:
        return None


def _as_declared(graph: Graph, name: str, value: object) -> np.ndarray:
    """A host array in the dtype the graph declares for tensor ``name`` (copied only when needed)."""
    return _conform(value, _declared_dtype(graph, name))


def _conform(value: object, want: np.dtype | None) -> np.ndarray:
    if type(value) is np.ndarray and (want is None or value.dtype == want) and value.flags.c_contiguous:
        return value  # the common case, checked first: no call into numpy's conversion machinery
    arr = np.asarray(value)  # a numpy or Python scalar becomes a 0-d array
    if want is not None and arr.dtype != want:
        arr = arr.astype(want)
    # order="C", not np.ascontiguousarray: that one turns a 0-d array into shape (1,).
    return np.asarray(arr, order="C")


@dataclass
class CompiledPlan:
    """A plan with every partition compiled; :meth:`run` executes it."""

    graph: Graph
    plan: Plan
    executables: dict[int, Executable]
    devices: dict[int, Device]
    lock_by: Literal["device", "target"] = "device"
    compile_s: float = 0.0
    history: dict[int, deque[float]] = field(default_factory=dict)  # partition id -> ms per run
    runs: int = 0

    def __post_init__(self) -> None:
        self.deps = dependencies(self.graph, self.plan)
        self.parts = {p.id: p for p in self.plan.partitions}
        self._order = [p.id for p in self.plan.partitions]
        # Boundary tensor names, computed once: building a Subgraph per run costs more than a small partition.
        self._io = {p.id: (self.graph.subgraph(p.ops).inputs, self.graph.subgraph(p.ops).outputs)
                    for p in self.plan.partitions}
        keys = {self._lock_key(p) for p in self.plan.partitions}
        self._locks = {k: threading.Lock() for k in keys}
        self._stats = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(len(keys), 8)),
                                        thread_name_prefix=f"dspark-exec-{self.graph.name}")
        self.history = {p.id: deque(maxlen=HISTORY_LEN) for p in self.plan.partitions}
        boundary = {t for ins, outs in self._io.values() for t in (*ins, *outs)} | set(self.graph.inputs)
        self._dtype = {t: _declared_dtype(self.graph, t) for t in boundary}
        self._spans: dict[int, Span] = {}
        self._last: tuple[int, float, float, int] | None = None  # a lean run's span (thread ident), made lazily
        # A one-partition plan's run as one closure (callers on a hot path call it directly).
        self.lean_run: _LeanRun | None = _lean_path(self) if len(self._order) == 1 else None

    def _lock_key(self, part: Partition) -> str:
        return part.target.device_id if self.lock_by == "device" else part.target.key

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @property
    def last_spans(self) -> dict[int, Span]:
        """The latest run's spans, partition id -> :class:`Span` (with threads, another thread's run)."""
        last = self._last
        if last is not None:
            name = next((t.name for t in threading.enumerate() if t.ident == last[3]), f"thread {last[3]}")
            self._spans, self._last = {last[0]: Span(last[1], last[2], name)}, None
        return self._spans

    @property
    def last_timings(self) -> dict[int, float]:
        """The latest run's time per partition id, in ms."""
        return {k: s.ms for k, s in self.last_spans.items()}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph once on host arrays keyed by graph input names; return its outputs."""
        if (lean := self.lean_run) is not None:
            return lean(inputs)[0]
        return self.run_timed(inputs)[0]

    def run_timed(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[int, Span]]:
        """:meth:`run`, also returning this run's spans (``last_spans`` may already be another thread's)."""
        if (lean := self.lean_run) is not None:  # one partition: no scheduling, no pool
            out, start, end = lean(inputs)
            return out, {lean.pid: Span(start, end, threading.current_thread().name)}
        env = self._inputs(inputs)
        spans: dict[int, Span] = {}
        self._schedule(env, spans)
        with self._stats:
            self._spans, self._last = spans, None
            for k, s in spans.items():
                self.history[k].append(s.ms)
            self.runs += 1
            runs = self.runs
        if runs <= OBSERVE_ALL or runs % OBSERVE_EVERY == 0:
            self._observe(spans, env)
        return {name: env[name] for name in self.graph.outputs}, spans

    def _inputs(self, inputs: Mapping[str, object]) -> dict[str, np.ndarray]:
        try:
            return {n: _conform(inputs[n], self._dtype[n]) for n in self.graph.inputs}
        except KeyError:
            missing = [n for n in self.graph.inputs if n not in inputs]
            raise KeyError(f"missing graph inputs {missing}; {self.graph.name!r} takes {self.graph.inputs}") from None

    def _observe(self, spans: dict[int, Span], env: dict[str, np.ndarray]) -> None:
        from dspark.sdk.calibration import observe_run  # real run times correct the calibrations bids used

        observe_run(self, spans, env)

    def _schedule(self, env: dict[str, np.ndarray], spans: dict[int, Span]) -> None:
        """Run every partition in dependency order: chains in this thread, independent ones in the pool."""
        waiting = {k: set(v) for k, v in self.deps.items()}
        done: set[int] = set()
        in_flight: dict[Future[dict[str, np.ndarray]], int] = {}

        def ready() -> list[int]:
            return [k for k in self._order if k not in done and k not in in_flight.values() and not waiting[k]]

        def finish(pid: int, outputs: dict[str, np.ndarray]) -> None:
            env.update(outputs)
            done.add(pid)
            for deps in waiting.values():
                deps.discard(pid)

        while len(done) < len(self._order):
            now = ready()
            if len(now) == 1 and not in_flight:
                # A chain: run in the caller's thread, no hand-off latency.
                pid = now[0]
                finish(pid, self._run_one(pid, env, spans))
                continue
            for pid in now:
                in_flight[self._pool.submit(self._run_one, pid, dict(env), spans)] = pid
            if not in_flight:  # cannot happen for a validated DAG; guard against a silent hang
                raise PlanError("no partition is ready to run; the dependency graph is inconsistent")
            finished, _ = wait(list(in_flight), return_when=FIRST_COMPLETED)
            for fut in finished:
                pid = in_flight.pop(fut)
                try:
                    outputs = fut.result()
                except BaseException:
                    for other in in_flight:  # let the rest finish before reporting
                        other.exception()
                    raise
                finish(pid, outputs)

    def _run_one(self, pid: int, env: dict[str, np.ndarray], spans: dict[int, Span]) -> dict[str, np.ndarray]:
        part = self.parts[pid]
        sub_inputs, wanted = self._io[pid]
        feed = {t: env[t] for t in sub_inputs}
        with self._locks[self._lock_key(part)]:
            start = time.perf_counter()
            try:
                raw = self.executables[pid].run(feed)
            except Exception as exc:
                raise PartitionFailed(part, f"{type(exc).__name__}: {exc}") from exc
            end = time.perf_counter()
        spans[pid] = Span(start, end, threading.current_thread().name)
        return self._outputs(part, raw, wanted)

    def _outputs(self, part: Partition, raw: object, wanted: list[str]) -> dict[str, np.ndarray]:
        """A partition's outputs, checked and conformed to their declared dtypes."""
        if not isinstance(raw, dict):
            raise PartitionFailed(part, f"returned {type(raw).__name__}, not a dict of arrays")
        lost = [t for t in wanted if t not in raw]
        if lost:
            who = ", ".join(f"{t!r} (from op {self.graph.producers.get(t, '?')!r})" for t in lost)
            raise PartitionFailed(part, f"did not return {who}")
        try:
            return {t: _conform(raw[t], self._dtype[t]) for t in wanted}
        except (TypeError, ValueError) as exc:
            raise PartitionFailed(part, f"returned an output that is not an array: {exc}") from exc

    def measured_ms(self, reducer: Callable[[Iterable[float]], float] | None = None) -> dict[int, float]:
        """Per partition, the median (or ``reducer``) of its measured latencies so far."""
        reduce = reducer or (lambda xs: float(np.median(list(xs))))
        with self._stats:
            return {k: reduce(v) for k, v in self.history.items() if v}


class _LeanRun(Protocol):
    pid: int

    def __call__(self, inputs: Mapping[str, object]) -> tuple[dict[str, np.ndarray], float, float]: ...


def _lean_path(plan: CompiledPlan) -> _LeanRun:
    """A one-partition plan's run, as one closure over everything it reads: the fewest objects touched
    around the executable, since each costs cache misses after the runtime's compute (docs/benchmarks.md,
    "Per-run overhead"). Returns the outputs and the call's clock reads."""
    pid = plan._order[0]
    part = plan.parts[pid]
    lock = plan._locks[plan._lock_key(part)]
    sub_in, sub_out = plan._io[pid]
    ins = [(n, plan._dtype[n]) for n in plan.graph.inputs]
    outs = [(t, plan._dtype[t]) for t in sub_out]
    direct, same_out = list(sub_in) == list(plan.graph.inputs), list(sub_out) == list(plan.graph.outputs)
    executables, history, graph_outputs = plan.executables, plan.history[pid], plan.graph.outputs
    clock, ident, ndarray = time.perf_counter, threading.get_ident, np.ndarray

    def run(inputs: Mapping[str, object]) -> tuple[dict[str, np.ndarray], float, float]:
        feed: dict[str, np.ndarray] = {}
        try:
            for n, want in ins:
                v = inputs[n]
                feed[n] = v if type(v) is ndarray and v.dtype == want and v.flags.c_contiguous \
                    else _conform(v, want)
        except KeyError:
            plan._inputs(inputs)  # raises, naming what is missing
        with lock:
            start = clock()
            try:
                raw = executables[pid].run(feed if direct else {t: feed[t] for t in sub_in})
            except Exception as exc:
                raise PartitionFailed(part, f"{type(exc).__name__}: {exc}") from exc
            end = clock()
        out: dict[str, np.ndarray] = {}
        try:
            for t, want in outs:
                v = raw[t]
                out[t] = v if type(v) is ndarray and v.dtype == want and v.flags.c_contiguous \
                    else _conform(v, want)
        except Exception:  # noqa: BLE001 (said precisely by the checks in _outputs)
            out = plan._outputs(part, raw, sub_out)
        plan._last = (pid, start, end, ident())
        history.append((end - start) * 1e3)
        runs = plan.runs = plan.runs + 1  # under the GIL; a count lost between threads only shifts sampling
        if runs <= OBSERVE_ALL or runs % OBSERVE_EVERY == 0:
            plan._observe({pid: Span(start, end, threading.current_thread().name)}, feed)
        if not same_out:
            every = {**feed, **out}
            out = {name: every[name] for name in graph_outputs}
        return out, start, end

    lean = cast(_LeanRun, run)
    lean.pid = pid
    return lean


# A Constant's value lives in one of these attributes, as the dtype ONNX gives it.
_CONSTANT_ATTRS = {"value": None, "value_float": np.float32, "value_floats": np.float32,
                   "value_int": np.int64, "value_ints": np.int64}


@dataclass(frozen=True)
class ConstantValues:
    """A partition made only of ``Constant`` ops, answered by the core: its values, copied per run.

    Such a partition has no work for a runtime, and a runtime given a graph with
    no inputs may refuse it (ONNX Runtime does), so no plugin is ever handed one.
    """

    values: dict[str, np.ndarray]

    @classmethod
    def of(cls, graph: Graph, ops: Iterable[str]) -> ConstantValues | None:
        """The values of ``ops`` when every one is a ``Constant`` with a value the core can read; else None."""
        values: dict[str, np.ndarray] = {}
        for name in ops:
            op = graph.op(name)
            if op.op_type != "Constant" or op.domain not in ("", "ai.onnx") or op.inputs or len(op.outputs) != 1:
                return None
            key = next((k for k in _CONSTANT_ATTRS if k in op.attrs), None)
            if key is None:  # a sparse or string value: left to the plugins
                return None
            value = np.asarray(op.attrs[key], dtype=_CONSTANT_ATTRS[key])
            declared = _declared_dtype(graph, op.outputs[0])
            values[op.outputs[0]] = value.astype(declared, copy=False) if declared is not None else value
        return cls(values) if values else None

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.values.items()}  # the caller may write into its outputs


def compile_plan(graph: Graph, plan: Plan, host: PluginHost, inv: Inventory, *,
                 lock_by: Literal["device", "target"] = "device") -> CompiledPlan:
    """Compile each partition with the plugin that won it; see :class:`CompiledPlan`.

    A partition of only ``Constant`` ops is answered by the core (:class:`ConstantValues`).
    """
    dependencies(graph, plan)  # fail on a plan that does not fit before compiling anything
    t0 = time.perf_counter()
    exes: dict[int, Executable] = {}
    devices: dict[int, Device] = {}
    for part in plan.partitions:
        device = find_driver(inv, part)
        constants = ConstantValues.of(graph, part.ops)
        if constants is not None:
            exes[part.id], devices[part.id] = constants, device
            continue
        sub = graph.subgraph(part.ops)
        try:
            exes[part.id] = compile_on(host, device, sub)
        except Exception as exc:
            raise PartitionFailed(part, f"compile failed: {exc}") from exc
        devices[part.id] = device
    return CompiledPlan(graph=graph, plan=plan, executables=exes, devices=devices, lock_by=lock_by,
                        compile_s=time.perf_counter() - t0)


def reference_outputs(graph: Graph, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fp32 torch reference for the whole graph on the host (independent of any plugin host)."""
    from dspark.sdk.reference.executable import TorchExecutable

    feed = {n: _as_declared(graph, n, inputs[n]) for n in graph.inputs}
    out = TorchExecutable(graph.subgraph(), "cpu").run(feed)
    return {n: _as_declared(graph, n, out[n]) for n in graph.outputs}


def random_inputs(graph: Graph, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs of the declared shapes (symbolic dims from ``dim_hints``, else 1) and dtypes."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name in graph.inputs:
        spec = graph.tensors[name]
        shape = tuple(d if isinstance(d, int) else graph.dim_hints.get(d, 1) for d in spec.shape)
        if spec.dtype.startswith("float"):
            out[name] = rng.standard_normal(shape).astype(numpy_dtype(spec.dtype))
        elif spec.dtype == "bool":
            out[name] = rng.integers(0, 2, shape).astype(bool)
        else:  # ids/indices: small non-negative values are valid for most models
            out[name] = rng.integers(0, 8, shape).astype(numpy_dtype(spec.dtype))
    return out


def forced_plan(graph: Graph, inv: Inventory, target_of: Callable[[str], str]) -> Plan:
    """A plan with a given op -> ``plugin@device`` assignment (for tests and what-if runs; no predictions)."""
    from dspark.placement.partition import fuse
    from dspark.placement.plan import Target, graph_fingerprint, hardware_fingerprint

    by_key = {f"{d.plugin}@{d.id}": d for d in inv.drivers()}
    parts: list[Partition] = []
    groups = fuse(graph, target_of)
    for i, ops in enumerate(groups):
        key = target_of(ops[0])
        if key not in by_key:
            raise PlanError(f"op {ops[0]!r} assigned to {key!r}, which this inventory lacks (have {sorted(by_key)})")
        d = by_key[key]
        sub = graph.subgraph(ops)
        parts.append(Partition(id=i, target=Target(plugin=d.plugin, device_id=d.id, runtime=d.runtime), ops=ops,
                               inputs=sub.inputs, outputs=sub.outputs, predicted_ms=0.0))
    plan = Plan(model=graph.name, graph_fingerprint=graph_fingerprint(graph),
                hardware_fingerprint=hardware_fingerprint([Target(plugin=d.plugin, device_id=d.id, runtime=d.runtime)
                                                           for d in inv.drivers()]),
                partitions=parts, predicted_total_ms=0.0, solver="forced")
    deps = dependencies(graph, plan)
    for p in plan.partitions:
        p.depends_on = sorted(deps[p.id])
    return plan
