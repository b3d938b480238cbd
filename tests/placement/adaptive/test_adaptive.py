"""Adaptive execution: a backend that turns out slow loses its ops; shrinking memory forces a re-plan;
concurrent callers are all served, correctly, across a plan swap."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from dspark import TOLERANCES, hookimpl
from dspark.placement.adaptive import LEARN_ALL, LEARN_EVERY, AdaptiveRunner
from dspark.placement.placer import plan_memory_needs
from dspark.cli.demo import demo_graph
from dspark.placement.executor import random_inputs, reference_outputs
from dspark.graph.model import Graph, Subgraph
from dspark.host.inventory import Inventory, probe
from dspark.placement.placer import MEMORY_HEADROOM
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.types import Bid, Device

import dspark_plugins_cpu as openvino

RTOL, ATOL = TOLERANCES["float32"]
EXTRA_S = 0.02
# The slowed target's sleep where a test checks how well the learned correction predicts its next runs: a
# stall of the busy machine (a run 50 ms late beside a 20 ms sleep) is a small part of it.
EXTRA_S_PREDICTED = 0.2


class Sleepy:
    def __init__(self, exe: Any, extra_s: float) -> None:
        self.exe, self.extra_s = exe, extra_s

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(self.extra_s)
        out: dict[str, np.ndarray] = self.exe.run(inputs)
        return out


class SlowOpenVINO:
    """The real OpenVINO plugin, except that every compiled call sleeps ``extra_s`` more.

    Its bids are OpenVINO's own, scaled down so that the first plan surely
    lands here whatever the other runtimes' calibrated bids say.
    """

    DSPARK_API_VERSION = "1.0"

    def __init__(self, extra_s: float = EXTRA_S) -> None:
        self.extra_s = extra_s

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> Any:
        # A runtime name of its own per instance: what one test's slowed runs teach the calibration
        # cache (real run times replace calibrations) stays with that test's plugin.
        return [d.model_copy(update={"runtime": f"{d.runtime} {type(self).__name__}#{id(self)}"})
                if isinstance(d, Device) else d for d in openvino.dspark_probe_devices(refresh)]

    @hookimpl
    def dspark_bid(self, subgraph: Subgraph, device: Device) -> Bid | None:
        bid = openvino.dspark_bid(subgraph, device)
        if bid is None:
            return None
        return bid.model_copy(update={"latency_s": bid.latency_s / 20, "fixed_overhead_s": bid.fixed_overhead_s / 20})

    @hookimpl
    def dspark_compile(self, subgraph: Subgraph, device: Device) -> Sleepy | None:
        exe = openvino.dspark_compile(subgraph, device)
        return None if exe is None else Sleepy(exe, self.extra_s)


class FakeNPU:
    """A host-emulated ``npu:0`` that bids very low and runs with ONNX Runtime."""

    DSPARK_API_VERSION = "1.0"

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [Device(id="npu:0", kind="npu", name="fake npu", runtime="fake/npu", memory_total_bytes=1 << 30,
                       memory_free_bytes=1 << 30, peak_flops={"float32": 1e13}, host_link_bandwidth_bytes_per_s=1e11)]

    @hookimpl
    def dspark_bid(self, subgraph: Subgraph, device: Device) -> Bid:
        return Bid(device_id=device.id, runtime=device.runtime, latency_s=1e-7 * len(subgraph.ops),
                   peak_memory_bytes=subgraph.param_bytes, precision="float32")

    @hookimpl
    def dspark_compile(self, subgraph: Subgraph, device: Device) -> Any:
        import onnxruntime as ort

        sess = ort.InferenceSession(subgraph.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
        names = list(subgraph.outputs)

        class Exe:
            def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
                return dict(zip(names, sess.run(names, inputs), strict=True))

        return Exe()


def slow_host(extra_s: float = EXTRA_S) -> tuple[PluginHost, Inventory]:
    # Only the slowed OpenVINO and the real ONNX Runtime CPU EP ("npu" plugin) compete.
    host = PluginHost(PluginSettings(blocked={"cpu", "cuda", "torch", "ngram", "llamacpp"}))
    host.register(SlowOpenVINO(extra_s), "slow-ov")  # before probing
    host.load()
    inv = probe(host)
    if {f"{d.plugin}@{d.id}" for d in inv.drivers()} != {"slow-ov@cpu", "npu@cpu"}:
        pytest.skip(f"OpenVINO or ONNX Runtime missing: {[p.model_dump() for p in inv.plugins]}")
    return host, inv


@pytest.fixture(scope="module")
def demo() -> tuple[Graph, dict[str, np.ndarray], np.ndarray]:
    graph = demo_graph()
    x = random_inputs(graph, seed=2)
    return graph, x, reference_outputs(graph, x)["y"]


def targets(runner: AdaptiveRunner) -> set[str]:
    return {p.target.key for p in runner.plan.partitions}


def test_slow_backend_loses_its_ops(demo: tuple[Graph, dict[str, np.ndarray], np.ndarray]) -> None:
    graph, x, ref = demo
    host, inv = slow_host(EXTRA_S_PREDICTED)
    runner = AdaptiveRunner(graph, host, inv, threshold=0.1, min_runs=3)
    assert "slow-ov@cpu" in targets(runner), runner.plan.gate
    for _ in range(8):
        np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)
        runner.settle()  # re-plans run in the background: let each finish, as a slower caller would
    assert "slow-ov@cpu" not in targets(runner), runner.replans
    assert runner.replans and runner.replans[0].startswith("measured: npu@cpu"), runner.replans
    # The correction learnt that slow-ov is far slower than it bid.
    assert min(v for (p, _, _), v in runner.corrections().items() if p == "slow-ov") > 5
    err = runner.prediction_error("slow-ov@cpu")
    assert err["uncorrected"] is not None and err["uncorrected"] > 0.9  # it bid far too low
    assert err["corrected"] is not None and err["corrected"] < 0.5
    versions = [r.plan_version for r in runner.history]
    assert versions[0] == 0 and versions[-1] >= 1


def test_concurrent_callers_are_all_served_across_a_swap(
        demo: tuple[Graph, dict[str, np.ndarray], np.ndarray]) -> None:
    """Four callers keep running while the runner finds the slowed target out and swaps plans beside
    them: every call is served, right, and recorded. When the swap comes depends on what the runs
    measure, so the callers run until it has come (or a deadline passes), not for a fixed count."""
    graph, x, ref = demo
    host, inv = slow_host()
    runner = AdaptiveRunner(graph, host, inv, min_runs=2)
    assert "slow-ov@cpu" in targets(runner), runner.plan.gate
    results: list[np.ndarray] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()

    def caller() -> None:
        try:
            while not stop.is_set():
                y = runner.run(x)["y"]
                with lock:
                    results.append(y)
        except BaseException as exc:  # reported below, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while not errors and time.monotonic() < deadline:
        with lock:  # enough runs on the new plan that callers were served across the swap
            swapped = sum(r.plan_version >= 1 for r in list(runner.history)) >= 4
        if swapped:
            break
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    assert len(results) >= len(runner.history) >= 8  # every run served; the learned ones recorded
    for y in results:
        np.testing.assert_allclose(y, ref, rtol=RTOL, atol=ATOL)
    runner.settle()
    assert runner.replans and "slow-ov@cpu" not in targets(runner), runner.replans
    np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)
    assert {r.plan_version for r in runner.history} >= {0, 1}


def test_learning_is_sampled_after_a_plans_first_runs(demo: tuple[Graph, dict[str, np.ndarray], np.ndarray]) -> None:
    """Every run of a plan's first LEARN_ALL teaches the cost model, then one in LEARN_EVERY; all are served."""
    graph, x, ref = demo
    host = PluginHost(PluginSettings(blocked={"cuda", "torch", "ngram", "npu", "llamacpp"})).load()  # OpenVINO alone
    inv = probe(host)
    runner = AdaptiveRunner(graph, host, inv, measure_close=False)
    if targets(runner) != {"cpu@cpu"}:
        pytest.skip(f"OpenVINO does not run the demo here: {runner.plan.gate}")
    n = LEARN_ALL + 2 * LEARN_EVERY
    for _ in range(n):
        np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)
    runner.settle()
    assert runner.replans == []
    assert [r.index for r in runner.history] == [*range(1, LEARN_ALL + 1), *range(LEARN_EVERY, n + 1, LEARN_EVERY)]
    assert runner.prediction_error()["samples"] == LEARN_ALL + 2
    assert runner.compiled.history[runner.plan.partitions[0].id][-1] > 0  # the plan still times every run


