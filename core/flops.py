"""Arithmetic and memory-traffic estimates per op, for roofline bids."""

from __future__ import annotations

import math

from dspark.graph import Graph, Op

# Ops whose cost is about one arithmetic operation per output element.
_ELEMENTWISE = {
    "Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Pow", "Exp",
    "Neg", "Abs", "Max", "Min", "Where", "Cast", "LeakyRelu", "Clip", "HardSigmoid",
    "Gelu", "Reciprocal", "Log", "Equal", "Greater", "Less", "Not", "And", "Or",
}
_PER_ELEMENT = {"Softmax": 5, "LayerNormalization": 8, "Gelu": 8, "BatchNormalization": 4,
                "ReduceMean": 1, "ReduceSum": 1, "GlobalAveragePool": 1, "SimplifiedLayerNormalization": 5}


def _numel(graph: Graph, t: str) -> int | None:
    spec = graph.tensors.get(t)
    return spec.numel(graph.dim_hints) if spec else None


def op_flops(graph: Graph, op: Op) -> float | None:
    """Arithmetic operations of one run of ``op`` (multiply-add = 2), or None if shapes are unknown."""
    outs = [_numel(graph, t) for t in op.outputs if t]
    out_n = outs[0] if outs else None
    if op.op_type in ("MatMul", "Gemm", "MatMulInteger"):
        a = graph.tensors.get(op.inputs[0])
        if a is None or out_n is None:
            return None
        k = a.shape[-2] if op.op_type == "Gemm" and op.attrs.get("transA") else a.shape[-1]
        k = graph.dim_hints.get(k, k) if isinstance(k, str) else k
        return 2.0 * out_n * k if isinstance(k, int) else None
    if op.op_type == "Conv":
        w = graph.tensors.get(op.inputs[1])
        if w is None or out_n is None or not w.is_static:
            return None
        group = int(op.attrs.get("group", 1))
        del group  # the weight's second dim is already C_in / group
        per_out = math.prod(int(d) for d in w.shape[1:])
        return 2.0 * out_n * per_out
    if op.op_type in ("MaxPool", "AveragePool"):
        k = op.attrs.get("kernel_shape", [1])
        return None if out_n is None else float(out_n * math.prod(k))
    if op.op_type in _PER_ELEMENT:
        n = _numel(graph, op.inputs[0])
        return None if n is None else float(_PER_ELEMENT[op.op_type] * n)
    if op.op_type in _ELEMENTWISE:
        return None if out_n is None else float(out_n)
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
