"""Calibrating a bid: the runtime's call overhead and the subgraph's latency, measured once, cached.

A subgraph that cannot be calibrated (no valid inputs can be generated, the
compile or a run fails) is cached as such, so it costs nothing the next time
either, and the bid falls back to the roofline. An entry measured while the
host was busy is measured again by a later call that finds the host quiet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dspark.graph.model import Graph, Op, Subgraph, TensorSpec
from dspark.host.log import get_logger
from dspark.sdk.calibration import config, load, sampling, store
from dspark.sdk.calibration.cold import CacheFlusher
from dspark.sdk.calibration.inputs import CannotCalibrate, make_inputs
from dspark.sdk.cost import DEFAULT_OP_OVERHEAD_S, roofline
from dspark.types import Device, Executable

log = get_logger("dspark.sdk.calibration")

Compile = Callable[[Subgraph], Executable | None]
_CHAIN = 8  # ops in the chain the per-op dispatch cost is measured on


@dataclass(frozen=True)
class Overhead:
    """What a runtime costs per compiled call and per op, measured on trivial subgraphs.

    ``call_s``: one call of a compiled 1-op subgraph minus one op's dispatch,
    i.e. what entering a partition of this runtime costs however many ops it
    has. ``op_s``: the extra cost of each further (tiny) op, from a chain of
    eight such ops. ``trivial_s``: the raw median time of the 1-op subgraph.
    """

    call_s: float
    op_s: float
    trivial_s: float


@dataclass(frozen=True)
class Calibration:
    """A measured bid: median seconds of one run of the compiled subgraph, and the call overhead.

    ``observed``: the latency is the median of real runs that replaced a calibration they
    disagreed with (:func:`dspark.sdk.calibration.observe`)."""

    latency_s: float
    call_overhead_s: float
    samples: int
    source: Literal["calibrated"] = "calibrated"
    observed: bool = False
    # Set when the subgraph was too slow to time at its sizes: the roofline there times the ratio of a
    # run to the roofline at these sizes, the largest of the same subgraph timed (``samples`` is theirs).
    scaled_from: dict[str, int] | None = None


@dataclass(frozen=True)
class Estimate:
    """What a plugin puts in its Bid: ``latency_s``, ``fixed_overhead_s``, ``source``, ``note``."""

    latency_s: float
    fixed_overhead_s: float
    source: Literal["roofline", "calibrated"]
    note: str = ""


_rechecked: set[str] = set()  # entries this process already considered measuring again


def _stale(key: dict[str, Any], hit: dict[str, Any]) -> bool:
    """True for an entry measured on a busy host, not yet measured again too often, now that the
    host is quiet (checked once per entry and process)."""
    if not hit.get("busy") or int(hit.get("remeasures", 0)) >= config.REMEASURE_LIMIT:
        return False
    ident = repr(sorted(key.items()))
    if ident in _rechecked:
        return False
    _rechecked.add(ident)
    return not load.busy_now(config.BUSY_LOAD)


def _compile(compile: Compile, subgraph: Subgraph) -> Executable:
    exe = compile(subgraph)
    if exe is None:
        raise CannotCalibrate("the plugin's compile returned None")
    return exe


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
    key = {"what": "overhead", **store.device_key(device, runtime_key)}
    hit = store.load(key)
    if hit is not None and not _stale(key, hit):
        return Overhead(**{k: hit[k] for k in ("call_s", "op_s", "trivial_s")}) if "call_s" in hit else None
    try:
        one, chain = (_trivial_graph(n).subgraph() for n in (1, _CHAIN))
        feeds = {"x": np.ones((1, 16), np.float32)}
        exe_one, exe_chain = _compile(compile, one), _compile(compile, chain)
        m = sampling.measure([exe_one, exe_chain], feeds, budget_s, device.kind == "cpu")
    except Exception as exc:
        log.info("calibration.overhead_failed", device=device.id, runtime=runtime_key, error=str(exc)[:300])
        store.save(key, {"failed": str(exc)[:300]})
        return None
    t_one, t_chain = m.medians
    # A fusing runtime can make the chain as fast as one op, or noise make it faster.
    per_op = min(max((t_chain - t_one) / (_CHAIN - 1), 0.0), t_one / 2)
    result = Overhead(call_s=t_one - per_op, op_s=per_op, trivial_s=t_one)
    store.save(key, {**result.__dict__, **m.record(), "remeasures": _remeasures(hit)})
    return result


def _remeasures(hit: dict[str, Any] | None) -> int:
    return 0 if hit is None else int(hit.get("remeasures", 0)) + 1


def _time_cold(exe: Executable, feeds: dict[str, np.ndarray], baseline: Subgraph | None, compile: Compile,
               budget_s: float) -> tuple[float, sampling.Measurement]:
    """``exe`` timed with cold caches, less the baseline's cold-cache overhead; and the measurement."""
    flush = CacheFlusher()
    t0 = sampling.clock()
    flush()
    # A flush costs milliseconds: the budget is for timed runs, not for flushing.
    budget = budget_s + config.MIN_SAMPLES * (sampling.clock() - t0)
    if baseline is None:
        m = sampling.measure([exe], feeds, budget, True, flush)
        return m.medians[0], m
    base = _compile(compile, baseline)
    base_feeds = make_inputs(baseline)
    m = sampling.measure([exe, base], [feeds, base_feeds], 2 * budget, True, flush)
    warm = sampling.measure([base], base_feeds, budget_s / 4, True)
    return warm.medians[0] + max(0.0, m.medians[0] - m.medians[1]), m


