"""Small generated ONNX subgraphs a backend is checked on, single ops and short chains.

Every case is tiny (it runs in milliseconds), deterministic (one seeded RNG
per case, so adding a case never changes another's data), built with
``onnx.helper`` at opset 17 and imported through :meth:`dspark.graph.model.Graph.from_onnx`
so its shapes and FLOPs are annotated exactly as a real model's would be.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from dspark.graph.model import Graph

OPSET = 17
F32 = TensorProto.FLOAT


@dataclass(frozen=True)
class OpCase:
    """One conformance case: a graph (run whole, as one subgraph) and its input arrays."""

    name: str
    graph: Graph
    inputs: dict[str, np.ndarray] = field(repr=False)

    @property
    def op_types(self) -> list[str]:
        return [op.op_type for op in self.graph.ops]


def _rng(name: str) -> np.random.Generator:
    # Seeded from the case name (crc32 is stable across runs, unlike hash()).
    return np.random.default_rng(zlib.crc32(name.encode()))


class _Builder:
    """Collects nodes, inputs and initializers for one case."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rng = _rng(name)
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.inits: list[onnx.TensorProto] = []

    def randn(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(np.float32)

    def input(self, name: str, value: np.ndarray) -> str:
        dtype = helper.np_dtype_to_tensor_dtype(value.dtype)
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(value.shape)))
        self.feeds[name] = value
        return name

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op_type: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output

    def build(self, outputs: list[str]) -> OpCase:
        # Output types are left for shape inference to fill in.
        graph = helper.make_graph(self.nodes, self.name, self.inputs,
                                  [helper.make_empty_tensor_value_info(o) for o in outputs],
                                  initializer=self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="dspark.testing")
        model.ir_version = 8
        # Strict inference types the outputs and rejects a malformed case early.
        model = shape_inference.infer_shapes(model, strict_mode=True)
        onnx.checker.check_model(model)
        return OpCase(name=self.name, graph=Graph.from_onnx(model, name=self.name), inputs=self.feeds)


def _binary(op: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], b_init: bool = False) -> Callable[[], OpCase]:
    def make() -> OpCase:
        b = _Builder(op)
        x = b.input("a", b.randn(*a_shape))
        rhs = b.randn(*b_shape)
        if op == "Div":  # keep the denominator away from zero: the error bound is relative
            rhs = (np.sign(rhs) * (0.5 + np.abs(rhs))).astype(np.float32)
        y = b.init("b", rhs) if b_init else b.input("b", rhs)
        return b.build([b.node(op, [x, y], "y")])
    return make


def _unary(op: str, positive: bool = False, **attrs: Any) -> Callable[[], OpCase]:
    def make() -> OpCase:
        b = _Builder(op)
        v = b.randn(2, 3, 8)
        if positive:
            v = (np.abs(v) + 0.1).astype(np.float32)
        return b.build([b.node(op, [b.input("x", v)], "y", **attrs)])
    return make


def _layernorm() -> OpCase:
    b = _Builder("LayerNormalization")
    x = b.input("x", b.randn(2, 4, 16))
    scale = b.init("gamma", 1.0 + b.randn(16, scale=0.1))
    bias = b.init("beta", b.randn(16, scale=0.1))
    return b.build([b.node("LayerNormalization", [x, scale, bias], "y", axis=-1, epsilon=1e-5)])


def _matmul_2d() -> OpCase:
    b = _Builder("MatMul_2d")
    x = b.input("x", b.randn(4, 16))
    w = b.init("W", b.randn(16, 8, scale=0.25))
    return b.build([b.node("MatMul", [x, w], "y")])


def _matmul_batched() -> OpCase:
    b = _Builder("MatMul_batched")
    x = b.input("a", b.randn(2, 4, 8))
    y = b.input("b", b.randn(2, 8, 5))
    return b.build([b.node("MatMul", [x, y], "y")])


def _gemm() -> OpCase:
    b = _Builder("Gemm")
    x = b.input("x", b.randn(4, 16))
    w = b.init("W", b.randn(8, 16, scale=0.25))  # (N, K): transB=1, as torch.nn.Linear stores it
    c = b.init("bias", b.randn(8, scale=0.1))
    return b.build([b.node("Gemm", [x, w, c], "y", transB=1)])


