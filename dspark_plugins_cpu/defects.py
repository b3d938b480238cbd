"""Op signatures OpenVINO runs but answers differently from the ONNX specification.

Each rule looks at one op (its attributes, dtypes and static shapes, never
values) and says why OpenVINO's kernel or ONNX frontend gets that signature
wrong; :func:`known_defect` is asked before the runtime's own capability
query, so such a subgraph is abstained from rather than bid on. The rules
come from ONNX's own node tests (docs/onnx-node-conformance.md); a rule can
go when a newer OpenVINO passes its cases.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from dspark.graph import Op, Subgraph, body_op_types, free_names, op_graphs

# dtypes the executable's numpy bridge cannot carry across the boundary.
NO_NUMPY_BRIDGE = frozenset({"bfloat16", "int4", "uint4"})
_FLOATS = frozenset({"float32", "float64", "float16", "bfloat16"})
_SIGNED = frozenset({"int8", "int16", "int32", "int64"})


def _input(op: Op, index: int) -> str:
    return op.inputs[index] if len(op.inputs) > index else ""


def _dtype(sg: Subgraph, tensor: str) -> str | None:
    spec = sg.graph.tensors.get(tensor)
    return spec.dtype if spec is not None else None


def _attention(op: Op, sg: Subgraph) -> str | None:
    if op.attrs.get("left_window_size", -1) != -1 or op.attrs.get("right_window_size", -1) != -1:
        return "Attention with a sliding window ignores the window"
    if op.attrs.get("is_causal") == 1 and (_input(op, 3) or _input(op, 4)):
        return "causal Attention with a mask or past keys masks the wrong positions"
    return None


def _bit_shift(op: Op, sg: Subgraph) -> str | None:
    if _dtype(sg, _input(op, 0)) in _SIGNED:
        return "BitShift on signed integers (negative values, shifts past the width) differs from ONNX"
    return None


def _recurrent(op: Op, sg: Subgraph) -> str | None:
    if op.attrs.get("layout", 0) == 1:
        return f"{op.op_type} with layout=1 (batch first) gives wrong outputs"
    if op.op_type == "LSTM" and _input(op, 7):
        return "LSTM peephole weights (input P) are ignored"
    return None


def _pool(op: Op, sg: Subgraph) -> str | None:
    if op.attrs.get("ceil_mode", 0) == 1:
        return f"{op.op_type} with ceil_mode=1 sizes or averages the last window differently from ONNX"
    return None


def _nonfinite_constants(sg: Subgraph) -> bool:
    """Whether the subgraph holds ±inf or NaN constants (masks built to be reduced over)."""
    values = [sg.graph.initializers[p] for p in sg.params]
    values += [v for op in sg.ops if op.op_type == "Constant" for v in op.attrs.values()]
    return any(isinstance(v, np.ndarray) and v.dtype.kind == "f" and not np.isfinite(v).all() for v in values)


def _reduce_extreme(op: Op, sg: Subgraph) -> str | None:
    spec = sg.graph.tensors.get(_input(op, 0))
    if spec is None or spec.dtype not in _FLOATS:
        return None
    # OpenVINO gives ±FLT_MAX for an all-±inf or empty slice and skips NaN (ONNX: ±inf, NaN). Inputs
    # that are ±inf at run time cannot be seen here; empty inputs and ±inf/NaN masks can.
    if not spec.is_static or 0 in spec.shape:
        return f"{op.op_type} over a possibly empty tensor gives ±FLT_MAX, not ±inf"
    if _nonfinite_constants(sg):
        return f"{op.op_type} over ±inf/NaN masks gives ±FLT_MAX and skips NaN"
    return None


def _resize(op: Op, sg: Subgraph) -> str | None:
    mode = op.attrs.get("mode", "nearest")
    if op.attrs.get("antialias", 0) == 1:
        return "Resize with antialias differs from ONNX"
    if op.attrs.get("exclude_outside", 0) == 1:
        return "Resize with exclude_outside differs from ONNX"
    if op.attrs.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        return "Resize with keep_aspect_ratio_policy other than stretch gives the wrong output shape"
    if op.attrs.get("coordinate_transformation_mode") == "align_corners" and mode in ("linear", "cubic"):
        return "Resize linear/cubic with align_corners differs from ONNX when downsampling"
    return None


def _roi_align(op: Op, sg: Subgraph) -> str | None:
    return "RoiAlign with mode=max differs from ONNX" if op.attrs.get("mode") == "max" else None


def _space_to_depth(op: Op, sg: Subgraph) -> str | None:
    # ONNX's SpaceToDepth has no mode; OpenVINO's frontend honours one and reorders the channels.
    return "SpaceToDepth with a mode attribute is reordered by OpenVINO" if "mode" in op.attrs else None


def _tile(op: Op, sg: Subgraph) -> str | None:
    if _input(op, 1) not in sg.graph.initializers:
        return "Tile with repeats given at run time produces wrong values"
    return None


def _cast(op: Op, sg: Subgraph) -> str | None:
    if "float64" in (_dtype(sg, _input(op, 0)), _dtype(sg, op.outputs[0] if op.outputs else "")):
        return f"{op.op_type} to or from float64 saturates out-of-range values instead of giving ±inf"
    return None


def _quantize_linear(op: Op, sg: Subgraph) -> str | None:
    produced = {t for other in sg.ops for t in other.outputs}
    if _input(op, 1) in produced:  # the expanded form of DynamicQuantizeLinear
        return "QuantizeLinear with a scale computed in the graph rounds some halves away from ONNX's (to even)"
    return None


def _scan(op: Op, sg: Subgraph) -> str | None:
    if any(free_names(body) for body in op_graphs(op)):
        return "Scan whose body reads values of the outer graph: OpenVINO's frontend computes it wrong or fails"
    return None


def _always(reason: str) -> Callable[[Op, Subgraph], str | None]:
    return lambda op, sg: reason


# op type -> why OpenVINO answers this signature wrong (None: fine).
DEFECTS: dict[str, Callable[[Op, Subgraph], str | None]] = {
    "Attention": _attention,
    "AveragePool": _pool,
    "BitShift": _bit_shift,
    "Cast": _cast,
    "CastLike": _cast,
    "DFT": _always("DFT's onesided/inverse outputs have the wrong shape and its axis input has no port"),
    "DynamicQuantizeLinear": _always("DynamicQuantizeLinear rounds some halves away from ONNX's (to even)"),
    "GRU": _recurrent,
    "LSTM": _recurrent,
    "MaxPool": _pool,
    "NonMaxSuppression": _always("NonMaxSuppression drops boxes whose IoU equals the threshold"),
    "QuantizeLinear": _quantize_linear,
    "ReduceMax": _reduce_extreme,
    "ReduceMin": _reduce_extreme,
    "Resize": _resize,
    "RNN": _recurrent,
    "RoiAlign": _roi_align,
    "Scan": _scan,
    "SpaceToDepth": _space_to_depth,
    "Tile": _tile,
    "TopK": _always("TopK orders tied values differently from ONNX (lower index first)"),
}


def known_defect(subgraph: Subgraph) -> str | None:
    """Why OpenVINO would run ``subgraph`` but not answer right or not finish; None when nothing is known."""
    tensors = subgraph.graph.tensors
    for t in subgraph.inputs + subgraph.outputs:
        if t in tensors and tensors[t].dtype in NO_NUMPY_BRIDGE:
            return f"boundary tensor {t!r} is {tensors[t].dtype}, which the numpy bridge cannot carry"
        if t in subgraph.inputs and t in tensors and not tensors[t].rank_known:
            return f"input {t!r} has an unknown rank, which OpenVINO's CPU plugin cannot take"
    for op in subgraph.ops:
        rule = DEFECTS.get(op.op_type) if op.domain in ("", "ai.onnx") else None
        if rule is not None and (reason := rule(op, subgraph)) is not None:
            return f"op {op.name!r} ({op.op_type}): {reason}"
        # A control-flow body's tensors have no specs out here, so the rules cannot look at them.
        inner = sorted({t for d, t in body_op_types(op) if d == ""} & DEFECTS.keys())
        if inner:
            return (f"op {op.name!r} ({op.op_type}): its body holds {', '.join(inner)}, "
                    "whose defects cannot be ruled out")
    return None
