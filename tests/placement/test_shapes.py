"""Shape binding, shape buckets, graphs re-hinted at a bucket, and the per-bucket LRU (dspark.placement.shapes)."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from dspark.graph.importers import load_model
from dspark.graph.model import Graph
from dspark.placement.shapes import (
    BucketKey,
    ShapeMismatch,
    ShapePlans,
    at_dims,
    bind_dims,
    bucket,
)
from onnx import TensorProto, helper, numpy_helper

RNG = np.random.default_rng(0)
W = RNG.standard_normal((4, 3)).astype(np.float32)
B = RNG.standard_normal(3).astype(np.float32)


def mlp(batch_hint: int = 2) -> Graph:
    """y = relu(x @ W + b), x: ("batch", 4); plus a second input z: ("batch", "2*batch") to bind twice."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["a"], name="add"),
             helper.make_node("Relu", ["a"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        initializer=[numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return load_model(model, dim_hints={"batch": batch_hint})


def two_inputs() -> Graph:
    """x: ("batch", "seq"), m: ("batch", "2*seq") -> y = x (m only checked): a dim shared by two inputs."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"], name="id"), helper.make_node("Identity", ["m"], ["n"], name="id2")],
        "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"]),
                helper.make_tensor_value_info("m", TensorProto.FLOAT, ["batch", "2*seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"]),
         helper.make_tensor_value_info("n", TensorProto.FLOAT, ["batch", "2*seq"])]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return load_model(model, dim_hints={"batch": 1, "seq": 4})


def zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


# -- bind_dims ---------------------------------------------------------------


def test_bind_dims_reads_symbolic_sizes_off_the_arrays() -> None:
    assert bind_dims(mlp(), {"x": zeros(5, 4)}) == {"batch": 5}
    assert bind_dims(two_inputs(), {"x": zeros(3, 7), "m": zeros(3, 14)}) == {"batch": 3, "seq": 7}


def test_bind_dims_ignores_missing_inputs_and_dtypes() -> None:
    assert bind_dims(mlp(), {}) == {}
    assert bind_dims(mlp(), {"x": np.zeros((6, 4), np.int64), "extra": zeros(1)}) == {"batch": 6}


def test_static_dim_mismatch_names_input_dim_declared_and_given() -> None:
    with pytest.raises(ShapeMismatch) as info:
        bind_dims(mlp(), {"x": zeros(2, 5)})
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.input, err.dim, err.declared, err.given) == ("x", 1, 4, 5)
    assert "input 'x' dim 1" in str(err) and "declares 4" in str(err) and "got 5" in str(err)


def test_rank_mismatch_names_both_ranks() -> None:
    with pytest.raises(ShapeMismatch) as info:
        bind_dims(mlp(), {"x": zeros(2, 4, 1)})
    err = info.value
    assert err.input == "x" and err.dim is None and err.given == (2, 4, 1)
    assert "rank 2 declared" in str(err) and "rank 3" in str(err) and "'batch'" in str(err)


def test_one_symbolic_dim_with_two_sizes_names_where_each_came_from() -> None:
    with pytest.raises(ShapeMismatch) as info:
        bind_dims(two_inputs(), {"x": zeros(3, 2), "m": zeros(5, 4)})
    err = info.value
    assert (err.input, err.dim, err.declared, err.given) == ("m", 0, "batch", 5)
    assert "input 'x' dim 0 gave 'batch' = 3" in str(err)


def test_expression_dim_must_agree_with_the_bound_sizes() -> None:
    with pytest.raises(ShapeMismatch) as info:
        bind_dims(two_inputs(), {"x": zeros(1, 3), "m": zeros(1, 7)})
    assert (info.value.input, info.value.dim, info.value.declared, info.value.given) == ("m", 1, "2*seq", 7)
    assert "2*seq = 6" in str(info.value)


# -- bucket ------------------------------------------------------------------


def test_bucket_rounds_up_to_powers_of_two_and_keeps_the_hinted_size() -> None:
    hints = {"batch": 3, "seq": 128}
    assert bucket({"batch": 3, "seq": 100}, hints) == (("batch", 3), ("seq", 128))
    assert bucket({"seq": 100, "batch": 5}, hints) == (("batch", 8), ("seq", 128))
    assert bucket({"batch": 1, "seq": 129}, hints) == (("batch", 1), ("seq", 256))
    assert bucket({"batch": 4}, {}) == bucket({"batch": 4}, {}) == (("batch", 4),)
    assert bucket({"batch": 0}, {}) == (("batch", 0),)
    assert bucket({}, hints) == ()
    assert hash(bucket({"batch": 6}, {})) == hash((("batch", 8),))


# -- at_dims -----------------------------------------------------------------


def test_at_dims_shares_weights_and_prices_the_new_shape() -> None:
    g = mlp(batch_hint=2)
    flops_before = {op.name: op.flops for op in g.ops}
    io_before = g.subgraph().io_bytes()
    big = at_dims(g, {"batch": 8})
    assert big.dim_hints["batch"] == 8 and g.dim_hints["batch"] == 2
    assert all(big.initializers[k] is g.initializers[k] for k in g.initializers)
    assert big.tensors["h"] is g.tensors["h"]
    assert big.subgraph().io_bytes() == 4 * io_before  # (8*4 + 8*3) floats vs (2*4 + 2*3)
    assert big.subgraph().io_bytes() == (8 * 4 + 8 * 3) * 4
    assert big.tensors["x"].nbytes(big.dim_hints) == 8 * 4 * 4 != g.tensors["x"].nbytes(g.dim_hints)
    assert big.op("mm").flops == 2 * 8 * 3 * 4 == 4 * (flops_before["mm"] or 0)
    assert {op.name: op.flops for op in g.ops} == flops_before  # the original's costs are untouched
    assert big.op("mm") is not g.op("mm") and big.producers["y"] == "relu"


def test_at_dims_derives_expression_dims_again() -> None:
    g = two_inputs()
    assert g.dim_hints["2*seq"] == 8
    long = at_dims(g, {"batch": 2, "seq": 16})
    assert long.dim_hints["2*seq"] == 32
    assert long.tensors["m"].nbytes(long.dim_hints) == 2 * 32 * 4


def test_at_dims_resizes_the_dims_inference_could_not_name() -> None:
    # Reshape (batch, 4, 6) -> (-1, 6): inference names the rows unk__N at import (sized 4*batch by a
    # pass pinned to the hint); a bucket at batch 8 must price the MatMul after it at 32 rows, not 8.
    w = RNG.standard_normal((6, 3)).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"], name="flat"),
             helper.make_node("MatMul", ["r", "w"], ["y"], name="mm")]
    model = helper.make_model(helper.make_graph(
        nodes, "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array([-1, 6], np.int64), "shape"), numpy_helper.from_array(w, "w")]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    g = load_model(model, dim_hints={"batch": 2})
    rows = g.tensors["r"].shape[0]
    assert isinstance(rows, str) and g.dim_hints[rows] == 8 and g.op("mm").flops == 2 * 8 * 6 * 3
    big = at_dims(g, {"batch": 8})
    assert big.dim_hints[rows] == 32 and big.op("mm").flops == 2 * 32 * 6 * 3
    assert big.subgraph(["mm"]).io_bytes() == 4 * g.subgraph(["mm"]).io_bytes()
    assert g.dim_hints[rows] == 8  # the original keeps its sizes


def test_at_dims_on_a_torch_export_with_a_dynamic_batch() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    g = load_model(module, example_inputs=(torch.randn(2, 4),), dynamic={"input": {0: "batch"}})
    assert g.dim_hints == {"batch": 2}
    assert bind_dims(g, {g.inputs[0]: zeros(6, 4)}) == {"batch": 6}
    big = at_dims(g, dict(bucket({"batch": 6}, g.dim_hints)))
    assert big.dim_hints == {"batch": 8}
    assert big.subgraph().io_bytes() == 4 * g.subgraph().io_bytes()
    assert all(big.initializers[k] is v for k, v in g.initializers.items())


# -- ShapePlans --------------------------------------------------------------


def test_lru_evicts_the_least_recently_used_and_calls_on_evict() -> None:
    evicted: list[tuple[BucketKey, str]] = []
    plans: ShapePlans[str] = ShapePlans(max_entries=2, on_evict=lambda k, v: evicted.append((k, v)))
    a, b, c = (("batch", 1),), (("batch", 2),), (("batch", 4),)
    assert plans.get_or_build(a, lambda: "A") == "A"
    assert plans.get_or_build(b, lambda: "B") == "B"
    assert plans.get(a) == "A"  # a is now the most recent
    assert plans.get_or_build(c, lambda: "C") == "C"
    assert evicted == [(b, "B")]
    assert plans.keys() == [a, c] and plans.get(b) is None and len(plans) == 2
    assert plans.get_or_build(a, lambda: pytest.fail("built twice")) == "A"
    plans.clear()
    assert sorted(evicted) == sorted([(b, "B"), (c, "C"), (a, "A")]) and plans.keys() == []


def test_put_replacing_a_value_evicts_the_old_one_and_a_failing_callback_is_contained() -> None:
    seen: list[str] = []

    def close(_key: BucketKey, value: str) -> None:
        seen.append(value)
        raise RuntimeError("close failed")

    plans: ShapePlans[str] = ShapePlans(max_entries=1, on_evict=close)
    plans.put((("b", 1),), "one")
    plans.put((("b", 1),), "uno")
    plans.put((("b", 2),), "two")
    assert seen == ["one", "uno"] and plans.keys() == [(("b", 2),)]
    with pytest.raises(ValueError, match="at least 1"):
        ShapePlans(max_entries=0)


def test_concurrent_callers_build_a_bucket_once() -> None:
    plans: ShapePlans[int] = ShapePlans()
    calls: list[int] = []
    building, gate = threading.Event(), threading.Event()

    def build() -> int:
        calls.append(1)
        building.set()
        gate.wait(30)
        return 42

    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(plans.get_or_build((("n", 8),), build)))
               for _ in range(6)]
    for t in threads:
        t.start()
    assert building.wait(30)  # one caller builds; the others wait for it (or find its value)
    assert plans.get_or_build((("n", 1),), lambda: 7) == 7  # another bucket is not held up by the build
    gate.set()
    for t in threads:
        t.join(30)
    assert results == [42] * 6 and len(calls) == 1


def test_a_failed_build_reaches_its_waiters_and_is_not_cached() -> None:
    plans: ShapePlans[int] = ShapePlans()
    key = (("n", 2),)
    started, gate = threading.Event(), threading.Event()

    def failing() -> int:
        started.set()
        gate.wait(5)
        raise RuntimeError("no plan")

    errors: list[BaseException] = []

    def call(build: Callable[[], int]) -> None:
        try:
            plans.get_or_build(key, build)
        except RuntimeError as exc:
            errors.append(exc)

    first = threading.Thread(target=call, args=(failing,))
    first.start()
    assert started.wait(30)
    # The build's done-event, instrumented: it says when the second caller is waiting on it.
    pending = plans._pending[key]
    waiting = threading.Event()

    class Done(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            waiting.set()
            return super().wait(timeout)

    pending.done = Done()
    second = threading.Thread(target=call, args=(lambda: pytest.fail("a waiter built too"),))
    second.start()
    assert waiting.wait(30)  # the second caller waits for the first one's build
    gate.set()
    first.join(30)
    second.join(30)
    assert [str(e) for e in errors] == ["no plan", "no plan"]
    assert plans.keys() == [] and plans.get_or_build(key, lambda: 3) == 3


# -- the finding bucketing rests on: executables run at other sizes -----------


def _cpu_device(module: Any) -> Any:
    from dspark.types import Device

    devices = [d for d in module.dspark_probe_devices(refresh=False) if isinstance(d, Device) and d.id == "cpu"]
    if not devices:
        pytest.skip(f"{module.__name__} reports no cpu device")
    return devices[0]


@pytest.mark.parametrize(("plugin", "runtime"), [("dspark_plugins_cpu", "openvino"),
                                                 ("dspark_plugins_npu", "onnxruntime"),
                                                 ("dspark.builtin.torch_ref", "torch")])
def test_executables_compiled_with_symbolic_dims_run_at_other_sizes(plugin: str, runtime: str) -> None:
    pytest.importorskip(runtime, reason=f"{runtime} is not installed")
    module = importlib.import_module(plugin)
    g = mlp(batch_hint=2)
    exe = module.dspark_compile(g.subgraph(), _cpu_device(module))
    assert exe is not None
    for n in (1, 3, 8):
        x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
        y = exe.run({"x": x})["y"]
        assert y.shape == (n, 3)
        np.testing.assert_allclose(y, np.maximum(x @ W + B, 0), rtol=1e-5, atol=1e-5)


def test_torch_linear_executable_runs_at_other_token_counts() -> None:
    pytest.importorskip("torch", reason="torch is not installed")
    from dspark.builtin import torch_ref
    from dspark.sdk.quant import linear_subgraph
    from dspark.sdk.reference.executable import LinearExecutable

    sg = linear_subgraph("proj", W, representative_tokens=2)
    exe = torch_ref.dspark_compile(sg, _cpu_device(torch_ref))
    assert isinstance(exe, LinearExecutable)
    for n in (1, 3, 8):
        x = np.random.default_rng(n).standard_normal((n, 4)).astype(np.float32)
        np.testing.assert_allclose(exe.run({"x": x})["y"], x @ W, rtol=1e-5, atol=1e-5)


# -- the adaptive runner routes runs by shape bucket -------------------------


def test_a_run_at_other_sizes_is_replanned_at_its_bucket_and_the_bucket_is_reused() -> None:
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost
    from dspark.host.settings import PluginSettings
    from dspark.placement.adaptive import LEARN_ALL, AdaptiveRunner
    from dspark.placement.executor import reference_outputs

    graph = mlp(batch_hint=2)
    host = PluginHost(PluginSettings(blocked={"cuda", "ngram"})).load()
    runner = AdaptiveRunner(graph, host, probe(host))
    x2 = RNG.standard_normal((2, 4)).astype(np.float32)
    for _ in range(LEARN_ALL + 1):  # past the runs learned from: the lean path's inline check routes by shape
        np.testing.assert_allclose(runner.run({"x": x2})["y"], reference_outputs(graph, {"x": x2})["y"], rtol=1e-5)
    assert not [r for r in runner.replans if r.startswith("input sizes")]
    for batch in (5, 7):  # both in the bucket of 8: planned once, at 8
        x = RNG.standard_normal((batch, 4)).astype(np.float32)
        y = runner.run({"x": x})["y"]
        assert y.shape == (batch, 3)
        np.testing.assert_allclose(y, np.maximum(x @ W + B, 0), rtol=1e-4, atol=1e-5)
    shaped = [r for r in runner.replans if r.startswith("input sizes")]
    assert len(shaped) == 1 and "{'batch': 8}" in shaped[0], runner.replans
    child = runner._shapes.plans.get((("batch", 8),))
    assert child is not None and child.graph.dim_hints["batch"] == 8
    # The child's bids were made at batch 8: its plan's inputs are priced at that size.
    def x_bytes(r: AdaptiveRunner) -> int:
        return next(p.boundary_bytes_in for p in r.plan.partitions if "x" in p.inputs)

    assert (x_bytes(runner), x_bytes(child)) == (2 * 4 * 4, 8 * 4 * 4)
    with pytest.raises(ShapeMismatch, match="input 'x' dim 1"):
        runner.run({"x": zeros(2, 5)})
    runner.close()