def test_memory_shrinking_below_the_plan_forces_a_replan(
        demo: tuple[Graph, dict[str, np.ndarray], np.ndarray]) -> None:
    graph, x, ref = demo
    host = PluginHost(PluginSettings(blocked={"cpu", "cuda", "torch", "ngram", "llamacpp"}))
    host.register(FakeNPU(), "fakenpu")
    host.load()
    inv = probe(host)
    free: dict[str, int | None] = {"npu:0": 1 << 30}
    runner = AdaptiveRunner(graph, host, inv, free_memory=lambda: dict(free), min_runs=1000, memory_every_s=0)
    assert targets(runner) == {"fakenpu@npu:0"}
    np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)
    assert runner.replans == []
    need = plan_memory_needs(graph, runner.plan)["npu:0"]
    free["npu:0"] = need // 4  # another process took the NPU's memory
    np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)  # served on the old plan
    runner.settle()
    assert len(runner.replans) == 1 and runner.replans[0].startswith("memory: npu:0 needs")
    assert plan_memory_needs(graph, runner.plan).get("npu:0", 0) <= free["npu:0"] * MEMORY_HEADROOM
    np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)


class Losable(Sleepy):
    """Runs until its plugin's device is lost, then raises."""

    def __init__(self, exe: Any, plugin: LosableOpenVINO) -> None:
        super().__init__(exe, 0.0)
        self.plugin = plugin

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.plugin.lost:
            raise RuntimeError("device lost")
        return super().run(inputs)