def calibrate(subgraph: Subgraph, device: Device, *, runtime_key: str, compile: Compile,
              budget_s: float = config.DEFAULT_BUDGET_S, call_overhead_s: float | None = None,
              flush_caches: bool = False, cold_baseline: Subgraph | None = None) -> Calibration | None:
    """Time ``subgraph`` compiled by ``compile`` on ``device``; None when it cannot be (or is not) timed.

    :param runtime_key: the runtime's name and version (e.g. ``openvino/CPU 2026.4.1``);
        part of the cache key.
    :param compile: the plugin's own compile path, called as ``compile(subgraph)``
        (also on the trivial subgraphs the call overhead is measured on).
    :param budget_s: seconds of timed runs (one run when a run takes longer); outlier
        batches re-taken come on top.
    :param call_overhead_s: a call overhead the plugin already measured (its probe);
        when None it is measured with :func:`call_overhead`.
    :param flush_caches: time each run with cold CPU caches (:mod:`.cold`);
        ignored on devices other than the CPU.
    :param cold_baseline: with ``flush_caches``, a tiny subgraph of the same kind
        (:func:`linear_baseline`, quantized as ``subgraph`` is): timed in the same
        rounds, cold and warm, to take the runtime's own cold-cache cost out.

    None when calibration is off (``DSPARK_CALIBRATE=0``), the roofline
    predicts more than ``MAX_ROOFLINE_S``, valid inputs cannot be
    generated, or compiling or running fails; each outcome but the first two
    is cached like a result.
    """
    if not config.enabled():
        return None
    if call_overhead_s is None:
        overhead = call_overhead(device, runtime_key=runtime_key, compile=compile)
        call_overhead_s = overhead.call_s if overhead else 0.0
    cold = flush_caches and device.kind == "cpu"
    if not cold:
        cold_baseline = None
    key = store.cache_key(subgraph, device, runtime_key,
                          cold=("baseline-v1" if cold_baseline is not None else True) if cold else False)
    hit = store.load(key)
    if hit is not None and not _stale(key, hit):
        # An entry timed before shape families were kept gives its family a ratio too.
        if "latency_s" in hit and key["dims"] and store.first_sight(key):
            store.remember_ratio(key, dict(key["dims"]), roofline(subgraph, device), float(hit["latency_s"]))
        return _from_entry(subgraph, device, key, hit, call_overhead_s)
    predicted = roofline(subgraph, device)
    if predicted > config.MAX_ROOFLINE_S:  # too slow to time during planning: not cached, the roofline may change
        if hit is not None:
            return _from_entry(subgraph, device, key, hit, call_overhead_s)
        return _scaled(subgraph, device, key, predicted, call_overhead_s)
    try:
        feeds = make_inputs(subgraph)
        exe = _compile(compile, subgraph)
        latency, m = _time(exe, feeds, cold, cold_baseline, compile, budget_s, device)
        for _ in range(config.RETRIES):
            if latency <= max(config.SUSPECT_FACTOR * predicted, 1e-3):
                break
            sampling.pause(config.RETRY_PAUSE_S)
            again, m2 = _time(exe, feeds, cold, cold_baseline, compile, budget_s, device)
            if again < latency:
                latency, m = again, m2
    except Exception as exc:  # CannotCalibrate, or the runtime failed on it
        log.info("calibration.skipped", device=device.id, runtime=runtime_key,
                 ops=[op.op_type for op in subgraph.ops][:8], reason=str(exc)[:300])
        store.save(key, {"failed": f"{type(exc).__name__}: {str(exc)[:300]}"})
        return None
    if hit is not None and "latency_s" in hit and m.busy and float(hit["latency_s"]) < latency:
        latency = float(hit["latency_s"])  # measured busy again: the lower of two busy figures stands
    if m.busy:
        log.info("calibration.busy_host", device=device.id, runtime=runtime_key, load=round(m.load, 3),
                 ops=[op.op_type for op in subgraph.ops][:8])
    store.save(key, {"latency_s": latency, "source": "calibrated", **m.record(), "remeasures": _remeasures(hit)})
    store.remember(subgraph, device, key, latency)
    if key["dims"]:  # symbolic sizes: the same subgraph may come again at others
        store.remember_ratio(key, dict(key["dims"]), predicted, latency)
    return Calibration(latency_s=latency, call_overhead_s=call_overhead_s, samples=m.samples)


