"""The heterogeneous executor: forced splits across runtimes match the fp32 torch reference,
independent partitions on different devices overlap, failures name partition, plugin and op."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import onnx
import pytest
from dspark import TOLERANCES, hookimpl
from dspark.cli.demo import demo_graph
from dspark.placement.executor import (
    PartitionFailed,
    PlanError,
    compile_plan,
    dependencies,
    forced_plan,
    random_inputs,
    reference_outputs,
)
from dspark.graph.model import Graph, Subgraph
from dspark.host.inventory import Inventory, probe
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.types import Bid, Device
from onnx import TensorProto, helper, numpy_helper

RUNTIMES = ["cpu@cpu", "npu@cpu", "torch@cpu"]  # OpenVINO, ONNX Runtime CPU EP, torch
RTOL, ATOL = TOLERANCES["float32"]


class OrtExe:
    """Runs a subgraph with ONNX Runtime on the host; optionally sleeps, fails, waits at a barrier for
    another call, or returns float64."""

    def __init__(self, sub: Subgraph, sleep_s: float = 0.0, fail: bool = False,
                 meet: threading.Barrier | None = None) -> None:
        import onnxruntime as ort

        self.sess = ort.InferenceSession(sub.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
        self.outputs, self.sleep_s, self.fail, self.meet = list(sub.outputs), sleep_s, fail, meet

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.fail:
            raise RuntimeError("kernel exploded")
        if self.meet is not None:
            self.meet.wait()  # raises BrokenBarrierError at its timeout if the other call never comes
        time.sleep(self.sleep_s)
        values = self.sess.run(self.outputs, inputs)
        return {n: v.astype(np.float64) for n, v in zip(self.outputs, values, strict=True)}


class FakeAccel:
    """Three host-emulated accelerators (``npu:0``, ``gpu:0``, ``other:0``) whose calls take ``sleep_s``;
    calls on the devices in ``meet_on`` wait at the barrier ``meet``."""

    DSPARK_API_VERSION = "1.0"

    def __init__(self, sleep_s: float = 0.0, fail: bool = False, meet: threading.Barrier | None = None,
                 meet_on: tuple[str, ...] = ()) -> None:
        self.sleep_s, self.fail, self.meet, self.meet_on = sleep_s, fail, meet, meet_on

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [Device(id=i, kind=k, name=f"fake {k}", runtime=f"fake/{k}", memory_free_bytes=1 << 30,
                       peak_flops={"float32": 1e12}, host_link_bandwidth_bytes_per_s=1e10)
                for i, k in (("npu:0", "npu"), ("gpu:0", "gpu"), ("other:0", "other"))]

    @hookimpl
    def dspark_bid(self, subgraph: Subgraph, device: Device) -> Bid:
        return Bid(device_id=device.id, runtime=device.runtime, latency_s=self.sleep_s, peak_memory_bytes=0,
                   precision="float32")

    @hookimpl
    def dspark_compile(self, subgraph: Subgraph, device: Device) -> OrtExe:
        return OrtExe(subgraph, self.sleep_s, self.fail, self.meet if device.id in self.meet_on else None)


def branchy_graph(seq: int = 16, dim: int = 32) -> Graph:
    """Two independent branches joined at the end: x -> (MatMul, Relu) and (MatMul, Sigmoid) -> Add."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((dim, dim)).astype(np.float32) / 6, n) for n in ("wa", "wb")]
    n = helper.make_node
    nodes = [n("MatMul", ["x", "wa"], ["a1"], name="a_mm"), n("Relu", ["a1"], ["a2"], name="a_act"),
             n("MatMul", ["x", "wb"], ["b1"], name="b_mm"), n("Sigmoid", ["b1"], ["b2"], name="b_act"),
             n("Add", ["a2", "b2"], ["y"], name="join")]
    g = helper.make_graph(nodes, "branchy", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, dim])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, dim])], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return Graph.from_onnx(model, name="branchy")


