"""Calibrated bids: timing the real subgraph on the plugin's own runtime, cached on disk.

A roofline (:func:`dspark.sdk.cost.roofline`) knows peak compute and bandwidth,
not the runtime's dispatch cost, its kernels' efficiency at small shapes, or
what it fuses. A plugin refines its bid by compiling the subgraph with the
same code path as its ``dspark_compile``, running it on random inputs built
from the subgraph's tensor specs, and bidding the median time
(:func:`calibrate`). The runtime's per-call overhead, what the placer charges
once per partition, is measured the same way on a trivial subgraph
(:func:`call_overhead`).

Both are measured once per machine and cached with :mod:`dspark.host.cache`
(namespace ``calibration``), keyed by the subgraph's signature, the dim hints
it uses, the device (id and name), the runtime (name and version) and
:func:`dspark.host.hostinfo.fingerprint`. A subgraph that cannot be calibrated
(no valid inputs can be generated, the compile or a run fails) is cached as
such, so it costs nothing the next time either, and the bid falls back to the
roofline.

Cost bounds: subgraphs whose roofline estimate exceeds
:data:`MAX_ROOFLINE_S` are not timed; each calibration spends at most
``budget_s`` on timed runs (one run when a single run takes longer). CPU
timings hold :data:`dspark.host.hostinfo.cpu_benchmark_lock`.
``DSPARK_CALIBRATE=0`` turns calibration off: bids are the pure roofline with
the overheads the probe measured, for quick planning.

Cold caches (opt-in per call site, ``flush_caches=True``): a tight timing loop
keeps a small weight in L2/L3, which flatters the bigger (float) layout, while
in an LLM decode step every layer's weights come from DRAM. With the option,
each timed run on a CPU device follows a read of a buffer twice the size of the
largest cache (:class:`CacheFlusher`, from all usable cores), so the weights are
read from memory. A flush also evicts the runtime's own state (code, request
objects), which a real decode loop keeps hot: measured here, that costs
0.1-0.3 ms a call, as much as streaming a 1 MB weight. So a plugin passes a
``cold_baseline``, the same kind of executable on a tiny weight
(:func:`linear_baseline`, quantized like the subgraph): the bid is the
baseline's warm time plus what the subgraph costs cold beyond the baseline
cold, i.e. hot runtime, weights from DRAM. (Checked against timing a ring of
distinct weight copies, which needs no flush but one compile per copy.)
:func:`streams_weights` is the criterion plugins use, so that the float and
quantized variants of a linear are timed alike. Cold timings are cached under
their own key.

A plugin uses :func:`estimate`, which returns the latency, the fixed
overhead and the source to put in its :class:`~dspark.types.Bid`.
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from dspark.host import cache, hostinfo
from dspark.sdk.cost import DEFAULT_OP_OVERHEAD_S, roofline
from dspark.graph.model import Graph, Op, Subgraph, TensorSpec, numpy_dtype
from dspark.host.log import get_logger
from dspark.types import Device, Executable

log = get_logger("dspark.sdk.calibration")

NAMESPACE = "calibration"
VERSION = "calib-v1"  # bump when what is measured changes: old entries are then ignored
MAX_ROOFLINE_S = 0.5  # subgraphs predicted slower than this are not timed
DEFAULT_BUDGET_S = 0.2
# Timed runs stop once there are MIN_SAMPLES of them spread over at least MIN_WINDOW_S (a window
# shorter than a scheduler time slice would let one burst of contention decide the median), or
# at MAX_SAMPLES, or when the budget is spent.
MIN_SAMPLES = 20
MIN_WINDOW_S = 0.02
MAX_SAMPLES = 2000
# A median this many times over the roofline (and over 1 ms) is more likely a burst of contention
# (a multi-threaded kernel waiting for a descheduled worker) than the subgraph: it is timed again
# after a pause, up to RETRIES times, and the lowest median kept.
SUSPECT_FACTOR = 50.0
RETRIES = 2
RETRY_PAUSE_S = 0.1
MAX_INPUT_BYTES = 256 * 1024 * 1024  # random inputs bigger than this are not generated
# streams_weights(): weights smaller than this are timed warm: below it the runtime's own state,
# evicted by a flush but hot in a real step, weighs more than the weight traffic.
STREAMING_MIN_BYTES = 256 * 1024
STREAMING_MAX_ROWS = 16  # above it a linear is compute-bound here (weights reused by every row)
_WEIGHT_OPS = frozenset({"MatMul", "Gemm"})
_CHAIN = 8  # ops in the chain the per-op dispatch cost is measured on

Compile = Callable[[Subgraph], Executable | None]


def enabled() -> bool:
    """False when ``DSPARK_CALIBRATE`` is 0/false/no/off: bids are then the pure roofline."""
    return os.environ.get("DSPARK_CALIBRATE", "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class Overhead:
    """What a runtime costs per compiled call and per op, measured on trivial subgraphs.

    ``call_s``: one call of a compiled 1-op subgraph minus one op's dispatch,
    i.e. what entering a partition of this runtime costs however many ops it
    has. ``op_s``: the extra cost of each further (tiny) op, from a chain of
    :data:`_CHAIN` such ops. ``trivial_s``: the raw median time of the 1-op
    subgraph.
    """

    call_s: float
    op_s: float
    trivial_s: float


@dataclass(frozen=True)
class Calibration:
    """A measured bid: median seconds of one run of the compiled subgraph, and the call overhead."""

    latency_s: float
    call_overhead_s: float
    samples: int
    source: Literal["calibrated"] = "calibrated"


@dataclass(frozen=True)
class Estimate:
    """What a plugin puts in its Bid: ``latency_s``, ``fixed_overhead_s``, ``source``, ``note``."""

    latency_s: float
    fixed_overhead_s: float
    source: Literal["roofline", "calibrated"]
    note: str = ""


class CannotCalibrate(Exception):
    """No valid inputs can be generated for the subgraph (the message says why)."""


# -- cache keys -------------------------------------------------------------------------------


def _symbols(subgraph: Subgraph) -> set[str]:
    names = set(subgraph.inputs) | {t for op in subgraph.ops for t in op.inputs + op.outputs if t}
    return {d for t in names if (spec := subgraph.graph.tensors.get(t)) for d in spec.shape if isinstance(d, str)}


def _device_key(device: Device, runtime_key: str) -> dict[str, Any]:
    return {"v": VERSION, "device": device.id, "device_name": device.name, "runtime": runtime_key,
            "host": hostinfo.fingerprint()}


def cache_key(subgraph: Subgraph, device: Device, runtime_key: str, *, cold: bool | str = False) -> dict[str, Any]:
    """Everything a calibrated latency depends on (weight values are assumed not to matter).
    ``cold``: how caches were flushed (False: a warm loop)."""
    hints = subgraph.graph.dim_hints
    dims = {s: hints.get(s, 1) for s in sorted(_symbols(subgraph))}
    key = {"sig": subgraph.signature(), "dims": dims, **_device_key(device, runtime_key)}
    if cold:  # only then: warm keys stay what they were
        key["cold"] = cold
    return key


# -- cold caches ------------------------------------------------------------------------------


def streams_weights(subgraph: Subgraph) -> bool:
    """True for a weight-bound linear: every op a MatMul/Gemm reading a constant 2-D weight, of
    :data:`STREAMING_MIN_BYTES` at least in all (float size, so a quantized variant of the same
    ops answers the same), for at most :data:`STREAMING_MAX_ROWS` rows (the dim hints'). Such
    subgraphs are timed with cold caches by the plugins that opt in. With more rows the kernel is
    compute-bound and a warm loop times it as well (measured: within noise at 128 rows)."""
    ops = subgraph.ops
    graph = subgraph.graph
    inits = graph.initializers
    if not ops or any(op.op_type not in _WEIGHT_OPS or len(op.inputs) < 2 or op.inputs[1] not in inits
                      or inits[op.inputs[1]].ndim != 2 for op in ops):
        return False
    for op in ops:
        spec = graph.tensors.get(op.inputs[0])
        if spec is None:
            return False
        lead = spec.shape[1:] if op.op_type == "Gemm" and op.attrs.get("transA") else spec.shape[:-1]
        rows = int(np.prod([d if isinstance(d, int) else int(graph.dim_hints.get(d, 1)) for d in lead]))
        if rows > STREAMING_MAX_ROWS:
            return False
    return sum(int(inits[op.inputs[1]].nbytes) for op in ops) >= STREAMING_MIN_BYTES


def linear_baseline(subgraph: Subgraph,
                    quantize: Callable[[Subgraph], Subgraph | None] | None = None) -> Subgraph | None:
    """A tiny linear like ``subgraph`` (a one-op ``x @ W``), with the same rows, to pass as
    ``cold_baseline``; None for anything else. When ``subgraph`` is a quantized variant, the
    baseline goes through ``quantize`` (the plugin's own, with ``subgraph``'s spec) to match it."""
    from dspark.sdk.quant import linear_subgraph

    ops = subgraph.ops
    if len(ops) != 1 or ops[0].op_type != "MatMul" or ops[0].inputs[1] not in subgraph.graph.initializers \
            or subgraph.inputs != [ops[0].inputs[0]]:
        return None
    spec = subgraph.graph.tensors.get(ops[0].inputs[0])
    if spec is None or len(spec.shape) != 2:
        return None
    rows = spec.shape[0]
    hint = subgraph.graph.dim_hints.get(rows, 1) if isinstance(rows, str) else rows
    # 256 x 64: two groups of 128 (group-wise kernels run their grouped path), 64 KB as float32.
    w = (np.random.default_rng(0).standard_normal((256, 64)) / 16).astype(np.float32)
    base = linear_subgraph("cold_baseline", w, tokens=rows, representative_tokens=int(hint))
    return quantize(base) if quantize is not None and subgraph.quantized_by else base


@functools.lru_cache(maxsize=1)
def largest_cache_bytes() -> int:
    """The largest CPU cache (normally the L3), from sysfs; 32 MiB when it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 << 20)


