"""Arithmetic and memory-traffic estimates per op, for roofline bids."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dspark.graph.control_flow import (
    combine_body_flops,
    has_subgraphs,
    op_graphs,
    trip_count,
)
from dspark.graph.elements import Op, TensorSpec


class Scope(Protocol):
    """What costing reads of a graph: a :class:`~dspark.graph.model.Graph`, or a control-flow body."""

    @property
    def ops(self) -> Sequence[Op]: ...
    @property
    def tensors(self) -> Mapping[str, TensorSpec]: ...
    @property
    def initializers(self) -> Mapping[str, np.ndarray]: ...
    @property
    def dim_hints(self) -> dict[str, int]: ...
    @property
    def opset(self) -> int: ...


@dataclass
class _Body:
    """A control-flow body read for costing (not a validated Graph: it reads outer-scope names)."""

    ops: list[Op]
    tensors: dict[str, TensorSpec]
    initializers: dict[str, np.ndarray]
    dim_hints: dict[str, int] = field(default_factory=dict)
    opset: int = 17

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


def _numel(graph: Scope, t: str) -> int | None:
    spec = graph.tensors.get(t)
    return spec.numel(graph.dim_hints) if spec else None


def _dim(graph: Scope, d: int | str) -> int | None:
    return d if isinstance(d, int) else graph.dim_hints.get(d)


def _einsum_flops(graph: Scope, op: Op) -> float | None:
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


def op_flops(graph: Scope, op: Op) -> float | None:
    """Arithmetic operations of one run of ``op`` (multiply-add = 2), or None if shapes are unknown.

    Pure data movement (Reshape, Transpose, Gather, Concat, ...) costs 0. A
    control-flow op costs its bodies' FLOPs times its trip count
    (:func:`dspark.graph.control_flow.trip_count`).
    """
    if has_subgraphs(op):
        return _control_flow_flops(graph, op)
    outs = [_numel(graph, t) for t in op.outputs if t]
    out_n = outs[0] if outs else None
    if op.op_type in ("MatMul", "Gemm", "MatMulInteger", "QLinearMatMul"):
        a = graph.tensors.get(op.inputs[0])
        if a is None or out_n is None or len(a.shape) < (2 if op.op_type == "Gemm" else 1):
            return None  # ONNX inference left the rank unknown
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


def _constants(graph: Scope, names: Sequence[str]) -> dict[str, Any]:
    """Values of ``names`` known before running: initializers and ``Constant`` outputs."""
    out: dict[str, Any] = {n: graph.initializers[n] for n in names if n and n in graph.initializers}
    wanted = {n for n in names if n and n not in out}
    for op in graph.ops if wanted else ():
        if op.op_type == "Constant" and op.outputs and op.outputs[0] in wanted:
            value = next((op.attrs[k] for k in ("value", "value_int", "value_ints") if k in op.attrs), None)
            if value is not None:
                out[op.outputs[0]] = np.asarray(value)
    return out


def _body_input_specs(graph: Scope, op: Op) -> list[TensorSpec | None]:
    """Specs of the outer values a Loop's or Scan's body inputs take (a body may leave types out)."""
    ins = op.node_inputs
    spec = graph.tensors.get
    if op.op_type == "Loop":
        return [None, None, *[spec(t) if t else None for t in ins[2:]]]
    if op.op_type != "Scan":
        return []
    n_scan = int(op.attrs.get("num_scan_inputs", 1))
    drop = 2 if graph.opset < 9 else 1  # Scan-8's body sees one batch entry and one step
    states = ins[1 if graph.opset < 9 else 0:len(ins) - n_scan]
    out: list[TensorSpec | None] = [spec(t) if t else None for t in states]
    if graph.opset < 9:
        out = [s.model_copy(update={"shape": s.shape[1:]}) if s else None for s in out]
    axes = list(op.attrs.get("scan_input_axes", [0] * n_scan)) if graph.opset >= 9 else [1] * n_scan
    for t, axis in zip(ins[len(ins) - n_scan:], axes, strict=False):
        s = spec(t)
        if s is None:
            out.append(None)
            continue
        a = int(axis) % len(s.shape) if s.shape else 0
        shape = s.shape[:a] + s.shape[a + 1:] if drop == 1 else s.shape[2:]
        out.append(s.model_copy(update={"shape": shape}))
    return out


_SMALL_CONSTANT = 64  # elements: captured constants up to this size go into a body (trip counts, axes)


def _control_flow_flops(graph: Scope, op: Op) -> float | None:
    outer = tuple(sorted((t, graph.tensors[t].model_dump_json()) for t in op.inputs if t and t in graph.tensors))
    specs = tuple(s.model_dump_json() if s else "" for s in _body_input_specs(graph, op))
    captured = {k: np.asarray(v) for k, v in _constants(graph, op.captures).items()}
    constants = tuple(sorted((k, v.dtype.str, v.shape, v.tobytes()) for k, v in captured.items()
                             if v.size <= _SMALL_CONSTANT))
    hints = tuple(sorted(graph.dim_hints.items()))
    try:
        per_body = [_body_flops(body.SerializeToString(deterministic=True), outer, specs, constants, hints, graph.opset)
                    for body in op_graphs(op)]
    except Exception:  # noqa: BLE001  (costing is best effort: an unreadable body is an unknown cost)
        return None
    trips, _ = trip_count(op, graph.tensors, graph.dim_hints, _constants(graph, op.node_inputs[:2]), graph.opset)
    return combine_body_flops(op, per_body, trips)


@functools.lru_cache(maxsize=256)  # shape buckets re-annotate a graph: each body is read once per size
def _body_flops(body: bytes, outer: tuple[tuple[str, str], ...], specs: tuple[str, ...],
                constants: tuple[tuple[str, str, tuple[int, ...], bytes], ...], hints: tuple[tuple[str, int], ...],
                opset: int) -> float:
    import onnx

    from dspark.graph.onnx_io import read_body

    proto = onnx.GraphProto()
    proto.ParseFromString(body)
    tensors = {k: TensorSpec.model_validate_json(v) for k, v in outer}
    inputs = [TensorSpec.model_validate_json(s) if s else None for s in specs]
    values = {k: np.frombuffer(raw, dtype=np.dtype(dt)).reshape(shape) for k, dt, shape, raw in constants}
    fields = read_body(proto, tensors, opset, dict(hints), inputs, values)
    scope = _Body(ops=fields["ops"], tensors={**tensors, **fields["tensors"]}, initializers=fields["initializers"],
                  dim_hints={**dict(hints), **fields["dim_hints"]}, opset=opset)
    return math.fsum(op_flops(scope, op) or 0.0 for op in scope.ops)


def annotate_costs(graph: Scope) -> None:
    """Fill ``flops``, ``bytes_read``, ``bytes_written`` and ``param_bytes`` where shapes allow."""
    for op in graph.ops:
        op.flops = op_flops(graph, op)
        hints = graph.dim_hints
        read = [graph.tensors[t].nbytes(hints) if t in graph.tensors else None for t in op.inputs if t]
        written = [graph.tensors[t].nbytes(hints) if t in graph.tensors else None for t in op.outputs if t]
        op.bytes_read = None if any(r is None for r in read) else sum(r or 0 for r in read)
        op.bytes_written = None if any(w is None for w in written) else sum(w or 0 for w in written)
        op.param_bytes = sum(int(graph.initializers[t].nbytes) for t in op.inputs if t in graph.initializers)