def _conv() -> OpCase:
    b = _Builder("Conv")
    x = b.input("x", b.randn(1, 3, 9, 9))
    w = b.init("W", b.randn(4, 3, 3, 3, scale=0.3))
    c = b.init("B", b.randn(4, scale=0.1))
    return b.build([b.node("Conv", [x, w, c], "y", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])])


def _maxpool() -> OpCase:
    b = _Builder("MaxPool")
    x = b.input("x", b.randn(1, 2, 6, 6))
    return b.build([b.node("MaxPool", [x], "y", kernel_shape=[2, 2], strides=[2, 2])])


def _gap() -> OpCase:
    b = _Builder("GlobalAveragePool")
    return b.build([b.node("GlobalAveragePool", [b.input("x", b.randn(1, 3, 5, 5))], "y")])


def _reshape() -> OpCase:
    b = _Builder("Reshape")
    x = b.input("x", b.randn(2, 3, 4))
    shape = b.init("shape", np.array([4, -1], dtype=np.int64))
    return b.build([b.node("Reshape", [x, shape], "y")])


def _transpose() -> OpCase:
    b = _Builder("Transpose")
    return b.build([b.node("Transpose", [b.input("x", b.randn(2, 3, 4))], "y", perm=[0, 2, 1])])


def _concat() -> OpCase:
    b = _Builder("Concat")
    x = b.input("a", b.randn(2, 3, 4))
    y = b.input("b", b.randn(2, 2, 4))
    return b.build([b.node("Concat", [x, y], "y", axis=1)])


def _gather() -> OpCase:
    # An embedding lookup: int64 indices in, rows of a weight table out.
    b = _Builder("Gather")
    table = b.init("table", b.randn(10, 6))
    idx = b.input("ids", np.array([[0, 3, 9], [7, 3, 1]], dtype=np.int64))
    return b.build([b.node("Gather", [table, idx], "y", axis=0)])


def _slice() -> OpCase:
    b = _Builder("Slice")
    x = b.input("x", b.randn(4, 6))
    starts = b.init("starts", np.array([1, 0], dtype=np.int64))
    ends = b.init("ends", np.array([3, 6], dtype=np.int64))
    axes = b.init("axes", np.array([0, 1], dtype=np.int64))
    steps = b.init("steps", np.array([1, 2], dtype=np.int64))
    return b.build([b.node("Slice", [x, starts, ends, axes, steps], "y")])


def _reduce_mean() -> OpCase:
    b = _Builder("ReduceMean")  # opset 17: axes is still an attribute
    return b.build([b.node("ReduceMean", [b.input("x", b.randn(2, 3, 8))], "y", axes=[-1], keepdims=1)])


def _unsqueeze() -> OpCase:
    b = _Builder("Unsqueeze")
    x = b.input("x", b.randn(3, 4))
    return b.build([b.node("Unsqueeze", [x, b.init("axes", np.array([1], dtype=np.int64))], "y")])


def _flatten() -> OpCase:
    b = _Builder("Flatten")
    return b.build([b.node("Flatten", [b.input("x", b.randn(2, 3, 4))], "y", axis=1)])


def _cast() -> OpCase:
    b = _Builder("Cast")
    x = b.input("x", b.rng.integers(-50, 50, size=(3, 4)).astype(np.int64))
    return b.build([b.node("Cast", [x], "y", to=int(F32))])


def _where() -> OpCase:
    b = _Builder("Where")
    cond = b.input("cond", b.rng.random((3, 4)) > 0.5)
    x = b.input("x", b.randn(3, 4))
    y = b.input("other", b.randn(1, 4))
    return b.build([b.node("Where", [cond, x, y], "y")])


def _pow() -> OpCase:
    b = _Builder("Pow")
    x = b.input("x", (np.abs(b.randn(3, 4)) + 0.5).astype(np.float32))
    e = b.init("exponent", np.array([0.5, 1.0, 2.0, 3.0], dtype=np.float32))
    return b.build([b.node("Pow", [x, e], "y")])


def _mlp() -> OpCase:
    """MatMul -> Add -> Relu: one MLP layer (the quantization check uses it too)."""
    b = _Builder("chain_mlp")
    x = b.input("x", b.randn(4, 32))
    w = b.init("W", b.randn(32, 16, scale=0.2))
    bias = b.init("bias", b.randn(16, scale=0.1))
    h = b.node("MatMul", [x, w], "h")
    return b.build([b.node("Relu", [b.node("Add", [h, bias], "h_bias")], "y")])


