"""Which subgraphs an execution provider runs and answers right: the support check bids ask first.

"Can run" is decided by ONNX Runtime itself: a session is created on the
subgraph (strictly, for non-CPU providers, so every node must be claimed by
the provider). Before that, two cheap checks leave out what a session would
accept but not answer right:

* boundary tensors the numpy bridge cannot carry (bfloat16, 4-bit): ORT has
  no numpy type for them, so the run would fail after the bid;
* op signatures whose kernels are known to disagree with the ONNX
  specification (:data:`_DEFECTS`, found with ONNX's own node tests; see
  docs/onnx-node-conformance.md).

The verdict is cached per subgraph signature, model format (float or a
quantized format) and provider; the signature holds op types, attributes,
shapes and dtypes but not weight values, which do not change what ORT accepts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from dspark.graph import Op, Subgraph, body_op_types
from dspark.types import DType

from dspark_plugins_npu import session
from dspark_plugins_npu.executable import model_bytes, model_format

_MAX_VERDICTS = 4096
_verdicts: OrderedDict[tuple[str, str, str, int], str | None] = OrderedDict()
_lock = threading.Lock()

# dtypes ORT's Python binding cannot exchange as numpy arrays.
_NO_NUMPY_BRIDGE = frozenset({"bfloat16", "int4", "uint4"})
# Ops whose float32 kernels accumulate more rounding than float32's tolerance: bid at float16's.
_LOOSE_FLOAT_OPS = frozenset({"DFT", "STFT"})


def _attr(op: Op, name: str, default: object = None) -> object:
    return op.attrs.get(name, default)


def _input(op: Op, index: int) -> str:
    return op.inputs[index] if len(op.inputs) > index else ""


def _output(op: Op, index: int) -> str:
    return op.outputs[index] if len(op.outputs) > index else ""


def _attention(op: Op, sg: Subgraph) -> str | None:
    if _input(op, 3) and _input(op, 6):
        return "Attention with both attn_mask and nonpad_kv_seqlen fails in ORT's shape check"
    if _attr(op, "is_causal") == 1 and _output(op, 3) and _attr(op, "qk_matmul_output_mode", 0) != 0:
        return "Attention's causal qk_matmul_output (mode != 0) differs from ONNX at masked positions"
    return None


def _max_unpool(op: Op, sg: Subgraph) -> str | None:
    return "MaxUnpool with an output_shape input places values off ONNX's positions" if _input(op, 2) else None


def _resize(op: Op, sg: Subgraph) -> str | None:
    if _attr(op, "coordinate_transformation_mode") == "align_corners" and _attr(op, "mode") in ("linear", "cubic"):
        # Right when upsampling, wrong when downsampling; scales may be a runtime input, so never.
        return "Resize linear/cubic with align_corners differs from ONNX when downsampling"
    return None


def _reduce_extreme(op: Op, sg: Subgraph) -> str | None:
    spec = sg.graph.tensors.get(_input(op, 0))
    if spec is not None and spec.dtype == "bool" and (not spec.is_static or 0 in spec.shape):
        return f"{op.op_type} over an empty bool tensor raises in ORT"
    return None


def _conv_integer(op: Op, sg: Subgraph) -> str | None:
    spec = sg.graph.tensors.get(_input(op, 3))
    if _input(op, 3) and (spec is None or spec.numel() != 1):
        return "ConvInteger with a per-channel w_zero_point (ORT takes per-tensor only)"
    return None


# op type -> why ORT's CPU kernels answer this signature wrong (None: fine).
_DEFECTS: dict[str, Callable[[Op, Subgraph], str | None]] = {
    "Attention": _attention,
    "ConvInteger": _conv_integer,
    "MaxUnpool": _max_unpool,
    "Resize": _resize,
    "ReduceMax": _reduce_extreme,
    "ReduceMin": _reduce_extreme,
}


def known_defect(subgraph: Subgraph) -> str | None:
    """Why a session would run ``subgraph`` but not answer right or not finish; None when nothing is known."""
    tensors = subgraph.graph.tensors
    for t in subgraph.inputs + subgraph.outputs:
        if t in tensors and tensors[t].dtype in _NO_NUMPY_BRIDGE:
            return f"boundary tensor {t!r} is {tensors[t].dtype}, which ORT's numpy binding cannot carry"
    for op in subgraph.ops:
        rule = _DEFECTS.get(op.op_type) if op.domain in ("", "ai.onnx") else None
        if rule is not None and (reason := rule(op, subgraph)) is not None:
            return f"op {op.name!r}: {reason}"
        # A control-flow body's tensors have no specs out here, so the rules cannot look at them.
        inner = sorted({t for d, t in body_op_types(op) if d == ""} & _DEFECTS.keys())
        if inner:
            return f"op {op.name!r}: its body holds {', '.join(inner)}, whose defects cannot be ruled out"
    return None


def why_not(subgraph: Subgraph, ep: str, index: int) -> str | None:
    """None when ``ep`` can run ``subgraph`` and answer right; otherwise the reason (cached)."""
    if (defect := known_defect(subgraph)) is not None:  # cheap: not cached
        return defect
    key = (subgraph.signature(), model_format(subgraph), ep, index)
    with _lock:
        if key in _verdicts:
            _verdicts.move_to_end(key)
            return _verdicts[key]
    verdict: str | None = None
    try:
        session.create(model_bytes(subgraph), ep, index)
    except session.EpUnusable as exc:
        verdict = str(exc)
    except Exception as exc:  # e.g. no shape known for a boundary tensor
        verdict = f"cannot export the subgraph to ONNX: {exc}"
    with _lock:
        _verdicts[key] = verdict
        while len(_verdicts) > _MAX_VERDICTS:
            _verdicts.popitem(last=False)
    return verdict


def result_precision(subgraph: Subgraph, compute: DType) -> DType:
    """The precision results carry: the lowest float of the model's tensors (a model in f16 rounds to it
    whatever the provider computes in), and float16 for ops whose float32 kernels are looser than float32."""
    tensors = subgraph.graph.tensors
    dtypes = {tensors[t].dtype for op in subgraph.ops for t in op.inputs + op.outputs if t in tensors}
    lower: tuple[DType, ...] = ("bfloat16", "float16")
    found = next((low for low in lower if low in dtypes), compute)
    if found == "float32" and any(op.op_type in _LOOSE_FLOAT_OPS for op in subgraph.ops):
        return "float16"
    return found


def clear() -> None:
    with _lock:
        _verdicts.clear()