@pytest.fixture(scope="module")
def real() -> tuple[PluginHost, Inventory]:
    host = PluginHost(PluginSettings(blocked={"cuda", "ngram"})).load()
    inv = probe(host)
    have = {f"{d.plugin}@{d.id}" for d in inv.drivers()}
    missing = set(RUNTIMES) - have
    if missing:
        pytest.skip(f"runtimes not available here: {sorted(missing)}")
    return host, inv


def fake(sleep_s: float = 0.0, fail: bool = False, meet: threading.Barrier | None = None,
         meet_on: tuple[str, ...] = ()) -> tuple[PluginHost, Inventory]:
    host = PluginHost(PluginSettings(autoload=False))
    host.register(FakeAccel(sleep_s, fail, meet, meet_on), "fake")
    return host, probe(host)


def check(graph: Graph, outputs: dict[str, np.ndarray], x: dict[str, np.ndarray]) -> None:
    ref = reference_outputs(graph, x)
    for name in graph.outputs:
        assert outputs[name].dtype == ref[name].dtype
        np.testing.assert_allclose(outputs[name], ref[name], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("target", RUNTIMES)
def test_whole_demo_on_each_runtime(real: tuple[PluginHost, Inventory], target: str) -> None:
    host, inv = real
    graph = demo_graph()
    compiled = compile_plan(graph, forced_plan(graph, inv, lambda op: target), host, inv)
    x = random_inputs(graph)
    check(graph, compiled.run(x), x)
    assert list(compiled.last_timings) == [0] and compiled.last_timings[0] > 0


def test_round_robin_split_over_three_runtimes(real: tuple[PluginHost, Inventory]) -> None:
    host, inv = real
    graph = demo_graph()
    index = {op.name: i for i, op in enumerate(graph.ops)}
    plan = forced_plan(graph, inv, lambda op: RUNTIMES[index[op] % 3])
    assert len(plan.partitions) > 10 and {p.target.key for p in plan.partitions} == set(RUNTIMES)
    compiled = compile_plan(graph, plan, host, inv)
    x = random_inputs(graph, seed=5)
    for _ in range(2):
        check(graph, compiled.run(x), x)
    assert set(compiled.last_timings) == {p.id for p in plan.partitions}
    assert all(len(h) == 2 for h in compiled.history.values())
    assert compiled.runs == 2


def test_two_branches_on_three_runtimes(real: tuple[PluginHost, Inventory]) -> None:
    host, inv = real
    graph = branchy_graph()
    where = {"a_mm": "cpu@cpu", "a_act": "cpu@cpu", "b_mm": "npu@cpu", "b_act": "npu@cpu", "join": "torch@cpu"}
    plan = forced_plan(graph, inv, where.__getitem__)
    deps = dependencies(graph, plan)
    by_target = {p.target.key: p.id for p in plan.partitions}
    assert deps[by_target["cpu@cpu"]] == set() and deps[by_target["npu@cpu"]] == set()
    assert deps[by_target["torch@cpu"]] == {by_target["cpu@cpu"], by_target["npu@cpu"]}
    compiled = compile_plan(graph, plan, host, inv, lock_by="target")
    x = random_inputs(graph)
    check(graph, compiled.run(x), x)
    spans = compiled.last_spans
    join = spans[by_target["torch@cpu"]]
    assert join.start >= max(spans[by_target["cpu@cpu"]].end, spans[by_target["npu@cpu"]].end)


def test_independent_partitions_on_different_devices_overlap() -> None:
    # Each branch's call waits at a barrier for the other branch's: the run gets through only with the
    # two in flight at once (one after the other, the first would wait out the barrier and fail).
    meet = threading.Barrier(2, timeout=30)
    host, inv = fake(meet=meet, meet_on=("npu:0", "gpu:0"))
    graph = branchy_graph()
    where = {"a_mm": "fake@npu:0", "a_act": "fake@npu:0", "b_mm": "fake@gpu:0", "b_act": "fake@gpu:0",
             "join": "fake@other:0"}
    compiled = compile_plan(graph, forced_plan(graph, inv, where.__getitem__), host, inv)
    x = random_inputs(graph)
    out = compiled.run(x)
    check(graph, out, x)  # float64 from the runtime comes back as the declared float32
    assert not meet.broken
    a, b = (compiled.last_spans[p.id] for p in compiled.plan.partitions if p.ops[0] in ("a_mm", "b_mm"))
    assert a.start < b.end and b.start < a.end, "independent partitions on two devices did not overlap"
    assert a.thread != b.thread


def test_partitions_on_the_same_device_take_turns() -> None:
    host, inv = fake(sleep_s=0.05)
    graph = branchy_graph()
    plan = forced_plan(graph, inv, lambda op: "fake@gpu:0" if op == "join" else "fake@npu:0")
    assert [p.device for p in plan.partitions].count("npu:0") == 2  # two independent npu:0 partitions
    compiled = compile_plan(graph, plan, host, inv)
    compiled.run(random_inputs(graph))
    spans = sorted(compiled.last_spans.values(), key=lambda s: s.start)
    for s, t in itertools.pairwise(spans):
        assert t.start >= s.end


def test_runtime_failure_names_partition_plugin_and_op() -> None:
    host, inv = fake(fail=True)
    graph = branchy_graph()
    compiled = compile_plan(graph, forced_plan(graph, inv, lambda op: "fake@gpu:0"), host, inv)
    with pytest.raises(PartitionFailed) as info:
        compiled.run(random_inputs(graph))
    msg = str(info.value)
    assert "partition 0" in msg and "fake@gpu:0" in msg and "a_mm" in msg and "kernel exploded" in msg


def test_plan_that_misses_an_op_is_rejected() -> None:
    host, inv = fake()
    graph = branchy_graph()
    plan = forced_plan(graph, inv, lambda op: "fake@gpu:0")
    plan.partitions[0].ops.remove("join")
    with pytest.raises(PlanError, match="join"):
        compile_plan(graph, plan, host, inv)


def test_unknown_target_is_rejected() -> None:
    _, inv = fake()
    with pytest.raises(PlanError, match="nowhere@cpu"):
        forced_plan(branchy_graph(), inv, lambda op: "nowhere@cpu")


def test_one_partition_plan_checks_and_conforms_what_its_executable_returns() -> None:
    """The lean path of a one-partition plan keeps every check of the general one."""
    host, inv = fake()
    graph = branchy_graph()
    compiled = compile_plan(graph, forced_plan(graph, inv, lambda op: "fake@gpu:0"), host, inv)
    pid = compiled.plan.partitions[0].id
    x = random_inputs(graph)
    check(graph, compiled.run(x), x)  # the runtime returns float64; the graph declares float32
    assert list(compiled.last_timings) == [pid] and compiled.last_spans[pid].ms > 0
    out, spans = compiled.run_timed({"x": x["x"].astype(np.float64)})  # cast to float32 on the way in
    check(graph, out, x)
    assert list(spans) == [pid] and spans[pid].end > spans[pid].start
    assert compiled.runs == 2 and len(compiled.history[pid]) == 2

    class Lossy:
        def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return {}

    class Listy:
        def run(self, inputs: dict[str, np.ndarray]) -> object:
            return [inputs["x"]]

    compiled.executables[pid] = Lossy()  # type: ignore[assignment]
    with pytest.raises(PartitionFailed, match=r"did not return 'y' \(from op 'join'\)"):
        compiled.run(x)
    compiled.executables[pid] = Listy()  # type: ignore[assignment]
    with pytest.raises(PartitionFailed, match="returned list, not a dict of arrays"):
        compiled.run(x)
    with pytest.raises(KeyError, match=r"missing graph inputs \['x'\]"):
        compiled.run({})


class RecordsCompiles:
    """The torch reference's bids and kernels, remembering every subgraph it is asked to compile."""

    DSPARK_API_VERSION = "1.0"

    def __init__(self) -> None:
        from dspark.builtin import torch_ref

        self.ref = torch_ref
        self.compiled: list[list[str]] = []

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [d for d in self.ref.dspark_probe_devices(refresh) if d.id == "cpu"]

    @hookimpl
    def dspark_bid(self, subgraph: Subgraph, device: Device) -> Bid | None:
        return self.ref.dspark_bid(subgraph, device)

    @hookimpl
    def dspark_compile(self, subgraph: Subgraph, device: Device) -> object:
        self.compiled.append([op.op_type for op in subgraph.ops])
        return self.ref.TorchExecutable(subgraph, device.id)


def _constants_model() -> onnx.ModelProto:
    # y = relu(x); k is a Constant that is also an output, d a Constant nothing reads (as ONNX's expanded
    # functions leave behind), s a float scalar written as value_float.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, [2]),
            helper.make_tensor_value_info("s", TensorProto.FLOAT, [])]
    nodes = [helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([4, 5], np.int64))),
             helper.make_node("Constant", [], ["d"], value=numpy_helper.from_array(np.ones(3, np.float32))),
             helper.make_node("Constant", [], ["s"], value_float=2.5)]
    return helper.make_model(helper.make_graph(nodes, "constants", [x], outs),
                             opset_imports=[helper.make_opsetid("", 17)])


