"""Torch kernels of the reference backend against ONNX's own reference evaluator."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from dspark.sdk.reference.ops import KERNELS

RNG = np.random.default_rng(0)
D = RNG.standard_normal((2, 3, 4)).astype(np.float32)

CASES: list[tuple[str, list[np.ndarray], dict[str, Any]]] = [
    ("GatherND", [D, np.array([[0, 1], [1, 2]], np.int64)], {}),
    ("GatherND", [D, np.array([[1], [2]], np.int64)], {"batch_dims": 1}),
    ("GatherElements", [D, RNG.integers(-3, 3, (2, 3, 4)).astype(np.int64)], {"axis": 1}),
    ("Tile", [D, np.array([1, 2, 1], np.int64)], {}),
    ("Trilu", [D, np.array(1, np.int64)], {"upper": 0}),
    ("CumSum", [D, np.array(2, np.int64)], {"exclusive": 1, "reverse": 1}),
    ("Slice", [D, np.array([3], np.int64), np.array([0], np.int64), np.array([2], np.int64),
               np.array([-2], np.int64)], {}),
    ("Gather", [D, np.array([[0, -1]], np.int64)], {"axis": 2}),
    ("Split", [D, np.array([1, 3], np.int64)], {"axis": 2}),
    ("Expand", [D[:, :1], np.array([2, 5, 4], np.int64)], {}),
]


@pytest.mark.parametrize("op,inputs,attrs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_kernel_matches_onnx_reference(op: str, inputs: list[np.ndarray], attrs: dict[str, Any]) -> None:
    names = [f"i{k}" for k in range(len(inputs))]
    n_out = 2 if op == "Split" else 1
    outs = [f"y{k}" for k in range(n_out)]
    node = helper.make_node(op, names, outs, **attrs)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in zip(names, inputs, strict=True)],
        [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    expected = ReferenceEvaluator(model).run(None, dict(zip(names, inputs, strict=True)))
    got = KERNELS[op]({**attrs, "_num_outputs": n_out}, [torch.from_numpy(v) for v in inputs])
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-6)


# Ops whose meaning changed between opsets, in their old form: the torch reference
# (kernel or onnx.reference fallback) must follow the model's opset.
X3 = RNG.standard_normal((2, 3, 4)).astype(np.float32)
OLD_OPSET: list[tuple[str, int, list[np.ndarray], dict[str, Any], int]] = [
    ("Clip", 6, [X3], {"min": -0.5, "max": 0.5}, 1),
    ("Softmax", 11, [X3], {"axis": 1}, 1),  # flattens to 2-D at axis before opset 13
    ("LogSoftmax", 11, [X3], {}, 1),
    ("Slice", 9, [X3], {"starts": [1], "ends": [3], "axes": [2]}, 1),
    ("Split", 11, [X3], {"axis": 2, "split": [1, 3]}, 2),
    ("ReduceSum", 11, [X3], {"axes": [1], "keepdims": 0}, 1),
    ("ReduceMean", 17, [X3], {"axes": [-1]}, 1),
    ("Unsqueeze", 11, [X3], {"axes": [0, 4]}, 1),
    ("Squeeze", 11, [X3[:1]], {"axes": [0]}, 1),
    ("Pad", 10, [X3], {"pads": [0, 1, 0, 0, 1, 0], "mode": "constant", "value": 2.0}, 1),
    ("Upsample", 9, [X3[None], np.array([1, 1, 2, 2], np.float32)], {"mode": "nearest"}, 1),
]


def _one_node_model(op: str, opset: int, inputs: list[np.ndarray], attrs: dict[str, Any], n_out: int) -> Any:
    names = [f"i{k}" for k in range(len(inputs))]
    node = helper.make_node(op, names, [f"y{k}" for k in range(n_out)], **attrs)
    graph = helper.make_graph(
        [node], f"{op}_{opset}",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in zip(names, inputs, strict=True)],
        [helper.make_tensor_value_info(f"y{k}", TensorProto.UNDEFINED, None) for k in range(n_out)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    return model, dict(zip(names, inputs, strict=True))


@pytest.mark.parametrize("op,opset,inputs,attrs,n_out", OLD_OPSET, ids=[f"{c[0]}-opset{c[1]}" for c in OLD_OPSET])
def test_reference_follows_the_models_opset(op: str, opset: int, inputs: list[np.ndarray], attrs: dict[str, Any],
                                            n_out: int) -> None:
    from dspark.sdk.reference.executable import TorchExecutable
    from dspark.graph.model import Graph

    model, feeds = _one_node_model(op, opset, inputs, attrs, n_out)
    if op in ("Softmax", "LogSoftmax"):
        # onnx.reference applies opset 13's per-axis form at every opset; the spec's own words instead.
        flat = inputs[0].reshape(int(np.prod(inputs[0].shape[:attrs.get("axis", 1)])), -1).astype(np.float64)
        e = np.exp(flat - flat.max(axis=1, keepdims=True))
        soft = e / e.sum(axis=1, keepdims=True)
        expected = [(soft if op == "Softmax" else np.log(soft)).reshape(inputs[0].shape).astype(np.float32)]
    else:
        expected = ReferenceEvaluator(model).run(None, feeds)
    graph = Graph.from_onnx(model)
    assert graph.opset == opset
    got = TorchExecutable(graph.subgraph(), "cpu").run(feeds)
    for name, e in zip(graph.outputs, expected, strict=True):
        assert got[name].shape == e.shape, name
        np.testing.assert_allclose(got[name], e, rtol=1e-5, atol=1e-6)


def test_support_check_abstains_on_dtypes_torch_does_not_hold() -> None:
    from dspark.sdk.reference.support import kernel_problem, subgraph_problem
    from dspark.graph.model import Graph

    model, _ = _one_node_model("Cast", 21, [X3], {"to": TensorProto.INT4}, 1)
    graph = Graph.from_onnx(model)
    assert "int4" in (subgraph_problem(graph.subgraph()) or "")
    model, _ = _one_node_model("Relu", 17, [X3], {}, 1)
    graph = Graph.from_onnx(model)
    assert subgraph_problem(graph.subgraph()) is None and kernel_problem(graph.ops[0], graph) is None
    # A node the kernel does not cover runs via onnx.reference, on the host only.
    model, _ = _one_node_model("MaxPool", 17, [X3[None]], {"kernel_shape": [2, 2], "auto_pad": "SAME_UPPER"}, 1)
    graph = Graph.from_onnx(model)
    assert kernel_problem(graph.ops[0], graph) == "auto_pad=SAME_UPPER"
    assert subgraph_problem(graph.subgraph()) is None
    # onnx.reference knows only the newer Resize: the old form is abstained on, not run wrongly.
    model, _ = _one_node_model("Resize", 10, [X3[None], np.array([1, 1, 2, 2], np.float32)], {"mode": "nearest"}, 1)
    assert "opset 10" in (subgraph_problem(Graph.from_onnx(model).subgraph()) or "")
