"""Calibration that cannot be poisoned: batches and the host's load, outliers re-taken, busy entries
measured again, and real run times replacing entries they disagree with.

Load spikes are scripted, not provoked: a fake clock (``sampling.clock``) that the scripted
executables advance, and a fake load window (``load.start_window``) that reports the host busy
while the clock is inside the spike. Nothing here asserts on real timings except orders of
magnitude far apart (a poisoned entry of seconds against a run of a tiny subgraph).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dspark.graph.model import Graph, Op, Subgraph, TensorSpec
from dspark.host import cache
from dspark.host.inventory import probe
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.placement.executor import compile_plan, forced_plan, random_inputs
from dspark.sdk import calibration
from dspark.sdk.calibration import estimates, load, observations, sampling, store
from dspark.types import Device

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "plugins" / "dspark-numpy" / "src"))
import dspark_numpy

FAST, SPIKE = 0.0031, 0.4198  # seconds: the subgraph, and the subgraph during the load spike


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Spike:
    """A load spike over [start, end) of the fake clock."""

    def __init__(self, clock: Clock, start: float, end: float) -> None:
        self.clock, self.start, self.end = clock, start, end

    def on(self, t: float) -> bool:
        return self.start <= t < self.end

    def window(self) -> Any:
        clock, spike, t0 = self.clock, self, self.clock.t

        class Window:
            def stop(self) -> float:
                overlaps = t0 < spike.end and clock.t > spike.start
                return 0.9 if overlaps else 0.05

        return Window()


class ScriptedExe:
    """An executable whose runs take FAST, or SPIKE while the spike is on, on the fake clock."""

    def __init__(self, clock: Clock, spike: Spike) -> None:
        self.clock, self.spike, self.runs = clock, spike, 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.runs += 1
        self.clock.t += SPIKE if self.spike.on(self.clock.t) else FAST
        return {}


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[Clock, Spike]]:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DSPARK_CALIBRATE", raising=False)
    clock = Clock()
    spike = Spike(clock, 0.0, 0.0)
    monkeypatch.setattr(sampling, "clock", clock)
    monkeypatch.setattr(sampling, "pause", lambda s: setattr(clock, "t", clock.t + s))
    monkeypatch.setattr(load, "start_window", spike.window)
    monkeypatch.setattr(load, "busy_now", lambda threshold: spike.on(clock.t))
    store.forget()
    observations.forget()
    estimates._rechecked.clear()
    yield clock, spike
    store.forget()
    observations.forget()


def _relu() -> Subgraph:
    return Graph(name="tiny", ops=[Op(name="r", op_type="Relu", inputs=["x"], outputs=["y"], flops=16)],
                 tensors={n: TensorSpec(name=n, dtype="float32", shape=(1, 16)) for n in ("x", "y")},
                 inputs=["x"], outputs=["y"]).subgraph()


def _device(plugin: str = "scripted") -> Device:
    return Device(id="cpu", kind="cpu", name="test cpu", runtime="scripted/cpu", plugin=plugin,
                  peak_flops={"float32": 1e11}, memory_bandwidth_bytes_per_s=1e10)


def test_outlier_batches_are_measured_again(scripted: tuple[Clock, Spike]) -> None:
    clock, spike = scripted
    spike.start, spike.end = 0.01, 0.6  # starts during the first batch, over before the third
    exe = ScriptedExe(clock, spike)
    m = sampling.measure([exe], {}, 0.2, on_cpu=False)
    assert m.medians[0] == pytest.approx(FAST)
    assert m.remeasured >= 1, [b.medians for b in m.batches]
    assert any(b.medians[0] == pytest.approx(SPIKE) for b in m.batches), "the spike was never sampled"
    assert all(b.medians[0] == pytest.approx(FAST) for b in m.kept) and len(m.kept) >= calibration.BATCHES
    assert not m.busy


def test_a_measurement_inside_a_spike_is_marked_busy(scripted: tuple[Clock, Spike]) -> None:
    clock, spike = scripted
    spike.start, spike.end = 0.0, 1e9
    m = sampling.measure([ScriptedExe(clock, spike)], {}, 0.2, on_cpu=False)
    assert m.busy and m.load > calibration.BUSY_LOAD
    assert m.medians[0] == pytest.approx(SPIKE)
    assert m.record()["busy"] is True


def _calibrate(clock: Clock, spike: Spike, compiles: list[int]) -> calibration.Calibration | None:
    def compile(sg: Subgraph) -> ScriptedExe:
        compiles.append(1)
        return ScriptedExe(clock, spike)

    return calibration.calibrate(_relu(), _device(), runtime_key="scripted 1", compile=compile,
                                 call_overhead_s=0.0)


def test_an_entry_measured_on_a_busy_host_is_measured_again_when_quiet(
        scripted: tuple[Clock, Spike], monkeypatch: pytest.MonkeyPatch) -> None:
    clock, spike = scripted
    monkeypatch.setattr(calibration, "SUSPECT_FACTOR", 1e12)  # only the load tells the spike here
    spike.start, spike.end = 0.0, 100.0
    compiles: list[int] = []
    poisoned = _calibrate(clock, spike, compiles)
    assert poisoned is not None and poisoned.latency_s == pytest.approx(SPIKE)
    key = calibration.cache_key(_relu(), _device(), "scripted 1")
    assert store.load(key)["busy"] is True
    # Still busy: the entry is used as it is, and not checked again by this process.
    assert _calibrate(clock, spike, compiles).latency_s == pytest.approx(SPIKE) and len(compiles) == 1
    # A later process, on a quiet host, measures it again.
    estimates._rechecked.clear()
    clock.t = 200.0
    again = _calibrate(clock, spike, compiles)
    assert len(compiles) == 2 and again is not None and again.latency_s == pytest.approx(FAST)
    entry = store.load(key)
    assert entry["busy"] is False and entry["remeasures"] == 1 and entry["latency_s"] == pytest.approx(FAST)
    # A quiet entry is never measured again.
    estimates._rechecked.clear()
    assert _calibrate(clock, spike, compiles).latency_s == pytest.approx(FAST) and len(compiles) == 2


@pytest.mark.filterwarnings("ignore:dspark.calibration is deprecated:DeprecationWarning")
def test_the_knobs_set_on_the_package_reach_every_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "OBSERVE_MIN", 3)
    assert calibration.config.OBSERVE_MIN == 3
    import dspark.calibration as api13  # the plugin API 1.3 name (deprecated) reads and sets the same knobs

    assert api13.OBSERVE_MIN == 3
    monkeypatch.setattr(api13, "OBSERVE_MIN", 4)
    assert calibration.config.OBSERVE_MIN == 4


def test_observed_runs_replace_a_poisoned_entry(scripted: tuple[Clock, Spike],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    clock, spike = scripted
    monkeypatch.setattr(calibration, "SUSPECT_FACTOR", 1e12)
    spike.start, spike.end = 0.0, 100.0
    compiles: list[int] = []
    assert _calibrate(clock, spike, compiles).latency_s == pytest.approx(SPIKE)
    sg, device = _relu(), _device()
    verdicts = [calibration.observe(sg, device, FAST) for _ in range(calibration.OBSERVE_MIN)]
    assert verdicts[:-1] == ["pending"] * (calibration.OBSERVE_MIN - 1) and verdicts[-1] == "replaced"
    entry = store.load(calibration.cache_key(sg, device, "scripted 1"))
    assert entry["source"] == "observed" and entry["latency_s"] == pytest.approx(FAST)
    assert entry["replaced_s"] == pytest.approx(SPIKE)
    # The next bid uses it without timing anything.
    cal = _calibrate(clock, spike, compiles)
    assert cal.latency_s == pytest.approx(FAST) and cal.observed and len(compiles) == 1
    # Runs that agree keep it.
    assert [calibration.observe(sg, device, FAST * 1.2) for _ in range(calibration.OBSERVE_MIN)][-1] == "kept"
    # Runs at other shapes than the calibration's are not compared.
    assert calibration.observe(sg, device, 1.0, inputs={"x": np.ones((4, 16), np.float32)}) == "uncalibrated"


def test_slow_runs_on_a_busy_host_do_not_replace_an_entry(scripted: tuple[Clock, Spike]) -> None:
    clock, spike = scripted
    compiles: list[int] = []
    assert _calibrate(clock, spike, compiles).latency_s == pytest.approx(FAST)
    sg, device = _relu(), _device()
    spike.start, spike.end = clock.t, clock.t + 100.0  # busy now
    assert [calibration.observe(sg, device, SPIKE) for _ in range(calibration.OBSERVE_MIN)][-1] == "kept"
    clock.t += 200.0  # quiet: the same slow runs are believed
    assert [calibration.observe(sg, device, SPIKE) for _ in range(calibration.OBSERVE_MIN)][-1] == "replaced"
    assert store.load(calibration.cache_key(sg, device, "scripted 1"))["latency_s"] == pytest.approx(SPIKE)


def test_runs_reported_while_the_process_plans_beside_them_are_not_recorded(scripted: tuple[Clock, Spike]) -> None:
    """A background re-plan's bids and compiles share the cores: its neighbours' slow runs must not replace an
    entry once the host looks quiet again."""
    from dspark.sdk.calibration.observations import planning_beside

    clock, spike = scripted
    compiles: list[int] = []
    assert _calibrate(clock, spike, compiles).latency_s == pytest.approx(FAST)
    sg, device = _relu(), _device()
    with planning_beside():
        assert {calibration.observe(sg, device, SPIKE) for _ in range(2 * calibration.OBSERVE_MIN)} == {"pending"}
    # Nothing was recorded: the window starts afresh, and quiet runs that agree keep the entry.
    verdicts = [calibration.observe(sg, device, FAST) for _ in range(calibration.OBSERVE_MIN)]
    assert verdicts == ["pending"] * (calibration.OBSERVE_MIN - 1) + ["kept"]
    assert store.load(calibration.cache_key(sg, device, "scripted 1"))["latency_s"] == pytest.approx(FAST)


def test_subgraphs_nobody_calibrated_are_not_judged(scripted: tuple[Clock, Spike]) -> None:
    verdicts = {calibration.observe(_relu(), _device("other"), FAST) for _ in range(2 * calibration.OBSERVE_MIN)}
    assert verdicts == {"pending", "uncalibrated"}


# -- the executor reports its runs (real plugin, real executor) ------------------------------------------------


def _chain() -> Graph:
    w = (np.random.default_rng(0).standard_normal((64, 64)) / 8).astype(np.float32)
    return Graph(
        name="mm_relu",
        ops=[Op(name="mm", op_type="MatMul", inputs=["x", "w"], outputs=["h"], flops=2.0 * 8 * 64 * 64),
             Op(name="act", op_type="Relu", inputs=["h"], outputs=["y"], flops=8 * 64)],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=(8, 64)),
                 "w": TensorSpec(name="w", dtype="float32", shape=(64, 64)),
                 "h": TensorSpec(name="h", dtype="float32", shape=(8, 64)),
                 "y": TensorSpec(name="y", dtype="float32", shape=(8, 64))},
        inputs=["x"], outputs=["y"], initializers={"w": w},
    )


def _entry_of(sg: Subgraph) -> tuple[dict[str, Any], dict[str, Any]]:
    found = [(e.key, e.value) for e in cache.entries(calibration.NAMESPACE)
             if isinstance(e.key, dict) and e.key.get("sig") == sg.signature()]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture
def numpy_host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[PluginHost, Device]]:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DSPARK_CALIBRATE", raising=False)
    store.forget()
    observations.forget()
    host = PluginHost(PluginSettings(autoload=False))
    host.register(dspark_numpy, "numpy")
    inv = probe(host)
    yield host, inv
    store.forget()
    observations.forget()


@pytest.mark.parametrize("whole", [True, False], ids=["partition-entry", "op-entries"])
def test_executor_runs_correct_poisoned_calibrations(numpy_host: Any, whole: bool) -> None:
    host, inv = numpy_host
    device = next(d for d in inv.drivers() if d.plugin == "numpy")
    graph = _chain()
    subs = [graph.subgraph()] if whole else [graph.subgraph([op.name]) for op in graph.ops]
    for sg in subs:  # what planning does: bid, which calibrates
        assert dspark_numpy.dspark_bid(sg, device).source == "calibrated"
    poison = 10.0
    for sg in subs:  # a load spike's figure, as if measured so
        key, value = _entry_of(sg)
        store.save(key, {**value, "latency_s": poison, "busy": False})
    store.forget()
    for sg in subs:
        assert dspark_numpy.dspark_bid(sg, device).latency_s == poison
    compiled = compile_plan(graph, forced_plan(graph, inv, lambda op: "numpy@cpu"), host, inv)
    assert len(compiled.plan.partitions) == 1
    x = random_inputs(graph)
    for _ in range(calibration.OBSERVE_MIN):
        compiled.run(x)
    compiled.close()
    if whole:
        _, value = _entry_of(graph.subgraph())
        assert value["source"] == "observed" and value["latency_s"] < poison / 10, value
        assert dspark_numpy.dspark_bid(graph.subgraph(), device).latency_s < poison / 10
    else:
        for sg in subs:  # dropped: the next plan measures them again
            assert not [e for e in cache.entries(calibration.NAMESPACE) if e.key.get("sig") == sg.signature()]
            assert dspark_numpy.dspark_bid(sg, device).latency_s < poison / 10