class LosableOpenVINO(SlowOpenVINO):
    lost = False

    @hookimpl
    def dspark_compile(self, subgraph: Subgraph, device: Device) -> Losable | None:
        exe = openvino.dspark_compile(subgraph, device)
        return None if exe is None else Losable(exe, self)


def test_a_partition_failing_on_the_lean_path_is_charged_and_the_run_is_served(
        demo: tuple[Graph, dict[str, np.ndarray], np.ndarray]) -> None:
    """Past the runs learned from, runs take the lean path; a failure there is recovered from as anywhere."""
    graph, x, ref = demo
    host = PluginHost(PluginSettings(blocked={"cpu", "cuda", "torch", "ngram", "llamacpp"}))
    plugin = LosableOpenVINO(0.0)
    host.register(plugin, "laterfail")
    host.load()
    runner = AdaptiveRunner(graph, host, probe(host), min_runs=10**9, measure_close=False)
    if targets(runner) != {"laterfail@cpu"}:
        pytest.skip(f"OpenVINO does not run the demo here: {runner.plan.gate}")
    for i in range(LEARN_ALL + 8):
        plugin.lost = i >= LEARN_ALL + 2  # a run not learned from (LEARN_EVERY > 8)
        np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)
    failed = [r for r in runner.replans if r.startswith("run of partition")]
    assert len(failed) == 1 and "laterfail@cpu" in failed[0] and "device lost" in failed[0], runner.replans
    assert "laterfail@cpu" not in targets(runner)
    assert [f.hook for f in host.records["laterfail"].faults] == ["run"]
    runner.close()


def test_a_replan_marks_the_runs_beside_it_as_no_evidence_for_calibration(
        demo: tuple[Graph, dict[str, np.ndarray], np.ndarray]) -> None:
    from dspark.sdk.calibration import observations

    graph, x, ref = demo
    host = PluginHost(PluginSettings(blocked={"cuda", "torch", "ngram", "npu", "llamacpp"})).load()
    runner = AdaptiveRunner(graph, host, probe(host), min_runs=10**9, measure_close=False)
    seen: list[int] = []
    real = runner._adapt

    def adapt(reason: str) -> bool:
        seen.append(observations._beside)  # what a run reported from another thread meanwhile would meet
        return real(reason)

    runner._adapt = adapt  # type: ignore[method-assign]
    runner.adapt()
    assert seen == [1] and observations._beside == 0
    np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)
    runner.close()


@pytest.mark.parametrize("bad,stage", [("CompileFailsOnSoftmax", "compile"), ("RaisesAtRun", "run")])
def test_a_failing_partition_is_planned_around_and_the_runner_goes_on(
        demo: tuple[Graph, dict[str, np.ndarray], np.ndarray], bad: str, stage: str) -> None:
    import bad_plugins

    graph, x, ref = demo
    host = PluginHost(PluginSettings(autoload=False, blocked={"ngram", "drafters"})).load()
    host.register(getattr(bad_plugins, bad)(), "bad")
    runner = AdaptiveRunner(graph, host, probe(host), min_runs=3, warmup=stage == "compile")
    for _ in range(3):
        np.testing.assert_allclose(runner.run(x)["y"], ref, rtol=RTOL, atol=ATOL)
    runner.settle()
    failed = [r for r in runner.replans if r.startswith(f"{stage} of partition")]
    assert failed and "bad@cpu" in failed[0], runner.replans
    assert "bad@cpu" not in targets(runner)
    assert host.records["bad"].status.value == "active"
    assert any(f.hook == ("run" if stage == "run" else "dspark_compile") for f in host.records["bad"].faults)
