"""Conversion between ONNX models and :class:`dspark.graph.model.Graph`.

Reading gives the graph's fields (:meth:`Graph.from_onnx` builds and annotates
the graph) and writing takes a subgraph's pieces, so this module needs the
graph's elements but not the graph types, and imports nothing that imports it.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, inliner, numpy_helper, shape_inference

from dspark.graph.control_flow import free_names, node_captures
from dspark.graph.elements import Op, TensorSpec, dtype_of
from dspark.types import DType

_ONNX_TO_DTYPE: dict[int, str] = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
    onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32",
    onnx.TensorProto.INT16: "int16", onnx.TensorProto.INT8: "int8",
    onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.BOOL: "bool",
    onnx.TensorProto.INT4: "int4", onnx.TensorProto.UINT4: "uint4",
}
_DTYPE_TO_ONNX = {v: k for k, v in _ONNX_TO_DTYPE.items()}


class UnsupportedModelError(ValueError):
    """The model uses something dspark cannot represent; the message names it."""


def _spec_from_value_info(vi: onnx.ValueInfoProto) -> TensorSpec | None:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or tt.elem_type not in _ONNX_TO_DTYPE:
        return None
    dims: list[int | str] = []
    for i, d in enumerate(tt.shape.dim):
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or f"{vi.name}_dim{i}")
    # No shape field at all: inference could not tell the rank (a Loop whose body leaves it open).
    return TensorSpec(name=vi.name, dtype=_ONNX_TO_DTYPE[tt.elem_type], shape=tuple(dims),
                      rank_known=tt.HasField("shape"))


def _attr_value(attr: onnx.AttributeProto) -> Any:
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        bodies = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        copies = [onnx.GraphProto() for _ in bodies]  # the op owns its bodies, not the caller's model
        for copy, body in zip(copies, bodies, strict=True):
            copy.CopyFrom(body)
        return copies[0] if attr.type == onnx.AttributeProto.GRAPH else copies
    value = helper.get_attribute_value(attr)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    return value


# Op domains a model loaded for analysis may use: standard ONNX, ONNX-ML, and
# ONNX Runtime's contrib ops (which the ONNX Runtime plugin runs). Anything
# else is a vendor's custom op no built-in runtime implements.
KNOWN_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "com.microsoft"})


def _check_node(node: onnx.NodeProto, node_name: str, source: str, domains: Collection[str] | None) -> None:
    if domains is not None and node.domain not in domains:
        raise UnsupportedModelError(
            f"{source}: op {node.op_type!r} (node {node_name!r}) is from unknown custom domain "
            f"{node.domain!r}; supported domains: {sorted(domains)}"
        )
    for attr in node.attribute:  # control flow: the nodes of its bodies are checked alike
        for body in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for i, inner in enumerate(body.node):
                _check_node(inner, f"{node_name}/{inner.name or f'{inner.op_type}_{i}'}", source, domains)


_DIM_EXPR = re.compile(r"^[A-Za-z0-9_ +\-*/%(),]+$")


def _eval_dim(expr: str, hints: dict[str, int]) -> int | None:
    """Value of a symbolic dim expression like ``2*batch`` or ``floor(seq/2)``; None if unknown.

    Parsed with ``ast`` (no eval): dim strings come from model files.
    """
    if not _DIM_EXPR.match(expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return None
    # The names sympy prints in torch's dim expressions.
    funcs: dict[str, Callable[..., float]] = {
        "floor": math.floor, "ceiling": math.ceil, "ceil": math.ceil, "Max": max, "Min": min,
        "max": max, "min": min, "Mod": lambda a, b: a % b, "FloorDiv": lambda a, b: a // b,
    }
    binops: dict[type[ast.operator], Callable[[float, float], float]] = {
        ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    }

    def ev(n: ast.AST) -> float:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return float(n.value)
        if isinstance(n, ast.Name):
            return hints[n.id]
        if isinstance(n, ast.BinOp) and type(n.op) in binops:
            return binops[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in funcs and not n.keywords:
            return funcs[n.func.id](*(ev(a) for a in n.args))
        raise ValueError(expr)

    try:
        value = ev(tree)
    except (KeyError, ValueError, ZeroDivisionError, TypeError):
        return None
    return int(value) if float(value).is_integer() else None


def derive_dim_hints(tensors: dict[str, TensorSpec], hints: dict[str, int]) -> dict[str, int]:
    """``hints`` plus sizes of dims that are expressions of hinted dims (``batch*seq``)."""
    out = dict(hints)
    for spec in tensors.values():
        for d in spec.shape:
            if isinstance(d, str) and d not in out:
                value = _eval_dim(d, out)
                if value is not None:
                    out[d] = value
    return out


def read_onnx(
    model: onnx.ModelProto | str | bytes | Path,
    name: str | None = None,
    dim_hints: dict[str, int] | None = None,
    domains: Collection[str] | None = None,
) -> dict[str, Any]:
    """An ONNX model's graph fields (the keyword arguments of ``Graph``), shapes from ONNX shape inference.

    ``dim_hints`` gives representative sizes of symbolic dims; costs are
    annotated with them (and with dims derived from them, e.g. ``2*batch``).
    A control-flow node (``If``, ``Loop``, ``Scan``: any node with subgraph
    attributes) becomes one op carrying its bodies, the outer-scope tensors
    they read appended to its inputs (:mod:`.control_flow`). Ops of a domain
    outside ``domains``, at any depth, are rejected when it is given (model
    loading passes :data:`KNOWN_DOMAINS`; tests build custom-op graphs without it).
    """
    source = "<bytes>"
    if isinstance(model, (str, Path)):
        source = str(model)
        if not Path(model).is_file():
            raise FileNotFoundError(f"ONNX model file not found: {model}")
        try:
            model = onnx.load(str(model))
        except Exception as exc:  # protobuf's DecodeError says nothing about the file
            raise UnsupportedModelError(f"{source}: not a readable ONNX model ({type(exc).__name__}: {exc})") from exc
    elif isinstance(model, bytes):
        model = onnx.load_from_string(model)
    else:
        source = model.graph.name or "<model>"
    if model.functions:  # exporters emit model-local functions; dspark sees their bodies
        model = inliner.inline_local_functions(model)
    for i, node in enumerate(model.graph.node):
        _check_node(node, node.name or f"{node.op_type}_{i}", source, domains)
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    tensors: dict[str, TensorSpec] = {}
    for vi in _inferred_value_infos(model):
        spec = _spec_from_value_info(vi)
        if spec:
            tensors[vi.name] = spec
    hints = derive_dim_hints(tensors, dict(dim_hints or {}))
    hints.update(_hints_from_static_pass(model, tensors, hints))
    for tname, arr in inits.items():
        try:
            tensors[tname] = TensorSpec(name=tname, dtype=_np_name(arr), shape=tuple(arr.shape))
        except ValueError as exc:
            raise UnsupportedModelError(f"{source}: initializer {tname!r}: {exc}") from None
    _loop_carried_shapes(g, tensors)
    ops = []
    used: set[str] = set()
    for i, node in enumerate(g.node):
        node_name = node.name or f"{node.op_type}_{i}"
        while node_name in used:  # ONNX does not require unique node names; Graph does
            node_name = f"{node_name}_{i}"
        used.add(node_name)
        attrs = {a.name: _attr_value(a) for a in node.attribute}
        captures = node_captures(node)
        ops.append(Op(name=node_name, op_type=node.op_type, domain=node.domain, inputs=[*node.input, *captures],
                      outputs=list(node.output), attrs=attrs, captures=captures))
    inputs = [i.name for i in g.input if i.name not in inits]
    ops = fold_constants(live_ops(ops, [o.name for o in g.output]), inits, tensors, {o.name for o in g.output})
    return {"name": name or g.name or Path(source).stem, "opset": opset, "ops": ops, "tensors": tensors,
            "inputs": inputs, "outputs": [o.name for o in g.output], "initializers": inits, "dim_hints": hints}


def live_ops(ops: list[Op], outputs: Collection[str]) -> list[Op]:
    """``ops`` without the dead ones: an op none of whose outputs reaches a graph output.

    Expanded ONNX functions leave such ops behind (a ``Constant`` nobody reads);
    a plan would otherwise hand each one to a plugin as a partition of its own.
    ONNX ops have no side effects, so nothing is lost; a control-flow op's
    captures are among its inputs, so what its bodies read stays live.
    """
    wanted = set(outputs)
    live: list[Op] = []
    for op in reversed(ops):  # ONNX nodes are topologically sorted: consumers come after producers
        if wanted.intersection(op.outputs):
            live.append(op)
            wanted.update(t for t in op.inputs if t)
    return live[::-1] if len(live) != len(ops) else ops


# A ``Constant`` op's value attributes and the numpy dtype each stands for.
_CONSTANT_VALUES: dict[str, Any] = {"value": None, "value_float": np.float32, "value_floats": np.float32,
                                    "value_int": np.int64, "value_ints": np.int64}


def fold_constants(ops: list[Op], inits: dict[str, np.ndarray], tensors: dict[str, TensorSpec],
                   outputs: Collection[str]) -> list[Op]:
    """``ops`` with each standard ``Constant`` made an initializer (added to ``inits`` and ``tensors``).

    Exporters write small tensors (``Unsqueeze`` axes, ``Reshape`` shapes) as
    ``Constant`` ops; left as ops, a partition that reads one but does not
    contain it gets the value as a run-time input, and runtimes that need it
    at compile time (OpenVINO infers ranks from ``axes``) decline the
    partition. As an initializer it travels into every partition that reads
    it. A ``Constant`` that is a graph output, or holds strings or a sparse
    tensor, stays an op.
    """
    kept: list[Op] = []
    for op in ops:
        value = _constant_value(op) if op.op_type == "Constant" and op.domain in ("", "ai.onnx") else None
        out = op.outputs[0] if len(op.outputs) == 1 else ""
        if value is None or not out or out in outputs or out in inits:
            kept.append(op)
            continue
        try:
            tensors[out] = TensorSpec(name=out, dtype=dtype_of(value), shape=tuple(value.shape))
        except ValueError:  # a dtype dspark has no name for: the op stays
            kept.append(op)
            continue
        inits[out] = value
    return kept if len(kept) != len(ops) else ops


def _constant_value(op: Op) -> np.ndarray | None:
    if len(op.attrs) != 1:
        return None
    (key, value), = op.attrs.items()
    if key not in _CONSTANT_VALUES or (key == "value" and not isinstance(value, np.ndarray)):
        return None
    dtype = _CONSTANT_VALUES[key]
    return np.array(value) if dtype is None else np.asarray(value, dtype=dtype)


def _loop_carried_shapes(g: onnx.GraphProto, tensors: dict[str, TensorSpec]) -> None:
    """Shapes of Loop-carried outputs that ONNX's inference leaves without even a rank.

    When the body declares the same shape for a carried value coming in and
    going out, and the initial value has it too, every trip (and no trip)
    ends with that shape.
    """
    for node in g.node:
        if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
            continue
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        if body is None:
            continue
        for k, out in enumerate(node.output[:max(len(node.input) - 2, 0)]):
            if not out or (out in tensors and tensors[out].rank_known):
                continue
            if len(body.input) <= 2 + k or len(body.output) <= 1 + k:
                continue
            came, went = _spec_from_value_info(body.input[2 + k]), _spec_from_value_info(body.output[1 + k])
            start = tensors.get(node.input[2 + k])
            specs = [s for s in (came, went, start) if s is not None and s.rank_known]
            if len(specs) == 3 and len({(s.dtype, s.shape) for s in specs}) == 1:
                tensors[out] = TensorSpec(name=out, dtype=specs[0].dtype, shape=specs[0].shape)


def _inferred_value_infos(
    model: onnx.ModelProto, fixed: dict[str, int] | None = None
) -> list[onnx.ValueInfoProto]:
    """Inputs, outputs and intermediate value infos after ONNX shape inference (best effort).

    Inference runs on a skeleton whose large weights are declared inputs, so
    it does not serialize the weights; ``data_prop`` follows Shape -> Concat
    -> Reshape chains. ``fixed`` pins symbolic input dims to sizes.
    """
    g = model.graph
    declared = {vi.name for vi in g.input}
    small: list[onnx.TensorProto] = []
    big: list[onnx.TensorProto] = []
    for t in g.initializer:
        (big if int(np.prod(t.dims)) > 1024 and t.name not in declared else small).append(t)
    inputs = [onnx.ValueInfoProto() for _ in g.input]
    for vi, src in zip(inputs, g.input, strict=True):
        vi.CopyFrom(src)
        for d in vi.type.tensor_type.shape.dim:
            if fixed and d.HasField("dim_param") and d.dim_param in fixed:
                d.dim_value = fixed[d.dim_param]
    inputs += [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in big]
    skeleton = helper.make_model(
        helper.make_graph(list(g.node), g.name, inputs, list(g.output), initializer=small,
                          value_info=[] if fixed else list(g.value_info)),
        opset_imports=list(model.opset_import), ir_version=model.ir_version or onnx.IR_VERSION,
    )
    try:
        skeleton = shape_inference.infer_shapes(skeleton, strict_mode=False, data_prop=True)
    except Exception as exc:  # inference is best effort: keep what the file declares
        del exc
    sg = skeleton.graph
    return list(sg.input)[: len(g.input)] + list(sg.value_info) + list(sg.output)


def _hints_from_static_pass(model: onnx.ModelProto, tensors: dict[str, TensorSpec],
                            hints: dict[str, int]) -> dict[str, int]:
    """Sizes of dims inference could not name (``unk__7``), from a second pass with inputs pinned to the hints."""
    unresolved = {d for spec in tensors.values() for d in spec.shape if isinstance(d, str) and d not in hints}
    if not unresolved or not hints:
        return {}
    extra: dict[str, int] = {}
    for vi in _inferred_value_infos(model, fixed=hints):
        spec = tensors.get(vi.name)
        dims = vi.type.tensor_type.shape.dim
        if spec is None or len(dims) != len(spec.shape):
            continue
        for sym, d in zip(spec.shape, dims, strict=True):
            if isinstance(sym, str) and sym in unresolved and d.HasField("dim_value"):
                extra.setdefault(sym, int(d.dim_value))
    return extra


def rederive_dim_hints(ops: list[Op], inputs: list[str], outputs: list[str], *, tensors: dict[str, TensorSpec],
                       initializers: dict[str, np.ndarray], opset: int, hints: dict[str, int]) -> dict[str, int]:
    """``hints`` (a graph's named input dims at new sizes) plus every dim sized by them: expressions
    (``2*batch``) and the dims ONNX inference could not name at import (``unk__7``, say the rows of a
    ``Reshape`` to ``[-1, 64]``), from the same pinned inference pass :func:`read_onnx` runs.

    Best effort: a graph ONNX cannot re-infer (a custom domain) gets the expressions alone, and the
    caller keeps its old sizes for the rest."""
    out = derive_dim_hints(tensors, dict(hints))
    if not any(isinstance(d, str) and d not in out for spec in tensors.values() for d in spec.shape):
        return out
    small = [n for n, a in initializers.items() if a.size <= 1024]  # shape operands, for data propagation
    big = [n for n, a in initializers.items() if a.size > 1024 and n in tensors]  # declared, never serialized
    try:
        model = ops_to_onnx(ops, [*inputs, *big], outputs, small, name="rederive", opset=opset,
                            tensors=tensors, initializers=initializers)
    except (UnsupportedModelError, ValueError, TypeError, KeyError):
        return out
    out.update(_hints_from_static_pass(model, tensors, out))
    return out


def _np_name(arr: np.ndarray) -> DType:
    return dtype_of(arr)


def _value_info(spec: TensorSpec, dynamic: bool) -> onnx.ValueInfoProto:
    shape = [d if isinstance(d, int) and not dynamic else (d if isinstance(d, str) else None) for d in spec.shape]
    return helper.make_tensor_value_info(spec.name, _DTYPE_TO_ONNX[spec.dtype], shape if spec.rank_known else None)


def ops_to_onnx(ops: list[Op], inputs: list[str], outputs: list[str], params: list[str], *, name: str,
                opset: int, tensors: dict[str, TensorSpec], initializers: dict[str, np.ndarray],
                dynamic: bool = False) -> onnx.ModelProto:
    """``ops`` as a standalone ONNX model: ``inputs``, ``params`` as initializers, ``outputs``.

    :meth:`dspark.graph.model.Subgraph.to_onnx` calls it with its own pieces.
    """
    nodes = []
    for op in ops:
        attrs = {k: (numpy_helper.from_array(np.asarray(v)) if isinstance(v, np.ndarray) else v)
                 for k, v in op.attrs.items()}
        # Captured tensors are graph inputs (or weights) the bodies read by name, not node inputs.
        nodes.append(helper.make_node(op.op_type, op.node_inputs, op.outputs, name=op.name, domain=op.domain,
                                      **attrs))
    missing = [t for t in inputs + outputs if t not in tensors]
    if missing:
        raise UnsupportedModelError(f"subgraph of {name!r}: no shape/dtype known for tensors {missing}")
    graph = helper.make_graph(
        nodes,
        f"{name}_sub",
        [_value_info(tensors[t], dynamic) for t in inputs],
        [_value_info(tensors[t], dynamic) for t in outputs],
        initializer=[numpy_helper.from_array(initializers[p], p) for p in params],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="dspark")
    model.ir_version = min(model.ir_version, 9)  # readable by every runtime we drive
    return model


def read_body(body: onnx.GraphProto, outer: dict[str, TensorSpec], opset: int,
              dim_hints: dict[str, int], input_specs: list[TensorSpec | None] | None = None,
              constants: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """A control-flow body's graph fields (as :func:`read_onnx` gives them), for costing it.

    The body becomes a standalone model: its formal inputs (typed from
    ``input_specs``, the outer values they take, where the body leaves a type
    out) plus the outer-scope tensors it reads (typed from ``outer``; those in
    ``constants`` become weights, so a nested Loop's trip count stays known).
    """
    constants = constants or {}
    formal = []
    for i, vi in enumerate(body.input):
        given = input_specs[i] if input_specs and i < len(input_specs) else None
        tt = vi.type.tensor_type
        if given is not None and given.dtype in _DTYPE_TO_ONNX and (not tt.elem_type or not tt.HasField("shape")):
            formal.append(_value_info(given.model_copy(update={"name": vi.name}), dynamic=False))
        else:
            formal.append(vi)
    free = free_names(body)
    captured = [_value_info(outer[t], dynamic=False) for t in free if t in outer and t not in constants]
    weights = list(body.initializer) + [numpy_helper.from_array(constants[t], t) for t in free if t in constants]
    domains = sorted({n.domain for n in body.node} - {"", "ai.onnx"})
    model = helper.make_model(
        helper.make_graph(list(body.node), body.name or "body", formal + captured, list(body.output),
                          initializer=weights),
        opset_imports=[helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains],
    )
    model.ir_version = min(model.ir_version, 9)
    return read_onnx(model, name=body.name or "body", dim_hints=dim_hints)