def _attention() -> OpCase:
    """softmax(q k^T / sqrt(d)) v for (batch, heads, seq, dim) tensors."""
    b = _Builder("chain_attention")
    q = b.input("q", b.randn(1, 2, 4, 8))
    k = b.input("k", b.randn(1, 2, 4, 8))
    v = b.input("v", b.randn(1, 2, 4, 8))
    kt = b.node("Transpose", [k], "k_t", perm=[0, 1, 3, 2])
    scores = b.node("MatMul", [q, kt], "scores")
    scaled = b.node("Div", [scores, b.init("sqrt_d", np.array(np.sqrt(8.0), dtype=np.float32))], "scaled")
    probs = b.node("Softmax", [scaled], "probs", axis=-1)
    return b.build([b.node("MatMul", [probs, v], "y")])


def _conv_relu_pool() -> OpCase:
    b = _Builder("chain_conv_relu_maxpool")
    x = b.input("x", b.randn(1, 3, 8, 8))
    w = b.init("W", b.randn(4, 3, 3, 3, scale=0.3))
    c = b.init("B", b.randn(4, scale=0.1))
    h = b.node("Conv", [x, w, c], "conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    r = b.node("Relu", [h], "relu")
    return b.build([b.node("MaxPool", [r], "y", kernel_shape=[2, 2], strides=[2, 2])])


def _ln_matmul_gelu() -> OpCase:
    """LayerNorm -> MatMul -> GELU written out in its erf form, as exporters emit it."""
    b = _Builder("chain_layernorm_matmul_gelu")
    x = b.input("x", b.randn(2, 4, 16))
    gamma = b.init("gamma", 1.0 + b.randn(16, scale=0.1))
    beta = b.init("beta", b.randn(16, scale=0.1))
    n = b.node("LayerNormalization", [x, gamma, beta], "ln", axis=-1, epsilon=1e-5)
    h = b.node("MatMul", [n, b.init("W", b.randn(16, 32, scale=0.25))], "h")
    e = b.node("Erf", [b.node("Div", [h, b.init("sqrt2", np.array(np.sqrt(2.0), dtype=np.float32))], "h_s")], "erf")
    one_plus = b.node("Add", [e, b.init("one", np.array(1.0, dtype=np.float32))], "erf_1")
    g = b.node("Mul", [h, one_plus], "h_erf")
    return b.build([b.node("Mul", [g, b.init("half", np.array(0.5, dtype=np.float32))], "y")])


_FACTORIES: tuple[Callable[[], OpCase], ...] = (
    _binary("Add", (2, 3, 4), (4,)),
    _binary("Sub", (2, 3, 4), (3, 1)),
    _binary("Mul", (2, 3, 4), (1, 3, 1), b_init=True),
    _binary("Div", (2, 3, 4), (2, 1, 4)),
    _unary("Relu"), _unary("Sigmoid"), _unary("Tanh"), _unary("Erf"),
    _unary("Sqrt", positive=True), _unary("Exp"), _unary("Softmax", axis=-1),
    _layernorm, _matmul_2d, _matmul_batched, _gemm, _conv, _maxpool, _gap,
    _reshape, _transpose, _concat, _gather, _slice, _reduce_mean, _unsqueeze, _flatten,
    _cast, _where, _pow,
    _mlp, _attention, _conv_relu_pool, _ln_matmul_gelu,
)

MLP_CASE = "chain_mlp"


@functools.lru_cache(maxsize=1)
def _all_cases() -> tuple[OpCase, ...]:
    cases = tuple(make() for make in _FACTORIES)
    assert len({c.name for c in cases}) == len(cases), "case names must be unique"
    return cases


def op_cases() -> list[OpCase]:
    """Every conformance case, in a fixed order (built once per process)."""
    return list(_all_cases())


def op_case(name: str) -> OpCase:
    """One case by name (KeyError listing the names otherwise)."""
    for case in _all_cases():
        if case.name == name:
            return case
    raise KeyError(f"no op case {name!r}; have {[c.name for c in _all_cases()]}")

