"""Registration checks and fault isolation of the plugin manager."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bad_plugins import FutureApi, Good, Hangs, Misspelled, NoApi, RaisesIn, UnmarkedMisspelled, WrongArgs, WrongTypes
from dspark import PluginStatus, QuantSpec, TargetModel
from dspark.llm.speculative.offers import collect_drafters
from dspark.graph.model import Graph, Op, Subgraph, TensorSpec
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


def test_builtins_are_the_builtin_entry_point_group_and_load_without_autoload() -> None:
    import importlib.metadata as md

    from dspark.host.plugin_manager import BUILTIN_GROUP

    declared = {ep.name: ep.value for ep in md.entry_points(group=BUILTIN_GROUP)}
    assert declared == {"torch": "dspark.builtin.torch_ref", "ngram": "dspark.builtin.ngram",
                        "drafters": "dspark.llm.speculative.builtin_plugin"}
    host = bare_host()  # autoload off: no `dspark` entry point, the built-ins all the same
    assert {n: (r.source, r.module) for n, r in host.records.items()} == {
        n: ("builtin", module) for n, module in declared.items()}
    assert list(host.records) == ["torch", "ngram", "drafters"]  # the reference first; offers in this order
    assert all(host.is_builtin(n) for n in declared)
    host.register(Good(), "good")
    assert not host.is_builtin("good") and not host.is_builtin("nobody")
    blocked = bare_host(blocked={"ngram"})  # selected and blocked like any other plugin
    assert blocked.records["ngram"].status == PluginStatus.BLOCKED and "ngram" not in blocked.active()


def test_good_plugin_merges_with_builtin_on_same_device() -> None:
    host = bare_host()
    host.register(Good(), "good")
    inv = probe(host)
    cpu = inv.device("cpu")
    assert set(cpu.plugins) == {"good", "torch"}
    assert cpu.plugins[-1] == "torch"  # hardware plugins first, the reference last
    assert {d.runtime for d in cpu.drivers} == {"good", "torch"}


def relu_sub(rows: int = 2) -> Subgraph:
    """A one-op subgraph; each ``rows`` gives a different signature."""
    g = Graph(
        name="relu", ops=[Op(name="r", op_type="Relu", inputs=["x"], outputs=["y"])],
        tensors={"x": TensorSpec(name="x", dtype="float32", shape=(rows, 3)),
                 "y": TensorSpec(name="y", dtype="float32", shape=(rows, 3))},
        inputs=["x"], outputs=["y"],
    )
    return g.subgraph()


def test_failed_probe_fails_the_whole_plugin() -> None:
    host = bare_host()
    host.register(RaisesIn("dspark_probe_devices"), "bad")
    probe(host)
    record = host.records["bad"]
    assert record.status == PluginStatus.FAILED
    assert "dspark_probe_devices" in record.reason and "RuntimeError" in record.reason and "boom" in record.reason
    assert "bad" not in host.active()
    assert [(f.hook, f.charged_to) for f in record.faults] == [("dspark_probe_devices", "plugin")]


def _call(host: PluginHost, hook: str, sub: Subgraph, device: object) -> object:
    if hook == "dspark_quantize":
        return host.call("bad", hook, subgraph=sub, device=device, spec=QuantSpec())
    return host.call("bad", hook, subgraph=sub, device=device)


@pytest.mark.parametrize("hook", ["dspark_bid", "dspark_compile", "dspark_quantize"])
def test_failure_is_charged_to_the_subgraph_signature_only(hook: str) -> None:
    host = bare_host()
    bad = RaisesIn(hook)
    host.register(bad, "bad")
    inv = probe(host)
    device = next(d for d in inv.drivers() if d.plugin == "bad")
    sub = relu_sub(2)
    assert _call(host, hook, sub, device) is None
    record = host.records["bad"]
    assert record.status == PluginStatus.ACTIVE and "bad" in host.active()
    [fault] = record.faults
    assert (fault.plugin, fault.hook, fault.subgraph, fault.device, fault.count, fault.charged_to) == (
        "bad", hook, sub.signature(), "cpu", 1, "subgraph")
    assert "RuntimeError" in fault.reason and "boom" in fault.reason and fault.ops == "Relu"
    # The same signature (a fresh Subgraph object) is not asked again ...
    assert _call(host, hook, relu_sub(2), device) is None
    assert bad.calls[hook] == 1
    # ... a different one is, and the plugin's other hooks keep working.
    _call(host, hook, relu_sub(5), device)
    assert bad.calls[hook] == 2
    if hook != "dspark_bid":
        # A failed compile (or quantize) ends the plugin's bids on that signature too ...
        assert host.call("bad", "dspark_bid", subgraph=sub, device=device) is None
        assert bad.calls["dspark_bid"] == 0
        # ... not on others.
        assert host.call("bad", "dspark_bid", subgraph=relu_sub(8), device=device) is not None
    # The reference still bids on the subgraph the plugin failed on.
    torch_dev = next(d for d in inv.drivers() if d.plugin == "torch")
    assert host.call("torch", "dspark_bid", subgraph=sub, device=torch_dev) is not None


def test_drafter_failure_is_charged_to_the_target_model() -> None:
    host = bare_host()
    bad = RaisesIn("dspark_drafters")
    host.register(bad, "bad")
    target = TargetModel(name="t", vocab_size=10, num_layers=1, hidden_size=8)
    first = collect_drafters(host, target)
    assert collect_drafters(host, target) == first
    assert bad.calls["dspark_drafters"] == 1  # not asked again for the same model
    [fault] = host.records["bad"].faults
    assert fault.subgraph == "model:t" and fault.hook == "dspark_drafters" and "boom" in fault.reason
    assert host.records["bad"].status == PluginStatus.ACTIVE
    collect_drafters(host, TargetModel(name="other", vocab_size=10, num_layers=1, hidden_size=8))
    assert bad.calls["dspark_drafters"] == 2


def test_repeated_failures_lose_the_device_then_the_plugin() -> None:
    host = bare_host(faults_per_device=2, faults_per_plugin=3)
    bad = RaisesIn("dspark_bid")
    host.register(bad, "bad")
    device = next(d for d in probe(host).drivers() if d.plugin == "bad")
    for rows in (1, 2):
        assert host.call("bad", "dspark_bid", subgraph=relu_sub(rows), device=device) is None
    record = host.records["bad"]
    assert [f.charged_to for f in record.faults] == ["device", "device"]
    assert record.status == PluginStatus.ACTIVE
    # A new subgraph on the lost device is not asked about.
    assert host.call("bad", "dspark_bid", subgraph=relu_sub(7), device=device) is None
    assert bad.calls["dspark_bid"] == 2
    # One more failure (here its executable's run) reaches the plugin limit.
    assert host.charge("bad", "run", "run raised RuntimeError: x", subgraph=relu_sub(9), device="cpu") == "plugin"
    assert record.status == PluginStatus.FAILED and "DSPARK_FAULTS_PER_PLUGIN=3" in record.reason
    assert "bad" not in host.active()
    assert {f.charged_to for f in record.faults} == {"plugin"} and host.fault_count("bad") == 3


def test_forgive_takes_a_failed_plugin_back() -> None:
    host = bare_host(faults_per_plugin=1)
    host.register(RaisesIn("dspark_bid"), "bad")
    device = next(d for d in probe(host).drivers() if d.plugin == "bad")
    host.call("bad", "dspark_bid", subgraph=relu_sub(), device=device)
    assert host.records["bad"].status == PluginStatus.FAILED
    host.forgive("bad")
    assert host.records["bad"].status == PluginStatus.ACTIVE and not host.records["bad"].faults
    assert host.call("bad", "dspark_compile", subgraph=relu_sub(), device=device) is None  # called again
    assert host.records["bad"].status == PluginStatus.ACTIVE


def test_fault_thresholds_come_from_the_environment() -> None:
    s = PluginSettings.from_env(env={"DSPARK_FAULTS_PER_DEVICE": "4", "DSPARK_FAULTS_PER_PLUGIN": "12"})
    assert (s.faults_per_device, s.faults_per_plugin) == (4, 12)
    d = PluginSettings.from_env(env={})
    assert (d.faults_per_device, d.faults_per_plugin) == (PluginSettings().faults_per_device,
                                                          PluginSettings().faults_per_plugin)
    with pytest.raises(ValueError, match="DSPARK_FAULTS_PER_DEVICE='many'"):
        PluginSettings.from_env(env={"DSPARK_FAULTS_PER_DEVICE": "many"})
    with pytest.raises(ValueError, match="DSPARK_FAULTS_PER_PLUGIN='0' must be at least 1"):
        PluginSettings.from_env(env={"DSPARK_FAULTS_PER_PLUGIN": "0"})


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
    fault = host.last_fault("wrong")
    assert rec.status == PluginStatus.ACTIVE and fault is not None and fault.charged_to == "subgraph"
    assert expect in fault.reason and hook in fault.reason and fault.hook == hook


def test_wrong_drafter_type_is_rejected() -> None:
    host = bare_host()
    host.register(WrongTypes(probe_value=None), "wrong")
    target = TargetModel(name="t", vocab_size=10, num_layers=1, hidden_size=8)
    offers = collect_drafters(host, target)
    assert {o.plugin for o in offers} == {"ngram"}  # the built-in lookups; the wrong offer is dropped
    fault = host.last_fault("wrong")
    assert fault is not None and "create" in fault.reason and fault.hook == "dspark_drafters"


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
    inv = probe(host)
    still_hung = not hang.returned.is_set()  # the probe came back without waiting for the hook
    hang.release.set()
    assert still_hung
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
    from dspark.sdk.reference.names import TORCH_KERNEL_OPS
    from dspark.sdk.reference.ops import KERNELS

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
    [fault] = host.records["flaky"].faults
    assert fault.hook == "dspark_bid" and "HardwareUnavailable" in fault.reason and "fell off the bus" in fault.reason
    assert host.records["flaky"].status == PluginStatus.ACTIVE


def test_hanging_bid_fails_the_whole_plugin() -> None:
    from bad_plugins import Good
    from dspark import hookimpl

    release = threading.Event()

    class HangsInBid(Good):
        @hookimpl
        def dspark_bid(self, subgraph: object, device: object) -> None:
            release.wait(30)

    host = bare_host()
    host.register(HangsInBid(), "slow")
    device = next(d for d in probe(host).drivers() if d.plugin == "slow")
    host.settings.timeout_override_s = 0.3
    try:
        assert host.call("slow", "dspark_bid", subgraph=relu_sub(), device=device) is None
    finally:
        release.set()
    rec = host.records["slow"]
    assert rec.status == PluginStatus.FAILED and "did not return within 0.3 s" in rec.reason
    assert rec.faults[0].charged_to == "plugin"


def test_trace_prints_every_hook_call_at_the_default_log_level(capsys: pytest.CaptureFixture[str]) -> None:
    host = bare_host(trace=True)
    host.register(RaisesIn("dspark_bid"), "bad")
    inv = probe(host)
    for d in inv.drivers():
        host.call(d.plugin, "dspark_bid", subgraph=relu_sub(), device=d)
    host.call("bad", "dspark_bid", subgraph=relu_sub(), device=next(d for d in inv.drivers() if d.plugin == "bad"))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("dspark.trace ")]
    assert any("plugin=torch hook=dspark_probe_devices" in ln and "outcome=ok" in ln for ln in lines)
    assert any("plugin=torch hook=dspark_bid" in ln and "outcome=ok" in ln for ln in lines)
    assert any("plugin=bad hook=dspark_bid" in ln and "outcome=raised" in ln and "boom" in ln for ln in lines)
    assert any("plugin=bad hook=dspark_bid" in ln and "outcome=skipped" in ln for ln in lines)
    assert all(" ms=" in ln for ln in lines)
