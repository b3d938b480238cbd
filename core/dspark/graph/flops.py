"""Arithmetic and memory-traffic estimates per op, for roofline bids."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dspark.graph.elements import Op

if TYPE_CHECKING:
    from dspark.graph.model import Graph

# Ops whose cost is about one arithmetic operation per output element.
_ELEMENTWISE = {
    "Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Pow", "Exp",
    "Neg", "Abs", "Max", "Min", "Where", "Cast", "LeakyRelu", "Clip", "HardSigmoid",
    "Gelu", "Reciprocal", "Log", "Equal", "Greater", "Less", "Not", "And", "Or",
    "GreaterOrEqual", "LessOrEqual", "Xor", "Mod", "Floor", "Ceil", "Round", "Sign", "Sin", "Cos",
    "Tan", "Atan", "Asin", "Acos", "Sinh", "Cosh", "Softplus", "Softsign", "Elu", "Selu", "Celu",
    "PRelu", "ThresholdedRelu", "HardSwish", "Mish", "IsNaN", "IsInf", "BitShift", "CastLike",
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "Trilu",
}
# Ops costing a fixed number of operations per element of their first input.
_PER_ELEMENT = {"Softmax": 5, "LogSoftmax": 5, "LayerNormalization": 8, "Gelu": 8,
                "BatchNormalization": 4, "InstanceNormalization": 8, "GroupNormalization": 8,
                "SimplifiedLayerNormalization": 5, "RMSNormalization": 5, "LpNormalization": 3,
                "ReduceMean": 1, "ReduceSum": 1, "ReduceMax": 1, "ReduceMin": 1, "ReduceProd": 1,
                "ReduceL1": 2, "ReduceL2": 2, "ReduceSumSquare": 2, "ReduceLogSumExp": 3,
                "ReduceLogSum": 1, "ArgMax": 1, "ArgMin": 1, "CumSum": 1, "TopK": 2,
                "GlobalAveragePool": 1, "GlobalMaxPool": 1, "GlobalLpPool": 3, "LRN": 6}
# Variadic elementwise ops: one operation per output element per extra input.
_VARIADIC = {"Sum", "Mean", "Max", "Min"}


def _numel(graph: Graph, t: str) -> int | None:
    spec = graph.tensors.get(t)
    return spec.numel(graph.dim_hints) if spec else None


def _dim(graph: Graph, d: int | str) -> int | None:
    return d if isinstance(d, int) else graph.dim_hints.get(d)


def _einsum_flops(graph: Graph, op: Op) -> float | None:
    """2 x the product of every index size: one multiply-add per point of the iteration space."""
    eq = str(op.attrs.get("equation", "")).replace(" ", "")
    lhs = eq.split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, t in zip(lhs, op.inputs, strict=False):
        spec = graph.tensors.get(t)
        if spec is None or "..." in term or len(term) != len(spec.shape):
            return None
        for letter, d in zip(term, spec.shape, strict=True):
            n = _dim(graph, d)
            if n is None:
                return None
            sizes[letter] = n
    return (2.0 if len(lhs) > 1 else 1.0) * math.prod(sizes.values())


def op_flops(graph: Graph, op: Op) -> float | None:
    """Arithmetic operations of one run of ``op`` (multiply-add = 2), or None if shapes are unknown.

    Pure data movement (Reshape, Transpose, Gather, Concat, ...) costs 0.
    """
    outs = [_numel(graph, t) for t in op.outputs if t]
    out_n = outs[0] if outs else None
    if op.op_type in ("MatMul", "Gemm", "MatMulInteger", "QLinearMatMul"):
        a = graph.tensors.get(op.inputs[0])
        if a is None or out_n is None:
            return None
        k = _dim(graph, a.shape[-2] if op.op_type == "Gemm" and op.attrs.get("transA") else a.shape[-1])
        if k is None:
            return None
        bias = out_n if op.op_type == "Gemm" and len(op.inputs) > 2 and op.inputs[2] else 0
        return 2.0 * out_n * k + bias
    if op.op_type in ("Conv", "ConvInteger", "ConvTranspose"):
        w = graph.tensors.get(op.inputs[1])
        if w is None or not w.is_static:
            return None
        # Weight dims after the first are C_in/group x kernel (Conv) or
        # C_out/group x kernel (ConvTranspose): the MACs per output (input) element.
        per = math.prod(int(d) for d in w.shape[1:])
        n = _numel(graph, op.inputs[0]) if op.op_type == "ConvTranspose" else out_n
        if n is None:
            return None
        bias = (out_n or 0) if len(op.inputs) > 2 and op.inputs[2] else 0  # one add per output
        return 2.0 * n * per + bias
    if op.op_type == "Einsum":
        return _einsum_flops(graph, op)
    if op.op_type in ("MaxPool", "AveragePool", "LpPool"):
        k = op.attrs.get("kernel_shape", [1])
        return None if out_n is None else float(out_n * math.prod(k))
    if op.op_type in _PER_ELEMENT:
        n = _numel(graph, op.inputs[0])
        return None if n is None else float(_PER_ELEMENT[op.op_type] * n)
    if op.op_type in _VARIADIC and len([t for t in op.inputs if t]) > 2:
        return None if out_n is None else float(out_n * (len([t for t in op.inputs if t]) - 1))
    if op.op_type in _ELEMENTWISE or op.op_type in _VARIADIC:
        return None if out_n is None else float(out_n)
    if op.op_type == "Resize":
        mode = op.attrs.get("mode", "nearest")
        return None if out_n is None else float(out_n * (0 if mode == "nearest" else 4))
    return 0.0 if out_n is not None else None  # data movement only (Reshape, Transpose, ...)


def annotate_costs(graph: Graph) -> None:
    """Fill ``flops``, ``bytes_read``, ``bytes_written`` and ``param_bytes`` where shapes allow."""
    for op in graph.ops:
        op.flops = op_flops(graph, op)
        hints = graph.dim_hints
        read = [graph.tensors[t].nbytes(hints) if t in graph.tensors else None for t in op.inputs if t]
        written = [graph.tensors[t].nbytes(hints) if t in graph.tensors else None for t in op.outputs if t]
        op.bytes_read = None if any(r is None for r in read) else sum(r or 0 for r in read)
        op.bytes_written = None if any(w is None for w in written) else sum(w or 0 for w in written)
        op.param_bytes = sum(int(graph.initializers[t].nbytes) for t in op.inputs if t in graph.initializers)