class CacheFlusher:
    """Evicts the CPU caches by reading a buffer twice the largest cache, split across the usable
    cores (each core's private L2 must be evicted too: a multi-threaded kernel reads its share of
    the weights on every core). Reads, not writes: no dirty lines to write back during the timed
    run. Numpy releases the GIL while summing, so the threads run in parallel."""

    def __init__(self) -> None:
        total = min(max(2 * largest_cache_bytes(), 16 << 20), 512 << 20)
        cores = max(1, min(int(hostinfo.cpu_static()["usable_cores"] or 1), 16))
        self.buffer = np.ones(total // 8, dtype=np.int64)
        self._parts = np.array_split(self.buffer, cores)

    def __call__(self) -> None:
        if len(self._parts) == 1:
            np.add.reduce(self._parts[0])
            return
        threads = [threading.Thread(target=np.add.reduce, args=(part,)) for part in self._parts[1:]]
        for t in threads:
            t.start()
        np.add.reduce(self._parts[0])
        for t in threads:
            t.join()


# -- inputs -----------------------------------------------------------------------------------

# Where an integer input is plain data: any small positive values are valid there.
_INT_DATA_OPS = frozenset({
    "Abs", "Add", "And", "ArgMax", "ArgMin", "BitShift", "Cast", "Concat", "Div", "Equal", "Expand",
    "Flatten", "Greater", "GreaterOrEqual", "Identity", "Less", "LessOrEqual", "Max", "Mean", "Min",
    "Mod", "Mul", "Neg", "Not", "Or", "Pad", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
    "ReduceSum", "Reshape", "Shape", "Sign", "Size", "Slice", "Squeeze", "Sub", "Sum", "Tile",
    "Transpose", "Unsqueeze", "Where", "Xor",
})
# Of those, the ops whose integer inputs beyond the first are shapes, axes or pads.
_DATA_FIRST_ONLY = frozenset({"Expand", "Pad", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
                              "ReduceSum", "Reshape", "Slice", "Squeeze", "Tile", "Unsqueeze"})
_INDEX_OPS = {"Gather": 1, "GatherElements": 1}  # op type -> position of the index input


def _shape(spec: TensorSpec, hints: dict[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else int(hints.get(d, 1)) for d in spec.shape)


def _int_range(subgraph: Subgraph, name: str, hints: dict[str, int]) -> tuple[int, int]:
    """[low, high) valid for every use of integer input ``name``; CannotCalibrate otherwise."""
    low, bound = 0, None
    for op in subgraph.ops:
        for pos, t in enumerate(op.inputs):
            if t != name:
                continue
            if _INDEX_OPS.get(op.op_type) == pos:
                data = subgraph.graph.tensors.get(op.inputs[0])
                if data is None:
                    raise CannotCalibrate(f"{op.op_type} {op.name!r}: data shape unknown")
                shape = _shape(data, hints)
                axis = int(op.attrs.get("axis", 0))
                axis = axis + len(shape) if axis < 0 else axis
                if not 0 <= axis < len(shape):
                    raise CannotCalibrate(f"{op.op_type} {op.name!r}: axis {axis} out of range")
                bound = shape[axis] if bound is None else min(bound, shape[axis])
            elif op.op_type in _INT_DATA_OPS and (pos == 0 or op.op_type not in _DATA_FIRST_ONLY) \
                    and not (op.op_type == "Where" and pos == 0):
                low = 1  # no zeros: an integer Div or Mod by zero may trap
            else:
                raise CannotCalibrate(f"no valid values known for integer input {pos} of "
                                      f"{op.op_type} {op.name!r}")
    high = 8 if bound is None else bound
    if high <= low:
        raise CannotCalibrate(f"no valid integer values for {name!r} ([{low}, {high}))")
    return low, high


def make_inputs(subgraph: Subgraph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for ``subgraph`` from its TensorSpecs; symbolic dims from ``graph.dim_hints`` (default 1).

    Floats are drawn in [0.5, 1.5) (valid for Log, Sqrt, Div, Pow), bools at
    random, integers in a range valid for every use (Gather indices within the
    gathered axis). Raises :class:`CannotCalibrate` when no valid values are
    known (an integer input used as a shape, an unknown spec, bfloat16 ...).
    """
    rng = np.random.default_rng(seed)
    hints = subgraph.graph.dim_hints
    feeds: dict[str, np.ndarray] = {}
    total = 0
    for name in subgraph.inputs:
        spec = subgraph.graph.tensors.get(name)
        if spec is None:
            raise CannotCalibrate(f"no TensorSpec for input {name!r}")
        shape = _shape(spec, hints)
        total += int(np.prod(shape, dtype=np.int64)) * 8
        if total > MAX_INPUT_BYTES:
            raise CannotCalibrate(f"inputs larger than {MAX_INPUT_BYTES >> 20} MiB")
        try:
            dtype = np.dtype(numpy_dtype(spec.dtype))
        except KeyError:
            raise CannotCalibrate(f"no numpy dtype for {spec.dtype} input {name!r}") from None
        if dtype.kind == "f":
            feeds[name] = (rng.random(shape) + 0.5).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.random(shape) > 0.5
        else:
            low, high = _int_range(subgraph, name, hints)
            feeds[name] = rng.integers(low, high, size=shape).astype(dtype)
    return feeds


# -- timing -----------------------------------------------------------------------------------


def _time_runs(exes: list[Executable], feeds: dict[str, np.ndarray] | list[dict[str, np.ndarray]],
               budget_s: float, on_cpu: bool,
               flush: Callable[[], None] | None = None) -> tuple[list[float], int]:
    """(median seconds per executable, rounds) of ``run(feeds)`` after a warm-up, within ``budget_s``.

    Several executables are run in turn, round by round, so that they share
    whatever load the host is under while they are compared; ``feeds`` is
    one dict for all, or one per executable. ``flush`` (not timed) runs
    before each timed run.
    """
    runs = list(zip(exes, feeds if isinstance(feeds, list) else [feeds] * len(exes), strict=True))
    lock = hostinfo.cpu_benchmark_lock if on_cpu else None
    if lock is not None:
        lock.acquire()
    try:
        t0 = time.perf_counter()
        for exe, feed in runs:
            exe.run(feed)  # the first run allocates and primes caches
        first = time.perf_counter() - t0
        if first >= budget_s:
            return [first / len(exes)] * len(exes), 1  # one run is all the budget allows
        if first * 4 < budget_s:
            for exe, feed in runs:
                exe.run(feed)
        samples: list[list[float]] = [[] for _ in exes]
        start = time.perf_counter()
        deadline = start + budget_s - first
        rounds = 0
        while True:
            for (exe, feed), out in zip(runs, samples, strict=True):
                if flush is not None:
                    flush()
                t = time.perf_counter()
                exe.run(feed)
                out.append(time.perf_counter() - t)
            rounds += 1
            now = time.perf_counter()
            if now >= deadline or rounds >= MAX_SAMPLES or \
                    (rounds >= MIN_SAMPLES and now - start >= MIN_WINDOW_S * len(exes)):
                break
        return [statistics.median(x) for x in samples], rounds
    finally:
        if lock is not None:
            lock.release()


def _compile(compile: Compile, subgraph: Subgraph) -> Executable:
    exe = compile(subgraph)
    if exe is None:
        raise CannotCalibrate("the plugin's compile returned None")
    return exe


# -- call overhead ----------------------------------------------------------------------------


def _trivial_graph(n_ops: int) -> Graph:
    """``n_ops`` chained Relus on a (1, 16) float32 tensor: every runtime runs it."""
    names = ["x"] + [f"y{i}" for i in range(n_ops)]
    return Graph(
        name=f"dspark_trivial_{n_ops}",
        ops=[Op(name=f"relu{i}", op_type="Relu", inputs=[names[i]], outputs=[names[i + 1]], flops=16,
                bytes_read=64, bytes_written=64) for i in range(n_ops)],
        tensors={n: TensorSpec(name=n, dtype="float32", shape=(1, 16)) for n in names},
        inputs=["x"], outputs=[names[-1]],
    )


def call_overhead(device: Device, *, runtime_key: str, compile: Compile,
                  budget_s: float = 0.2) -> Overhead | None:
    """The runtime's per-call and per-op overhead on ``device`` (measured once, cached); None if it fails."""
    key = {"what": "overhead", **_device_key(device, runtime_key)}
    hit = cache.load(NAMESPACE, key)
    if hit is not None:
        return Overhead(**hit) if "call_s" in hit else None
    try:
        one, chain = (_trivial_graph(n).subgraph() for n in (1, _CHAIN))
        feeds = {"x": np.ones((1, 16), np.float32)}
        exe_one, exe_chain = _compile(compile, one), _compile(compile, chain)
        on_cpu = device.kind == "cpu"
        (t_one, t_chain), _ = _time_runs([exe_one, exe_chain], feeds, budget_s, on_cpu)
    except Exception as exc:
        log.info("calibration.overhead_failed", device=device.id, runtime=runtime_key, error=str(exc)[:300])
        cache.store(NAMESPACE, key, {"failed": str(exc)[:300]})
        return None
    # A fusing runtime can make the chain as fast as one op, or noise make it faster.
    per_op = min(max((t_chain - t_one) / (_CHAIN - 1), 0.0), t_one / 2)
    result = Overhead(call_s=t_one - per_op, op_s=per_op, trivial_s=t_one)
    cache.store(NAMESPACE, key, result.__dict__)
    return result


# -- calibration ------------------------------------------------------------------------------


def calibrate(subgraph: Subgraph, device: Device, *, runtime_key: str, compile: Compile,
              budget_s: float = DEFAULT_BUDGET_S, call_overhead_s: float | None = None,
              flush_caches: bool = False, cold_baseline: Subgraph | None = None) -> Calibration | None:
    """Time ``subgraph`` compiled by ``compile`` on ``device``; None when it cannot be (or is not) timed.

    :param runtime_key: the runtime's name and version (e.g. ``openvino/CPU 2026.4.1``);
        part of the cache key.
    :param compile: the plugin's own compile path, called as ``compile(subgraph)``
        (also on the trivial subgraphs the call overhead is measured on).
    :param budget_s: seconds of timed runs at most (one run when a run takes longer).
    :param call_overhead_s: a call overhead the plugin already measured (its probe);
        when None it is measured with :func:`call_overhead`.
    :param flush_caches: time each run with cold CPU caches (see the module notes);
        ignored on devices other than the CPU.
    :param cold_baseline: with ``flush_caches``, a tiny subgraph of the same kind
        (:func:`linear_baseline`, quantized as ``subgraph`` is): timed in the same
        rounds, cold and warm, to take the runtime's own cold-cache cost out.

    None when calibration is off (``DSPARK_CALIBRATE=0``), the roofline
    predicts more than :data:`MAX_ROOFLINE_S`, valid inputs cannot be
    generated, or compiling or running fails; each outcome but the first two
    is cached like a result.
    """
    if not enabled():
        return None
    if call_overhead_s is None:
        overhead = call_overhead(device, runtime_key=runtime_key, compile=compile)
        call_overhead_s = overhead.call_s if overhead else 0.0
    cold = flush_caches and device.kind == "cpu"
    if not cold:
        cold_baseline = None
    key = cache_key(subgraph, device, runtime_key,
                    cold=("baseline-v1" if cold_baseline is not None else True) if cold else False)
    hit = cache.load(NAMESPACE, key)
    if hit is not None:
        if "latency_s" not in hit:
            return None
        return Calibration(latency_s=float(hit["latency_s"]), call_overhead_s=call_overhead_s,
                           samples=int(hit["samples"]))
    predicted = roofline(subgraph, device)
    if predicted > MAX_ROOFLINE_S:
        return None  # too slow to time during planning: not cached, the roofline may change
    try:
        feeds = make_inputs(subgraph)
        exe = _compile(compile, subgraph)
        if cold:
            latency, samples = _time_cold(exe, feeds, cold_baseline, compile, budget_s)
        else:
            (latency,), samples = _time_runs([exe], feeds, budget_s, device.kind == "cpu")
        for _ in range(RETRIES):
            if latency <= max(SUSPECT_FACTOR * predicted, 1e-3):
                break
            time.sleep(RETRY_PAUSE_S)
            if cold:
                again, n = _time_cold(exe, feeds, cold_baseline, compile, budget_s)
            else:
                (again,), n = _time_runs([exe], feeds, budget_s, device.kind == "cpu")
            if again < latency:
                latency, samples = again, n
    except Exception as exc:  # CannotCalibrate, or the runtime failed on it
        log.info("calibration.skipped", device=device.id, runtime=runtime_key,
                 ops=[op.op_type for op in subgraph.ops][:8], reason=str(exc)[:300])
        cache.store(NAMESPACE, key, {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"})
        return None
    cache.store(NAMESPACE, key, {"latency_s": latency, "samples": samples})
    return Calibration(latency_s=latency, call_overhead_s=call_overhead_s, samples=samples)


def _time_cold(exe: Executable, feeds: dict[str, np.ndarray], baseline: Subgraph | None, compile: Compile,
               budget_s: float) -> tuple[float, int]:
    """(seconds, samples): ``exe`` timed with cold caches, less the baseline's cold-cache overhead."""
    flush = CacheFlusher()
    t0 = time.perf_counter()
    flush()
    # A flush costs milliseconds: the budget is for timed runs, not for flushing.
    budget = budget_s + MIN_SAMPLES * (time.perf_counter() - t0)
    if baseline is None:
        (latency,), samples = _time_runs([exe], feeds, budget, True, flush)
        return latency, samples
    base = _compile(compile, baseline)
    base_feeds = make_inputs(baseline)
    (latency, base_cold), samples = _time_runs([exe, base], [feeds, base_feeds], 2 * budget, True, flush)
    (base_warm,), _ = _time_runs([base], base_feeds, budget_s / 4, True)
    return base_warm + max(0.0, latency - base_cold), samples


def estimate(subgraph: Subgraph, device: Device, *, runtime_key: str, compile: Compile, dtype: str = "float32",
             op_overhead_s: float = DEFAULT_OP_OVERHEAD_S, call_overhead_s: float = 0.0,
             measure_overheads: bool = True, budget_s: float = DEFAULT_BUDGET_S,
             flush_caches: bool = False, cold_baseline: Subgraph | None = None) -> Estimate:
    """A plugin's bid figures for ``subgraph``: calibrated when possible, else the roofline.

    ``op_overhead_s`` and ``call_overhead_s`` are the plugin's own (probed or
    default) figures. With ``measure_overheads`` (and calibration on) they
    are replaced by the ones :func:`call_overhead` measures through
    ``compile``, when that works; a measured call overhead is then capped at
    the calibrated latency (both are measurements; the placer takes the
    median over a target's op bids). Without it, the plugin's figure stays
    the fixed overhead and is a floor of the latency. ``flush_caches`` and
    ``cold_baseline``: see :func:`calibrate` (the overheads are always timed warm).
    """
    measured = False
    if enabled() and measure_overheads:
        overhead = call_overhead(device, runtime_key=runtime_key, compile=compile)
        if overhead is not None:
            call_overhead_s, op_overhead_s, measured = overhead.call_s, overhead.op_s, True
    cal = calibrate(subgraph, device, runtime_key=runtime_key, compile=compile, budget_s=budget_s,
                    call_overhead_s=call_overhead_s, flush_caches=flush_caches, cold_baseline=cold_baseline)
    if cal is not None:
        note = f"median of {cal.samples} timed runs"
        if flush_caches and device.kind == "cpu":
            note += ", cold caches" + (" less a baseline's" if cold_baseline is not None else "")
        if measured:
            return Estimate(latency_s=cal.latency_s, fixed_overhead_s=min(call_overhead_s, cal.latency_s),
                            source="calibrated", note=note)
        return Estimate(latency_s=max(cal.latency_s, call_overhead_s), fixed_overhead_s=call_overhead_s,
                        source="calibrated", note=note)
    latency = roofline(subgraph, device, dtype, op_overhead_s=op_overhead_s, call_overhead_s=call_overhead_s)
    return Estimate(latency_s=latency, fixed_overhead_s=call_overhead_s, source="roofline")
