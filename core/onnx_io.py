"""Conversion between ONNX models and :class:`dspark.graph.Graph`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from dspark.flops import annotate_costs
from dspark.graph import Graph, Op, Subgraph, TensorSpec

_ONNX_TO_DTYPE = {
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
    return TensorSpec(name=vi.name, dtype=_ONNX_TO_DTYPE[tt.elem_type], shape=tuple(dims))  # type: ignore[arg-type]


def _attr_value(attr: onnx.AttributeProto) -> Any:
    value = helper.get_attribute_value(attr)
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list) and value and isinstance(value[0], bytes):
        return [v.decode() for v in value]
    if isinstance(value, onnx.GraphProto):
        raise UnsupportedModelError(f"attribute {attr.name!r} holds a subgraph (control flow)")
    return value


def graph_from_onnx(model: onnx.ModelProto | str | bytes | Path, name: str | None = None) -> Graph:
    """Import an ONNX model, with shapes from ONNX shape inference."""
    source = "<bytes>"
    if isinstance(model, (str, Path)):
        source = str(model)
        if not Path(model).is_file():
            raise FileNotFoundError(f"ONNX model file not found: {model}")
        model = onnx.load(str(model))
    elif isinstance(model, bytes):
        model = onnx.load_from_string(model)
    try:
        model = shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as exc:  # inference is best effort: keep what the file declares
        del exc
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    tensors: dict[str, TensorSpec] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        spec = _spec_from_value_info(vi)
        if spec:
            tensors[vi.name] = spec
    for tname, arr in inits.items():
        try:
            tensors[tname] = TensorSpec(name=tname, dtype=_np_name(arr), shape=tuple(arr.shape))  # type: ignore[arg-type]
        except ValueError as exc:
            raise UnsupportedModelError(f"{source}: initializer {tname!r}: {exc}") from None
    ops = []
    for i, node in enumerate(g.node):
        node_name = node.name or f"{node.op_type}_{i}"
        try:
            attrs = {a.name: _attr_value(a) for a in node.attribute}
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"{source}: node {node_name!r} ({node.op_type}): {exc}") from None
        ops.append(Op(name=node_name, op_type=node.op_type, domain=node.domain,
                      inputs=list(node.input), outputs=list(node.output), attrs=attrs))
    inputs = [i.name for i in g.input if i.name not in inits]
    graph = Graph(name=name or g.name or Path(source).stem, opset=opset, ops=ops, tensors=tensors,
                  inputs=inputs, outputs=[o.name for o in g.output], initializers=inits)
    annotate_costs(graph)
    return graph


def _np_name(arr: np.ndarray) -> str:
    from dspark.graph import dtype_of

    return dtype_of(arr)


def _value_info(spec: TensorSpec, dynamic: bool) -> onnx.ValueInfoProto:
    shape = [d if isinstance(d, int) and not dynamic else (d if isinstance(d, str) else None) for d in spec.shape]
    return helper.make_tensor_value_info(spec.name, _DTYPE_TO_ONNX[spec.dtype], shape)


def subgraph_to_onnx(sg: Subgraph, *, dynamic: bool = False) -> onnx.ModelProto:
    g = sg.graph
    nodes = []
    for op in sg.ops:
        attrs = {k: (numpy_helper.from_array(np.asarray(v)) if isinstance(v, np.ndarray) else v)
                 for k, v in op.attrs.items()}
        nodes.append(helper.make_node(op.op_type, op.inputs, op.outputs, name=op.name, domain=op.domain, **attrs))
    missing = [t for t in sg.inputs + sg.outputs if t not in g.tensors]
    if missing:
        raise UnsupportedModelError(f"subgraph of {g.name!r}: no shape/dtype known for tensors {missing}")
    graph = helper.make_graph(
        nodes,
        f"{g.name}_sub",
        [_value_info(g.tensors[t], dynamic) for t in sg.inputs],
        [_value_info(g.tensors[t], dynamic) for t in sg.outputs],
        initializer=[numpy_helper.from_array(g.initializers[p], p) for p in sg.params],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", g.opset)], producer_name="dspark")
    model.ir_version = min(model.ir_version, 9)  # readable by every runtime we drive
    return model