def _scaled(subgraph: Subgraph, device: Device, key: dict[str, Any], roofline_s: float,
            call_overhead_s: float) -> Calibration | None:
    """The same subgraph timed at smaller sizes, scaled to these by the roofline (a shape bucket's
    batch of 16 is priced from the batch of 1 that was timed); None when no size of it was timed."""
    fam = store.load(store.shape_family_key(key))
    if fam is None or "ratio" not in fam:
        return None
    latency = roofline_s * float(fam["ratio"])
    store.remember(subgraph, device, key, latency)  # real runs at these sizes may correct it (observations)
    return Calibration(latency_s=latency, call_overhead_s=call_overhead_s, samples=0,
                       scaled_from={str(k): int(v) for k, v in dict(fam.get("dims", {})).items()
                                    if key["dims"].get(k) != v})  # the sizes that differ


def _from_entry(subgraph: Subgraph, device: Device, key: dict[str, Any], hit: dict[str, Any],
                call_overhead_s: float) -> Calibration | None:
    if "latency_s" not in hit:
        return None
    store.remember(subgraph, device, key, float(hit["latency_s"]))
    return Calibration(latency_s=float(hit["latency_s"]), call_overhead_s=call_overhead_s,
                       samples=int(hit.get("samples", 1)), observed=hit.get("source") == "observed")


def _time(exe: Executable, feeds: dict[str, np.ndarray], cold: bool, baseline: Subgraph | None,
          compile: Compile, budget_s: float, device: Device) -> tuple[float, sampling.Measurement]:
    if cold:
        return _time_cold(exe, feeds, baseline, compile, budget_s)
    m = sampling.measure([exe], feeds, budget_s, device.kind == "cpu")
    return m.medians[0], m


def estimate(subgraph: Subgraph, device: Device, *, runtime_key: str, compile: Compile, dtype: str = "float32",
             op_overhead_s: float = DEFAULT_OP_OVERHEAD_S, call_overhead_s: float = 0.0,
             measure_overheads: bool = True, budget_s: float = config.DEFAULT_BUDGET_S,
             flush_caches: bool = False, cold_baseline: Subgraph | None = None) -> Estimate:
    """A plugin's bid figures for ``subgraph``: calibrated when possible, else the roofline.

    ``op_overhead_s`` and ``call_overhead_s`` are the plugin's own (probed or
    default) figures. With ``measure_overheads`` (and calibration on) they
    are replaced by the ones :func:`call_overhead` measures through
    ``compile``, when that works; a measured call overhead is then capped at
    the calibrated latency (both are measurements; the placer takes the
    median over a target's op bids). Without it, the plugin's figure stays
    the fixed overhead, also capped at a calibrated latency: the calibration
    timed the whole call, so it, not a probed figure, is what the bid promises.
    ``flush_caches`` and ``cold_baseline``: see :func:`calibrate` (the overheads are always timed warm).
    """
    if config.enabled() and measure_overheads:
        overhead = call_overhead(device, runtime_key=runtime_key, compile=compile)
        if overhead is not None:
            call_overhead_s, op_overhead_s = overhead.call_s, overhead.op_s
    cal = calibrate(subgraph, device, runtime_key=runtime_key, compile=compile, budget_s=budget_s,
                    call_overhead_s=call_overhead_s, flush_caches=flush_caches, cold_baseline=cold_baseline)
    if cal is not None:
        note = (f"median of {cal.samples} observed runs" if cal.observed
                else f"lowest batch median of {cal.samples} timed runs")
        if cal.scaled_from is not None:
            note = f"the roofline scaled by a run timed at sizes {cal.scaled_from} (too slow to time at these)"
        if flush_caches and device.kind == "cpu" and not cal.observed:
            note += ", cold caches" + (" less a baseline's" if cold_baseline is not None else "")
        # The calibration timed the whole call, overhead included: it is the promise, and a
        # probed overhead (perhaps taken on a busy host) only bounds its fixed part.
        return Estimate(latency_s=cal.latency_s, fixed_overhead_s=min(call_overhead_s, cal.latency_s),
                        source="calibrated", note=note)
    latency = roofline(subgraph, device, dtype, op_overhead_s=op_overhead_s, call_overhead_s=call_overhead_s)
    return Estimate(latency_s=latency, fixed_overhead_s=call_overhead_s, source="roofline")
