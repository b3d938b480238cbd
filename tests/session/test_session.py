"""dspark.Session: ONNX Runtime's surface over placement, a plan kept per model and devices, thread safety."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import dspark
from dspark import TOLERANCES, hookimpl
from dspark.host.inventory import Inventory, probe
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.placement import placer
from dspark.placement.adaptive import plan_store
from dspark.placement.adaptive.plan_store import DiskPlanStore
from dspark.session import Session, SessionError
from dspark.types import Bid, Device

RTOL, ATOL = TOLERANCES["float32"]


Weights = dict[str, np.ndarray]


def mlp_onnx(path: Path, seed: int = 0) -> tuple[Path, Weights]:
    """MatMul -> Add -> Relu -> MatMul with a symbolic batch dim, and the weights to check it with."""
    rng = np.random.default_rng(seed)
    w1, b1 = rng.standard_normal((16, 32)).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    w2 = rng.standard_normal((32, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["a"]),
         helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y"])],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), path)
    return path, {"w1": w1, "b1": b1, "w2": w2}


def expected(x: np.ndarray, w: Weights) -> np.ndarray:
    return np.maximum(x @ w["w1"] + w["b1"], 0) @ w["w2"]


@pytest.fixture(scope="module")
def machine() -> tuple[PluginHost, Inventory]:
    host = PluginHost().load()
    return host, probe(host)


@pytest.fixture()
def store() -> DiskPlanStore:
    return DiskPlanStore(namespace=f"plans-test-{uuid.uuid4().hex[:8]}")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Weights]:
    return mlp_onnx(tmp_path_factory.mktemp("session") / "mlp.onnx")


def session(path: Any, machine: tuple[PluginHost, Inventory], store: Any, **kw: Any) -> Session:
    host, inv = machine
    return Session(path, host=host, inventory=inv, plan_cache=store, **kw)


def test_runs_with_onnx_runtimes_signature_and_metadata(model: Any, machine: Any, store: DiskPlanStore) -> None:
    path, w = model
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    with session(path, machine, store) as s:
        theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for mine, ref in ((s.get_inputs(), theirs.get_inputs()), (s.get_outputs(), theirs.get_outputs())):
            assert [(a.name, a.shape, a.type) for a in mine] == [(b.name, b.shape, b.type) for b in ref]
        (y,) = s.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, w), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(s.run(["y"], {"x": x})[0], theirs.run(["y"], {"x": x})[0], rtol=RTOL, atol=ATOL)
        # Another batch size runs on its own size bucket's plan, unpadded.
        x8 = np.random.default_rng(2).standard_normal((8, 16)).astype(np.float32)
        np.testing.assert_allclose(s.run([], {"x": x8})[0], expected(x8, w), rtol=RTOL, atol=ATOL)
        assert s.plan.partitions and s.plan.decision


def test_bad_names_are_errors_that_name_them(model: Any, machine: Any, store: DiskPlanStore) -> None:
    path, _ = model
    x = np.zeros((2, 16), np.float32)
    with session(path, machine, store) as s:
        with pytest.raises(SessionError, match=r"missing input\(s\) \['x'\]; unknown input\(s\) \['input'\]"):
            s.run(None, {"input": x})
        with pytest.raises(SessionError, match=r"unknown output\(s\) \['logits'\].*\['y'\]"):
            s.run(["logits"], {"x": x})
        with pytest.raises(ValueError, match="x"):  # a shape the graph cannot take names the input
            s.run(None, {"x": np.zeros((2, 5), np.float32)})


def test_a_warm_start_runs_the_kept_plan_without_planning(model: Any, machine: Any, store: DiskPlanStore,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path, w = model
    x = np.random.default_rng(3).standard_normal((4, 16)).astype(np.float32)
    x16 = np.random.default_rng(4).standard_normal((16, 16)).astype(np.float32)  # another size bucket
    with session(path, machine, store) as first:
        first.run(None, {"x": x})  # a race between close plans, if any, happens here and is kept
        first.run(None, {"x": x16})
        first.runner.settle()
        chosen, source = first.plan.assignment(), first.plan_source
    assert source == "planned"

    def no_planning(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a warm start planned again")

    monkeypatch.setattr(placer, "candidates", no_planning)
    monkeypatch.setattr(placer, "collect_op_bids", no_planning)
    with session(path, machine, store) as warm:
        assert warm.plan_source == "kept"
        assert warm.plan.assignment() == chosen
        np.testing.assert_allclose(warm.run(None, {"x": x})[0], expected(x, w), rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(warm.run(None, {"x": x16})[0], expected(x16, w), rtol=RTOL, atol=ATOL)
        assert any("ran the plan kept for them" in r for r in warm.replans), warm.replans


def test_another_model_other_devices_or_another_placer_plan_afresh(model: Any, machine: Any, store: DiskPlanStore,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = model
    with session(path, machine, store):
        pass
    other, _ = mlp_onnx(tmp_path / "other.onnx", seed=7)  # same structure, other weights
    with session(other, machine, store) as s:
        assert s.plan_source == "planned"
    host = PluginHost(PluginSettings(blocked={"npu"})).load()  # a plugin fewer: another inventory
    with Session(path, host=host, inventory=probe(host), plan_cache=store) as s:
        assert s.plan_source == "planned"
        assert all(p.target.plugin != "npu" for p in s.plan.partitions)
    with session(path, machine, store) as s:
        assert s.plan_source == "kept"
    monkeypatch.setattr(plan_store, "PLACER_VERSION", plan_store.PLACER_VERSION + 1)  # placement changed
    with session(path, machine, store) as s:
        assert s.plan_source == "planned"


class Cheap:
    """Bids far below every real runtime; ``broken`` makes its compiler fail (same name, device, version)."""

    DSPARK_API_VERSION = "1.0"

    def __init__(self, broken: bool) -> None:
        self.broken = broken

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [Device(id="cpu", kind="cpu", name="cheap", runtime="cheap", memory_total_bytes=1 << 33,
                       memory_free_bytes=1 << 33, peak_flops={"float32": 1e12}, host_link_bandwidth_bytes_per_s=1e11)]

    @hookimpl
    def dspark_bid(self, subgraph: Any, device: Device) -> Bid:
        return Bid(device_id=device.id, runtime="cheap", latency_s=1e-7, peak_memory_bytes=0, precision="float32")

    @hookimpl
    def dspark_compile(self, subgraph: Any, device: Device) -> Any:
        if self.broken:
            raise RuntimeError("the cheap compiler is broken today")
        from dspark.sdk.reference.executable import TorchExecutable

        return TorchExecutable(subgraph, "cpu")


def test_a_kept_plan_that_no_longer_compiles_is_charged_and_planned_around(model: Any, store: DiskPlanStore) -> None:
    path, w = model

    def host_with(broken: bool) -> PluginHost:
        host = PluginHost(PluginSettings(autoload=False, blocked={"ngram", "drafters"}))
        host.register(Cheap(broken), "cheap")
        return host.load()

    host = host_with(broken=False)
    with Session(path, host=host, inventory=probe(host), plan_cache=store) as s:
        assert {p.target.plugin for p in s.plan.partitions} == {"cheap"}
    host = host_with(broken=True)
    x = np.ones((2, 16), np.float32)
    with Session(path, host=host, inventory=probe(host), plan_cache=store) as s:
        assert s.plan_source == "planned"
        assert any("cheap@cpu failed" in r for r in s.replans), s.replans
        assert "cheap" not in {p.target.plugin for p in s.plan.partitions}
        np.testing.assert_allclose(s.run(None, {"x": x})[0], expected(x, w), rtol=RTOL, atol=ATOL)
    assert any(f.hook == "dspark_compile" for f in host.records["cheap"].faults)


class HangsInBid(Cheap):
    """Cheap, but its bids hang until ``release`` is set: timed out, it fails as a whole for this run."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(broken=False)
        self.release = release

    @hookimpl
    def dspark_bid(self, subgraph: Any, device: Device) -> Bid:
        self.release.wait(30)
        return Bid(device_id=device.id, runtime="cheap", latency_s=1e-7, peak_memory_bytes=0, precision="float32")


