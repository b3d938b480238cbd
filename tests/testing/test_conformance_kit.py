"""The conformance kit passes the built-in plugins and catches broken ones, as findings."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dspark import hookimpl
from dspark.builtin import torch_ref
from dspark.graph.model import Subgraph
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.testing import PluginConformance, check_plugin, op_cases, reference_outputs
from dspark.types import Bid, Device, Draft, DrafterSpec, TargetModel

ALL_CASES = {c.name for c in op_cases()}


def test_op_cases_are_small_deterministic_and_annotated() -> None:
    cases = op_cases()
    assert len(cases) >= 30
    covered = {op.op_type for c in cases for op in c.graph.ops}
    assert {"Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Exp", "Softmax",
            "LayerNormalization", "MatMul", "Gemm", "Conv", "MaxPool", "GlobalAveragePool", "Reshape",
            "Transpose", "Concat", "Gather", "Slice", "ReduceMean", "Unsqueeze", "Flatten", "Cast", "Where",
            "Pow"} <= covered
    for case in cases:
        sg = case.graph.subgraph()
        assert sorted(case.inputs) == sorted(sg.inputs), case.name
        assert all(case.graph.tensors[t].is_static for t in sg.outputs), case.name
        assert sum(a.size for a in case.inputs.values()) < 1000, case.name
    mlp = next(c for c in cases if c.name == "chain_mlp")
    assert mlp.graph.subgraph().flops > 0  # costs were annotated by the ONNX importer
    # Same data in a fresh build: each case's RNG is seeded from its name.
    from dspark.testing import op_cases as again
    assert all(np.array_equal(a.inputs[k], b.inputs[k]) for a, b in zip(cases, again(), strict=True) for k in a.inputs)


def test_reference_outputs_have_the_declared_shapes() -> None:
    for case in op_cases():
        out = reference_outputs(case)
        assert list(out) == case.graph.subgraph().outputs
        for name, arr in out.items():
            assert arr.shape == case.graph.tensors[name].shape, case.name


def test_torch_plugin_passes_everything_including_quantize() -> None:
    report = check_plugin("torch")
    assert report.ok, report.summary(only_problems=True)
    assert set(report.cases()) == ALL_CASES
    quant = [r for r in report.results if r.check == "quantize int8"]
    assert quant and all(r.ok and not r.skipped for r in quant), report.summary()
    assert "PASS" in report.summary() and "chain_attention" in report.summary()


def test_ngram_plugin_passes_its_drafter_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # The user's environment must not hide the plugin under test.
    monkeypatch.setenv("DSPARK_PLUGINS", "no:ngram")
    report = check_plugin("ngram")
    assert report.ok, report.summary()
    drafters = [r for r in report.results if r.check == "drafter proposes"]
    assert [r.case for r in drafters] == ["prompt-lookup", "suffix-lookup"] and all(r.ok for r in drafters)


def test_summary_names_the_plugin_checked() -> None:
    report = check_plugin("torch", cases=[])
    assert report.summary().startswith("conformance of plugin 'torch': ")
    assert report.summary(only_problems=True).startswith("conformance of plugin 'torch': ")


def test_unknown_plugin_is_a_finding() -> None:
    report = check_plugin("no-such-plugin")
    assert not report.ok
    assert "no plugin named 'no-such-plugin'" in report.failures[0].detail


# -- deliberately broken plugins, built on the torch reference ---------------------------------


class IdentityRelu:
    """Correct everywhere except Relu, which hands back its input unchanged."""

    DSPARK_API_VERSION = "1.0"

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [d for d in torch_ref.dspark_probe_devices(refresh) if d.id == "cpu"]

    @hookimpl
    def dspark_bid(self, subgraph: Subgraph, device: Device) -> Bid | None:
        return torch_ref.dspark_bid(subgraph, device)

    @hookimpl
    def dspark_compile(self, subgraph: Subgraph, device: Device) -> Any:
        exe = torch_ref.TorchExecutable(subgraph, device.id)
        exe.steps = [(op, (lambda a, x: [x[0]]) if op.op_type == "Relu" else fn) for op, fn in exe.steps]
        return exe


class LongDrafter:
    def propose(self, tokens: list[int], k: int) -> Draft:
        return Draft(tokens=[1] * (k + 1))


class Misbehaving(IdentityRelu):
    """Raises in compile for Softmax, bids nonsense for Tanh and Exp, drafts too many tokens."""

    @hookimpl
    def dspark_bid(self, subgraph: Subgraph, device: Device) -> Any:
        bid = torch_ref.dspark_bid(subgraph, device)
        kinds = {op.op_type for op in subgraph.ops}
        if bid is not None and kinds == {"Tanh"}:
            bid.latency_s = float("inf")  # validates, but is no prediction
        if bid is not None and kinds == {"Exp"}:
            return {"device_id": device.id, "runtime": "x", "latency_s": -1.0, "peak_memory_bytes": 0,
                    "precision": "float32"}
        return bid

    @hookimpl
    def dspark_compile(self, subgraph: Subgraph, device: Device) -> Any:
        if any(op.op_type == "Softmax" for op in subgraph.ops):
            raise RuntimeError("softmax kernel not written yet")
        return torch_ref.TorchExecutable(subgraph, device.id)

    @hookimpl
    def dspark_drafters(self, target: TargetModel) -> list[DrafterSpec]:
        return [DrafterSpec(name="too-long", kind="other", create=LongDrafter)]


def _host(plugin: object, name: str) -> PluginHost:
    host = PluginHost(PluginSettings(autoload=False))
    record = host.register(plugin, name)
    assert record.status.value == "active", record.reason
    return host


def test_wrong_relu_fails_naming_the_op() -> None:
    report = check_plugin("broken", _host(IdentityRelu(), "broken"))
    assert not report.ok
    failing = {(r.check, r.case) for r in report.failures}
    # Exactly the cases that contain a Relu, and nothing else.
    assert failing == {("matches reference", c) for c in ("Relu", "chain_mlp", "chain_conv_relu_maxpool")}
    chain = next(r for r in report.failures if r.case == "chain_mlp")
    assert "Relu" in chain.detail and "max abs err" in chain.detail
    assert set(report.cases()) == ALL_CASES - {"Relu", "chain_mlp", "chain_conv_relu_maxpool"}
    assert "FAIL" in report.summary(only_problems=True) and "Relu" in report.summary(only_problems=True)


def test_raising_and_invalid_hooks_are_findings_not_exceptions() -> None:
    host = _host(Misbehaving(), "misbehaving")
    report = check_plugin("misbehaving", host)
    failing = {(r.check, r.case) for r in report.failures}
    assert failing == {
        ("bid well-formed", "Tanh"), ("bid well-formed", "Exp"),
        ("matches reference", "Softmax"), ("matches reference", "chain_attention"),
        ("drafter proposes", "too-long"),
    }, report.summary(only_problems=True)
    details = {(r.check, r.case): r.detail for r in report.failures}
    assert "RuntimeError: softmax kernel not written yet" in details[("matches reference", "Softmax")]
    assert "not finite" in details[("bid well-formed", "Tanh")]
    assert "latency_s" in details[("bid well-formed", "Exp")]
    assert "more than k=0" in details[("drafter proposes", "too-long")]
    # One raising op does not take the rest down: the kit re-admits the plugin.
    assert {"LayerNormalization", "chain_mlp", "Tanh"} <= set(report.cases())
    assert host.records["misbehaving"].status.value == "active"


def test_pytest_base_class_turns_findings_into_failures_and_skips() -> None:
    host = _host(IdentityRelu(), "broken2")

    class TestBroken(PluginConformance):
        plugin = "broken2"

        def make_host(self) -> PluginHost:
            return host

    suite = TestBroken()
    suite.test_registered_and_active()
    suite.test_probe_valid_idempotent_fast()
    suite.test_bids_well_formed()
    suite.test_op_matches_reference("Add")
    with pytest.raises(pytest.fail.Exception, match="Relu") as failed:
        suite.test_op_matches_reference("Relu")
    # The failure's report names the plugin it checked (it once printed "conformance of plugin ''").
    assert "conformance of plugin 'broken2': 0 passed, 1 failed" in str(failed.value)
    with pytest.raises(pytest.skip.Exception, match="not implemented"):
        suite.test_quantize()
    with pytest.raises(pytest.skip.Exception, match="not implemented"):
        suite.test_drafters()


def test_kit_runs_onnx_node_tests_of_the_op_types_a_plugin_bids_on() -> None:
    from dspark.testing.kit import ConformanceKit
    from dspark.testing.node_kit import CHECK, check_onnx_nodes, single_op_cases

    relu_cases = {c.name for c in single_op_cases({"Relu"})["Relu"]}
    kit = ConformanceKit("broken", _host(IdentityRelu(), "broken"))
    results = check_onnx_nodes(kit, per_op=None, op_types={"Relu", "Sigmoid", "Shape"})
    failing = {r.case for r in results if not r.ok}
    assert failing == relu_cases and all(r.check == CHECK for r in results)
    assert all("Relu: wrong" in r.detail for r in results if not r.ok)
    passed = {r.case for r in results if r.ok and not r.skipped}
    assert {"test_sigmoid", "test_shape"} <= passed
    # The per-op sample: at most per_op cases of each op type the plugin bid on.
    sample = check_onnx_nodes(ConformanceKit("torch"), per_op=1, op_types={"Shape"})
    assert len([r for r in sample if r.ok and not r.skipped]) == 1
