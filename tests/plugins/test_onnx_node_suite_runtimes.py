"""ONNX's own backend node tests through the ``cpu`` (OpenVINO) and ``npu`` (ONNX Runtime) plugins.

Every bid must be a kept promise: a case is passed or abstained from, never
answered wrong and never bid on then failed. The full suite runs with
``scripts/onnx_node_conformance.py cpu npu`` (counts in
docs/onnx-node-conformance.md); here a deterministic subset that covers every
op type: for each op type its first and last case by name, plus every one of
the cases a support rule abstains on (without its rule, a plugin would bid
there and break the promise, so each rule is seen to hold).
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("openvino")
pytest.importorskip("onnxruntime")

from dspark.graph import Graph
from dspark.testing.onnx_node import (
    broken_promises,
    counts,
    import_case,
    node_cases,
    run_node_suite,
)
from dspark.types import Device

from dspark_plugins_cpu import defects
from dspark_plugins_npu import support as npu_support


@functools.lru_cache(maxsize=1)
def first_and_last() -> frozenset[str]:
    """For each op type its first and last case by name."""
    by_op: dict[str, list[str]] = {}
    for case in node_cases():
        for op in case.op_types:
            by_op.setdefault(op, []).append(case.name)
    return frozenset(name for cases in by_op.values() for name in (cases[0], cases[-1]))


@functools.lru_cache(maxsize=1)
def ruled() -> frozenset[str]:
    """Every case a support rule of either plugin abstains on: without its rule, the plugin would bid there
    and break the promise."""
    names = set()
    for case in node_cases():
        graph, _ = import_case(case)
        if graph is not None and (defects.known_defect(graph.subgraph()) or npu_support.known_defect(graph.subgraph())):
            names.add(case.name)
    return frozenset(names)


@pytest.mark.parametrize("plugin", ["cpu", "npu"])
def test_every_bid_on_onnx_node_cases_is_kept(plugin: str) -> None:
    names = sorted(first_and_last() | ruled())
    results = run_node_suite(plugin, names=names)
    assert [r.case for r in results] == names
    broken = broken_promises(results)
    assert not broken, f"{plugin} broke {len(broken)} promises:\n" + "\n".join(
        f"  {r.outcome} {r.case} [{','.join(r.op_types)}]: {r.detail}" for r in broken)
    # Abstaining from everything would keep every promise: the plugin must still run most of the
    # sample that no rule refuses and the graph model can hold.
    sample = [r for r in results if r.case in first_and_last() - ruled() and r.outcome != "unsupported"]
    tally = counts(sample)
    assert tally["pass"] > len(sample) // 2, tally


# Control flow each runtime runs whole (and what it abstains from: OpenVINO's Scan over outer values,
# ONNX Runtime's opset 27).
CONTROL_FLOW = {
    "npu": ({"test_if", "test_loop11", "test_scan9_sum", "test_scan_sum", "test_affine_grid_2d_expanded"},
            {"test_linear_attention_linear_expanded", "test_range_float_type_positive_delta_expanded"}),
    "cpu": ({"test_if", "test_loop11", "test_scan9_sum", "test_scan_sum",
             "test_range_float_type_positive_delta_expanded"},
            {"test_linear_attention_explicit_scale_expanded", "test_affine_grid_2d_expanded"}),
}


@pytest.mark.parametrize("plugin", sorted(CONTROL_FLOW))
def test_control_flow_node_cases(plugin: str) -> None:
    passes, abstains = CONTROL_FLOW[plugin]
    results = run_node_suite(plugin, names=passes | abstains)
    outcome = {r.case: r.outcome for r in results}
    assert outcome == {**dict.fromkeys(passes, "pass"), **dict.fromkeys(abstains, "abstain")}, [
        (r.case, r.outcome, r.detail[:200]) for r in results]


def _scalar_model() -> onnx.ModelProto:
    # Pow of a [3] tensor by a 0-d exponent, and a 0-d output: a 0-d array must reach the runtime as 0-d.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    e = helper.make_tensor_value_info("e", TensorProto.FLOAT, [])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    nodes = [helper.make_node("Pow", ["x", "e"], ["y"]), helper.make_node("Identity", ["e"], ["s"])]
    graph = helper.make_graph(nodes, "scalar", [x, e], [y, s])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("plugin", ["cpu", "npu"])
def test_zero_dim_inputs_and_outputs_keep_their_shape(plugin: str) -> None:
    mod = importlib.import_module(f"dspark_plugins_{plugin}")
    device = next(d for d in mod.dspark_probe_devices(refresh=False) if isinstance(d, Device) and d.kind == "cpu")
    sg = Graph.from_onnx(_scalar_model()).subgraph()
    assert mod.dspark_bid(subgraph=sg, device=device) is not None
    out = mod.dspark_compile(subgraph=sg, device=device).run(
        {"x": np.array([1.0, 2.0, 3.0], np.float32), "e": np.array(2.0, np.float32)})
    assert out["s"].shape == ()
    np.testing.assert_allclose(out["y"], [1.0, 4.0, 9.0])


# Cases a user running ONNX's node tests through load_model and compile_plan(...).run once saw broken
# (issue 32): scalar Clip bounds and float Range on OpenVINO, the window ops and OneHot on torch,
# DFT's axis input and tolerance, functions expanded with Constants nobody reads (a plan made them
# partitions of their own, which ONNX Runtime refused to compile).
USER_PATH = {
    "test_clip_example", "test_clip_default_int8_min", "test_clip_default_inbounds",
    "test_range_float_type_positive_delta", "test_blackmanwindow", "test_hammingwindow", "test_hannwindow",
    "test_melweightmatrix", "test_onehot_with_axis", "test_dft", "test_dft_axis", "test_scan9_sum",
    "test_rotary_embedding_expanded", "test_attention_4d_expanded", "test_attention_3d_gqa_expanded",
}
DEAD_CONSTANTS = {"test_rotary_embedding_expanded", "test_attention_4d_expanded", "test_attention_3d_gqa_expanded"}


@pytest.mark.parametrize("plugin", ["cpu", "npu", "torch"])
def test_node_cases_once_broken_on_the_users_path_are_kept(plugin: str) -> None:
    results = run_node_suite(plugin, names=USER_PATH)
    assert {r.case for r in results} == USER_PATH
    broken = broken_promises(results)
    assert not broken, [(r.case, r.outcome, r.detail[:300]) for r in broken]
    outcome = {r.case: r.outcome for r in results}
    # Each runs these expanded functions once their dead Constants are gone (OpenVINO abstains on
    # the expanded Attention for its own reasons).
    runs = DEAD_CONSTANTS if plugin != "cpu" else {"test_rotary_embedding_expanded"}
    assert {outcome[n] for n in runs} == {"pass"}, outcome
