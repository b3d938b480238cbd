"""ONNX's backend node tests through the torch reference and the example NumPy plugin: every bid is kept.

The whole suite (every non-random case of ``onnx.backend.test.case.node``)
runs through each plugin as a forced single-target plan; a wrong answer or a
bid that then fails is a broken promise and fails the test, naming the cases.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest

from dspark import hookimpl
from dspark.builtin import torch_ref
from dspark.graph.model import Subgraph
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.testing.onnx_node import (
    RANDOM_CASES, PluginNotTestable, broken_promises, counts, import_case, is_random, node_cases, run_node_suite,
)
from dspark.types import Bid, Device

REPO = Path(__file__).resolve().parents[2]
RECORDED = json.loads((REPO / "docs" / "onnx-node-conformance.json").read_text())
sys.path.insert(0, str(REPO / "plugins" / "dspark-numpy" / "src"))
import dspark_numpy  # noqa: E402


def _host(plugin: object, name: str) -> PluginHost:
    host = PluginHost(PluginSettings(autoload=False))
    record = host.register(plugin, name)
    assert record.status.value == "active", record.reason
    return host


def _assert_recorded(plugin: str, results: list[Any]) -> None:
    """The counts docs/onnx-node-conformance.json records are the ones this onnx gives now."""
    if RECORDED["onnx_version"] != onnx.__version__:
        pytest.skip(f"counts recorded with onnx {RECORDED['onnx_version']}, installed {onnx.__version__}")
    assert RECORDED["plugins"][plugin]["counts"] == counts(results), (
        f"refresh docs/onnx-node-conformance.json and .md (command in the .md) for plugin {plugin!r}")


def _assert_kept(results: list[Any]) -> None:
    broken = broken_promises(results)
    assert not broken, f"{len(broken)} broken promises:\n" + "\n".join(
        f"  {r.outcome} {r.case} [{','.join(r.op_types)}]: {r.detail[:300]}" for r in broken)


def test_suite_is_onnx_node_tests_without_the_random_ones() -> None:
    everything = node_cases(include_random=True)
    kept = node_cases()
    assert len(everything) > 1500  # the installed onnx's generators, all of them
    left_out = {c.name for c in everything} - {c.name for c in kept}
    assert RANDOM_CASES <= left_out
    assert {"test_bernoulli", "test_bernoulli_seed"} <= left_out
    assert all(is_random(c.name, c.op_types) for c in everything if c.name in left_out)
    assert "test_training_dropout_zero_ratio" in {c.name for c in kept}  # ratio 0: deterministic
    # Inputs are drawn from a seeded generator: the same data every time.
    relu = next(c for c in kept if c.name == "test_relu")
    assert relu.inputs[0].shape == (3, 4, 5) and len(relu.outputs) == 1


def test_graph_model_limits_are_reported_not_charged() -> None:
    strings = next(c for c in node_cases() if c.name == "test_ai_onnx_ml_label_encoder_string_int")
    graph, why = import_case(strings)
    assert graph is None and "cannot represent" in why
    graph, why = import_case(next(c for c in node_cases() if c.name == "test_relu"))
    assert graph is not None and why == ""


def test_torch_reference_keeps_every_bid() -> None:
    results = run_node_suite("torch")
    _assert_kept(results)
    tally = counts(results)
    assert tally["pass"] > 1400, tally  # it bids on nearly everything the graph model holds
    assert tally["pass"] + tally["abstain"] + tally["unsupported"] == len(node_cases())
    _assert_recorded("torch", results)


def test_numpy_example_plugin_keeps_every_bid() -> None:
    results = run_node_suite("numpy", host=_host(dspark_numpy, "numpy"))
    _assert_kept(results)
    assert counts(results)["pass"] > 20  # its dozen float32 ops
    _assert_recorded("numpy", results)


def test_respects_the_models_opset() -> None:
    # Ops whose meaning changed between opsets: the old forms run as the old opset said.
    names = {"test_clip_default_inbounds", "test_split_variable_parts_1d_opset13",
             "test_split_variable_parts_1d_opset18", "test_softmax_default_axis", "test_flatten_negative_axis1",
             "test_reduce_sum_keepdims_example", "test_squeeze_negative_axes", "test_pow_types_int32_float32"}
    results = run_node_suite("torch", names=names)
    assert {r.case for r in results} == names
    assert all(r.outcome == "pass" for r in results), [(r.case, r.outcome, r.detail) for r in results]


def test_control_flow_runs_through_the_reference_fallback() -> None:
    # If, Loop and Scan are imported whole with their bodies; the reference runs them through
    # onnx.reference and abstains where onnx.reference itself gets them wrong.
    passes = {"test_if", "test_loop11", "test_scan9_sum", "test_scan9_multi_state", "test_affine_grid_2d_expanded",
              "test_linear_attention_linear_expanded"}
    abstains = {"test_scan_sum",  # Scan-8: onnx.reference fails on it
                "test_range_float_type_positive_delta_expanded"}  # scalar Loop scan outputs, stacked (N, 1)
    results = run_node_suite("torch", names=passes | abstains)
    outcome = {r.case: r.outcome for r in results}
    assert outcome == {**dict.fromkeys(passes, "pass"), **dict.fromkeys(abstains, "abstain")}, [
        (r.case, r.outcome, r.detail[:200]) for r in results]
    graph, _ = import_case(next(c for c in node_cases() if c.name == "test_loop11"))
    assert graph is not None and [op.op_type for op in graph.ops] == ["Loop"]


class WrongAndBroken:
    """Bids like the reference; Relu answers with its input, Abs fails to compile."""

    DSPARK_API_VERSION = "1.0"

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [d for d in torch_ref.dspark_probe_devices(refresh) if d.id == "cpu"]

    @hookimpl
    def dspark_bid(self, subgraph: Subgraph, device: Device) -> Bid | None:
        if {op.op_type for op in subgraph.ops} == {"Neg"}:
            return None
        return torch_ref.dspark_bid(subgraph, device)

    @hookimpl
    def dspark_compile(self, subgraph: Subgraph, device: Device) -> Any:
        kinds = {op.op_type for op in subgraph.ops}
        if kinds == {"Abs"}:
            raise RuntimeError("no Abs kernel yet")
        exe = torch_ref.TorchExecutable(subgraph, device.id)
        exe.steps = [(op, (lambda a, x: [x[0]]) if op.op_type == "Relu" else fn) for op, fn in exe.steps]
        return exe


def test_a_wrong_answer_and_a_failed_bid_are_caught() -> None:
    results = run_node_suite("bad", host=_host(WrongAndBroken(), "bad"), names={"test_relu", "test_abs", "test_neg",
                                                                                   "test_sigmoid"})
    outcome = {r.case: r.outcome for r in results}
    assert outcome == {"test_relu": "wrong", "test_abs": "failed", "test_neg": "abstain", "test_sigmoid": "pass"}
    failed = next(r for r in results if r.case == "test_abs")
    assert "no Abs kernel yet" in failed.detail
    assert {r.case for r in broken_promises(results)} == {"test_relu", "test_abs"}


def test_a_plugin_that_is_not_loaded_is_not_testable() -> None:
    with pytest.raises(PluginNotTestable, match="no-such-plugin"):
        run_node_suite("no-such-plugin")