def test_dead_ops_are_dropped_and_constant_partitions_never_reach_a_plugin() -> None:
    graph = Graph.from_onnx(_constants_model())
    assert [op.op_type for op in graph.ops] == ["Relu", "Constant", "Constant"]  # the unread Constant is gone
    plugin = RecordsCompiles()
    host = PluginHost(PluginSettings(autoload=False))
    host.register(plugin, "rec")
    inv = probe(host)
    plan = forced_plan(graph, inv, lambda _op: "rec@cpu")
    assert len(plan.partitions) == 3  # relu, and each output Constant alone
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], np.float32)
    compiled = compile_plan(graph, plan, host, inv)
    out = compiled.run({"x": x})
    assert plugin.compiled == [["Relu"]]  # the Constants were answered by the core
    np.testing.assert_array_equal(out["y"], np.maximum(x, 0))
    assert out["k"].dtype == np.int64 and out["k"].tolist() == [4, 5]
    assert out["s"].dtype == np.float32 and out["s"].shape == () and float(out["s"]) == 2.5
    out["k"][0] = 9  # outputs are the caller's: a second run still answers the constant
    assert compiled.run({"x": x})["k"].tolist() == [4, 5]


@pytest.mark.parametrize("target", RUNTIMES)
def test_scalar_feeds_reach_each_runtime_as_0d(target: str) -> None:
    # A user feeds a bound as a numpy or Python scalar; every runtime must see a 0-d tensor (a (1,)
    # array made OpenVINO refuse Clip and the torch reference fail on the window ops).
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    lo = helper.make_tensor_value_info("lo", TensorProto.FLOAT, [])
    hi = helper.make_tensor_value_info("hi", TensorProto.FLOAT, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    m = helper.make_model(helper.make_graph([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], "clip",
                                            [x, lo, hi], [y]), opset_imports=[helper.make_opsetid("", 13)])
    graph = Graph.from_onnx(m)
    host = PluginHost().load()
    inv = probe(host)
    compiled = compile_plan(graph, forced_plan(graph, inv, lambda _op: target), host, inv)
    xs = np.array([-2.0, 0.5, 3.0], np.float32)
    for lo_v, hi_v in ((np.float32(-1.0), np.float32(1.0)), (-1.0, 1), (np.array(-1.0, np.float32), 1.0)):
        out = compiled.run({"x": xs, "lo": lo_v, "hi": hi_v})
        np.testing.assert_array_equal(out["y"], [-1.0, 0.5, 1.0])