def test_a_plan_made_while_a_plugin_had_failed_is_not_kept(model: Any, store: DiskPlanStore) -> None:
    path, _ = model
    release = threading.Event()
    host = PluginHost(PluginSettings(autoload=False, blocked={"ngram", "drafters"}, timeout_override_s=5))
    host.register(HangsInBid(release), "cheap")
    host.load()
    inv = probe(host)
    try:
        with Session(path, host=host, inventory=inv, plan_cache=store) as s:
            assert "cheap" not in {p.target.plugin for p in s.plan.partitions}
        assert host.records["cheap"].status == dspark.PluginStatus.FAILED
    finally:
        release.set()
    healthy = PluginHost(PluginSettings(autoload=False, blocked={"ngram", "drafters"}))
    healthy.register(Cheap(broken=False), "cheap")
    healthy.load()
    with Session(path, host=healthy, inventory=probe(healthy), plan_cache=store) as s:
        assert s.plan_source == "planned"  # the plan made around the timeout was not kept
        assert {p.target.plugin for p in s.plan.partitions} == {"cheap"}


def test_concurrent_callers_each_get_their_own_outputs(model: Any, machine: Any, store: DiskPlanStore) -> None:
    path, w = model
    wrong: list[str] = []
    with session(path, machine, store) as s:
        def caller(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for i in range(25):
                x = rng.standard_normal((1 + (seed + i) % 4, 16)).astype(np.float32)
                y = s.run(None, {"x": x})[0]
                if not np.allclose(y, expected(x, w), rtol=RTOL, atol=ATOL):
                    wrong.append(f"caller {seed}, run {i}")

        threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a caller did not finish"
    assert wrong == []


def test_run_async_calls_back_with_results_or_the_error(model: Any, machine: Any, store: DiskPlanStore) -> None:
    path, w = model
    x = np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32)
    seen: list[tuple[Any, Any, str]] = []
    done = threading.Event()

    def callback(results: Any, user_data: Any, err: str) -> None:
        seen.append((results, user_data, err))
        if len(seen) == 2:
            done.set()

    with session(path, machine, store) as s:
        ok = s.run_async(None, {"x": x}, callback, user_data="first")
        bad = s.run_async(None, {"nope": x}, callback, user_data="second")
        np.testing.assert_allclose(ok.result(timeout=60)[0], expected(x, w), rtol=RTOL, atol=ATOL)
        with pytest.raises(SessionError):
            bad.result(timeout=60)
        assert done.wait(timeout=60)
    by_user = {u: (r, e) for r, u, e in seen}
    np.testing.assert_allclose(by_user["first"][0][0], expected(x, w), rtol=RTOL, atol=ATOL)
    assert by_user["first"][1] == ""
    assert by_user["second"][0] is None and "unknown input(s) ['nope']" in by_user["second"][1]


