"""Torch kernels of the reference backend against ONNX's own reference evaluator."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from dspark.builtin.torch_ops import KERNELS

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
