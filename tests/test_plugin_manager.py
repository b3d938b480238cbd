"""Registration checks and fault isolation of the plugin manager."""

from __future__ import annotations

import time

import numpy as np
import pytest

from bad_plugins import FutureApi, Good, Hangs, Misspelled, NoApi, RaisesIn, UnmarkedMisspelled, WrongArgs, WrongTypes
from dspark import PluginStatus, QuantSpec, TargetModel
from dspark.llm.speculative.offers import collect_drafters
from dspark.graph.model import Graph, Op, TensorSpec
from dspark.host.inventory import probe
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings


def relu_graph() -> Graph:
    return Graph(
        name="relu", ops=[Op(name="r", op_type="Relu", inputs=["x"], outputs=["y"])],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=(2, 3)),
                 "y": TensorSpec(name="y", dtype="float32", shape=(2, 3))},
        inputs=["x"], outputs=["y"],
    )


def bare_host(**settings: object) -> PluginHost:
    """A host with only the built-ins: no entry points, so tests see only their own plugins."""
    return PluginHost(PluginSettings(autoload=False, **settings)).load()  # type: ignore[arg-type]


def test_builtins_load_and_probe() -> None:
    host = bare_host()
    inv = probe(host)
    assert host.records["torch"].status == PluginStatus.ACTIVE
    assert inv.device("cpu").plugins == ["torch"]
    assert inv.device("cpu").peak_flops["float32"] > 0


def test_good_plugin_merges_with_builtin_on_same_device() -> None:
    host = bare_host()
    host.register(Good(), "good")
    inv = probe(host)
    cpu = inv.device("cpu")
    assert set(cpu.plugins) == {"good", "torch"}
    assert cpu.plugins[-1] == "torch"  # hardware plugins first, the reference last
    assert {d.runtime for d in cpu.drivers} == {"good", "torch"}


@pytest.mark.parametrize("hook", ["dspark_probe_devices", "dspark_bid", "dspark_compile",
                                  "dspark_quantize", "dspark_drafters"])
def test_plugin_raising_in_a_hook_is_reported_and_left_out(hook: str) -> None:
    host = bare_host()
    host.register(RaisesIn(hook), "bad")
    inv = probe(host)
    device = next((d for d in inv.drivers() if d.plugin == "bad"), None)
    sub = relu_graph().subgraph()
    if hook == "dspark_bid":
        assert host.call("bad", hook, subgraph=sub, device=device) is None
    elif hook == "dspark_compile":
        assert host.call("bad", hook, subgraph=sub, device=device) is None
    elif hook == "dspark_quantize":
        assert host.call("bad", hook, subgraph=sub, device=device, spec=QuantSpec()) is None
    elif hook == "dspark_drafters":
        target = TargetModel(name="t", vocab_size=10, num_layers=1, hidden_size=8)
        assert collect_drafters(host, target) == collect_drafters(host, target)
    record = host.records["bad"]
    assert record.status == PluginStatus.FAILED
    assert hook in record.reason and "RuntimeError" in record.reason and "boom" in record.reason
    assert "bad" not in host.active()
    # The run goes on: the reference still bids, and the failed plugin is no longer called.
    torch_dev = next(d for d in probe(host).drivers() if d.plugin == "torch")
    assert host.call("torch", "dspark_bid", subgraph=sub, device=torch_dev) is not None
    assert host.call("bad", "dspark_bid", subgraph=sub, device=torch_dev) is None


def test_wrong_return_types_name_the_plugin_and_field() -> None:
    host = bare_host()
    host.register(WrongTypes(), "wrong")
    probe(host)
    rec = host.records["wrong"]
    assert rec.status == PluginStatus.FAILED
    assert "'wrong'" in rec.reason and "dspark_probe_devices" in rec.reason


@pytest.mark.parametrize("hook,kwargs,expect", [
    ("dspark_bid", {}, "latency_s"),
    ("dspark_compile", {}, "run(inputs)"),
    ("dspark_quantize", {"spec": QuantSpec()}, "quantized_by"),
])
def test_wrong_types_per_hook(hook: str, kwargs: dict[str, object], expect: str) -> None:
    host = bare_host()
    good_probe = [{"id": "cpu", "kind": "cpu", "name": "n", "runtime": "r"}]  # dicts validate too
    host.register(WrongTypes(probe_value=good_probe), "wrong")
    inv = probe(host)
    assert host.records["wrong"].status == PluginStatus.ACTIVE
    device = next(d for d in inv.drivers() if d.plugin == "wrong")
    assert host.call("wrong", hook, subgraph=relu_graph().subgraph(), device=device, **kwargs) is None
    rec = host.records["wrong"]
    assert rec.status == PluginStatus.FAILED and expect in rec.reason and hook in rec.reason


def test_wrong_drafter_type_is_rejected() -> None:
    host = bare_host()
    host.register(WrongTypes(probe_value=None), "wrong")
    target = TargetModel(name="t", vocab_size=10, num_layers=1, hidden_size=8)
    offers = collect_drafters(host, target)
    assert {o.plugin for o in offers} == {"ngram"}  # the built-in lookups; the wrong offer is dropped
    assert "create" in host.records["wrong"].reason