def test_outputs_are_written_into_the_callers_buffers(model: Any, machine: Any, store: DiskPlanStore) -> None:
    path, w = model
    buffer = np.empty((3, 4), np.float32)
    with session(path, machine, store) as s:
        for seed in (5, 6):
            x = np.random.default_rng(seed).standard_normal((3, 16)).astype(np.float32)
            (y,) = s.run(None, {"x": x}, outputs={"y": buffer})
            assert y is buffer
            np.testing.assert_allclose(buffer, expected(x, w), rtol=RTOL, atol=ATOL)
        with pytest.raises(SessionError, match=r"outputs\['y'\].*\(2, 4\)"):
            s.run(None, {"x": np.zeros((2, 16), np.float32)}, outputs={"y": buffer})


def test_a_torch_module_with_example_inputs(machine: Any, store: DiskPlanStore) -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3)).eval()
    x = torch.randn(2, 8)
    with session(module, machine, store, example_inputs=(x,)) as s:
        (name,) = [a.name for a in s.get_inputs()]
        (y,) = s.run(None, {name: x.numpy()})
        with torch.no_grad():
            np.testing.assert_allclose(y, module(x).numpy(), rtol=RTOL, atol=ATOL)


def test_session_is_exported_from_the_package() -> None:
    assert dspark.Session is Session and dspark.SessionError is SessionError


def test_the_readmes_python_api_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Python API"):]
    snippet = section[section.index("```python\n") + 10:section.index("```\n", section.index("```python\n") + 10)]
    assert "dspark.Session(" in snippet
    # The example's model: an image classifier with an input named "input" and an output named "logits".
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "w"], ["c"], kernel_shape=[3, 3], strides=[4, 4]),
         helper.make_node("Relu", ["c"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["p"]),
         helper.make_node("Flatten", ["p"], ["f"]), helper.make_node("Gemm", ["f", "fc"], ["logits"])],
        "classifier", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 224, 224])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(rng.standard_normal((4, 10)).astype(np.float32), "fc")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10),
              tmp_path / "model.onnx")
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(snippet, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
    assert scope["logits"].shape == (1, 10)
    np.testing.assert_allclose(scope["future"].result(timeout=60)[0], scope["logits"], rtol=RTOL, atol=ATOL)
    scope["session"].close()