def test_malformed_device_is_dropped_with_the_field_named() -> None:
    host = bare_host()
    host.register(WrongTypes(probe_value=[{"id": "CPU 0", "kind": "cpu", "name": "x", "runtime": "r"}]), "wrong")
    inv = probe(host)
    assert host.records["wrong"].status == PluginStatus.FAILED
    assert "Device at [0]: id:" in host.records["wrong"].reason and "kind:N" in host.records["wrong"].reason
    assert [d.plugins for d in inv.devices] == [["torch"]]


def test_hanging_probe_times_out_and_the_rest_is_listed() -> None:
    host = bare_host(timeout_override_s=0.5)
    hang = Hangs()
    host.register(hang, "hangs")
    t0 = time.perf_counter()
    inv = probe(host)
    elapsed = time.perf_counter() - t0
    hang.release.set()
    assert elapsed < 5
    assert host.records["hangs"].status == PluginStatus.FAILED
    assert "did not return within 0.5 s" in host.records["hangs"].reason
    assert inv.device("cpu").plugins == ["torch"]


@pytest.mark.parametrize("plugin,needle", [
    (FutureApi(), "written for plugin API 2.0"),
    (NoApi(), "does not declare DSPARK_API_VERSION"),
    (Misspelled(), "unknown hook 'dspark_probe_device' (did you mean 'dspark_probe_devices'?)"),
    (UnmarkedMisspelled(), "unknown hook 'dspark_bids' (did you mean 'dspark_bid'?)"),
    (WrongArgs(), "budget"),
])
def test_registration_time_validation(plugin: object, needle: str) -> None:
    host = bare_host()
    rec = host.register(plugin, "p")
    assert rec.status == PluginStatus.FAILED
    assert needle in rec.reason
    assert host.pm.get_plugin("p") is None  # nothing half-registered
    assert probe(host).device("cpu").plugins == ["torch"]


def test_duplicate_name_keeps_the_first() -> None:
    host = bare_host()
    host.register(Good(), "dup")
    rec = host.register(Good(), "dup")
    assert rec.status == PluginStatus.FAILED and "already taken" in rec.reason
    assert host.records["dup"].status == PluginStatus.ACTIVE


def test_blocklist_and_allowlist() -> None:
    blocked = PluginHost(PluginSettings.from_env(["no:ngram"], env={"DSPARK_DISABLE_PLUGIN_AUTOLOAD": "1"})).load()
    assert blocked.records["ngram"].status == PluginStatus.BLOCKED
    assert "no:ngram" in blocked.records["ngram"].reason
    only = PluginHost(PluginSettings.from_env(env={"DSPARK_PLUGINS": "torch", "DSPARK_DISABLE_PLUGIN_AUTOLOAD": "1"})).load()
    assert only.records["ngram"].status == PluginStatus.BLOCKED
    assert only.active() == ["torch"]


def test_autoload_kill_switch_skips_entry_points() -> None:
    on = PluginHost(PluginSettings.from_env(env={})).load()
    off = PluginHost(PluginSettings.from_env(env={"DSPARK_DISABLE_PLUGIN_AUTOLOAD": "1"})).load()
    entry_points = {n for n, r in on.records.items() if r.source == "entry point"}
    assert {"cpu", "cuda", "npu"} <= entry_points
    assert not {n for n, r in off.records.items() if r.source == "entry point"}


def test_command_line_module_plugin() -> None:
    host = PluginHost(PluginSettings.from_env(["bad_plugins:Good"], env={"DSPARK_DISABLE_PLUGIN_AUTOLOAD": "1"})).load()
    assert host.records["Good"].source == "command line"
    assert host.records["Good"].status == PluginStatus.ACTIVE


def test_trace_logs_every_call(capsys: pytest.CaptureFixture[str]) -> None:
    from dspark.host import log

    log.configure(json=True, level="INFO")
    try:
        host = bare_host(trace=True)
        probe(host)
    finally:
        log.configure()
    err = capsys.readouterr().err
    assert '"event": "hook.call"' in err and '"plugin": "torch"' in err and '"hook": "dspark_probe_devices"' in err


def test_torch_reference_runs_what_it_bids_on() -> None:
    host = bare_host()
    device = next(d for d in probe(host).drivers() if d.plugin == "torch")
    sub = relu_graph().subgraph()
    bid = host.call("torch", "dspark_bid", subgraph=sub, device=device)
    assert bid.plugin == "torch" and bid.precision == "float32" and bid.latency_s > 0
    exe = host.call("torch", "dspark_compile", subgraph=sub, device=device)
    x = np.array([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]], dtype=np.float32)
    np.testing.assert_array_equal(exe.run({"x": x})["y"], np.maximum(x, 0))


def test_torch_op_name_table_matches_kernels() -> None:
    from dspark.builtin.op_names import TORCH_KERNEL_OPS
    from dspark.builtin.torch_ops import KERNELS

    assert set(KERNELS) == TORCH_KERNEL_OPS


def test_hardware_unavailable_outside_probe_is_a_failure_not_a_crash() -> None:
    from bad_plugins import Good
    from dspark import HardwareUnavailable, hookimpl

    class VanishesInBid(Good):
        @hookimpl
        def dspark_bid(self, subgraph: object, device: object) -> None:
            raise HardwareUnavailable("device fell off the bus")

    host = bare_host()
    host.register(VanishesInBid(), "flaky")
    device = next(d for d in probe(host).drivers() if d.plugin == "flaky")
    assert host.call("flaky", "dspark_bid", subgraph=relu_graph().subgraph(), device=device) is None
    rec = host.records["flaky"]
    assert rec.status == PluginStatus.FAILED and "fell off the bus" in rec.reason
