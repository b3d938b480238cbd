"""What the torch reference can run faithfully: a cheap, pure check (no torch import).

Each op runs with a torch kernel (:mod:`dspark.sdk.reference.ops`) when the
kernel implements the node exactly at the model's opset, with its attributes,
dtypes and outputs; otherwise with ``onnx.reference`` on the host (which
follows the opset itself; control flow, ``If``/``Loop``/``Scan`` with their
bodies, always runs there); otherwise the reference abstains. The rules come
from ONNX's backend node tests (docs/onnx-node-conformance.md).
"""

from __future__ import annotations

from dspark.graph import body_op_types
from dspark.graph.control_flow import iter_body_nodes
from dspark.graph.model import Graph, Op, Subgraph, dtype_of
from dspark.sdk.reference.names import TORCH_KERNEL_OPS

# Tensor dtypes torch holds natively (bfloat16 crosses to numpy through ml_dtypes).
TORCH_DTYPES: frozenset[str] = frozenset({
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
})
# Default-domain ops onnx.reference has no (working) implementation for.
NO_REFERENCE_OPS: frozenset[str] = frozenset({"Scatter", "ImageDecoder"})
# Ops onnx.reference implements only in their newer form: older opsets are abstained on.
_REFERENCE_FROM_OPSET: dict[str, int] = {"Resize": 11, "Hardmax": 13, "Scan": 9}
_POOLS = frozenset({"MaxPool", "AveragePool"})


def _shape(graph: Graph, name: str) -> tuple[int | str, ...] | None:
    spec = graph.tensors.get(name)
    return spec.shape if spec is not None else None


def _dtype(graph: Graph, name: str) -> str | None:
    spec = graph.tensors.get(name)
    if spec is not None:
        return spec.dtype
    init = graph.initializers.get(name)  # graphs built in code may give weights no spec
    return dtype_of(init) if init is not None else None


def _pool_problem(op: Op, graph: Graph) -> str | None:
    a = op.attrs
    if a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return f"auto_pad={a['auto_pad']}"
    if len([o for o in op.outputs if o]) > 1:
        return "second output (indices)"
    kernel = [int(k) for k in a.get("kernel_shape", [])]
    pads = [int(p) for p in a.get("pads", [0] * 2 * len(kernel))]
    dil = [int(d) for d in a.get("dilations", [1] * len(kernel))]
    if any(p > ((k - 1) * d + 1) // 2 for p, k, d in zip(pads, kernel * 2, dil * 2, strict=False)):
        return "pads over half the kernel"
    if op.op_type == "AveragePool" and (any(d != 1 for d in dil) or pads[:len(kernel)] != pads[len(kernel):]):
        return "dilated or asymmetric AveragePool"
    if int(a.get("storage_order", 0)):
        return "storage_order"
    return None


def kernel_problem(op: Op, graph: Graph) -> str | None:
    """Why the torch kernel cannot run ``op`` exactly (it then runs via onnx.reference), or None."""
    if op.domain not in ("", "ai.onnx") or op.op_type not in TORCH_KERNEL_OPS:
        return "no torch kernel"
    t, opset, a = op.op_type, graph.opset, op.attrs
    outs = [o for o in op.outputs if o]
    in_dtype = _dtype(graph, op.inputs[0]) if op.inputs and op.inputs[0] else None
    if t in _POOLS:
        return _pool_problem(op, graph)
    if t == "Conv" and a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return f"auto_pad={a['auto_pad']}"
    if t == "LayerNormalization" and len(outs) > 1:
        return "Mean / InvStdDev outputs"
    if t == "BatchNormalization" and (opset < 9 or len(outs) > 1 or int(a.get("training_mode", 0))):
        return "training mode or pre-opset-9 BatchNormalization"
    if t == "Reshape" and opset < 5:
        return "Reshape before opset 5 (shape attribute)"
    if t in ("ReduceMax", "ReduceMin") and 0 in (_shape(graph, op.inputs[0]) or ()):
        return "reduction over an empty set"
    if t == "ReduceMean" and in_dtype not in ("float32", "float64", "float16", "bfloat16"):
        return "integer ReduceMean"
    if t == "Constant" and not any(k in a for k in ("value", "value_float", "value_int", "value_floats",
                                                   "value_ints")):
        return "Constant of a sparse or string value"
    if t == "Gemm" and opset < 7:
        return "Gemm before opset 7 (broadcast attribute)"
    if t in ("Max", "Min", "Sum", "Mean") and opset < 8:
        return f"{t} before opset 8 (no broadcasting)"
    if t in ("Add", "Sub", "Mul", "Div", "Pow") and opset < 7:
        return f"{t} before opset 7 (broadcast attribute)"
    if t == "Split" and opset < 2:
        return "Split before opset 2"
    return None


def reference_problem(op: Op, graph: Graph) -> str | None:
    """Why ``onnx.reference`` cannot stand in for ``op`` on the host, or None.

    A control-flow op runs whole through it, bodies included, so every node
    of its bodies is held to the same rules.
    """
    if (why := _loop_problem(op, graph)) is not None:
        return why
    for domain, op_type in [(op.domain, op.op_type), *sorted(body_op_types(op))]:
        if domain not in ("", "ai.onnx"):
            return f"op {op_type} of domain {domain!r}: the graph keeps no opset for it"
        if op_type in NO_REFERENCE_OPS:
            return f"onnx.reference has no working {op_type}"
        since = _REFERENCE_FROM_OPSET.get(op_type)
        if since is not None and graph.opset < since:
            return f"onnx.reference runs {op_type} as opset {since} defines it, not as opset {graph.opset} did"
    return None


def _loop_problem(op: Op, graph: Graph) -> str | None:
    """Loops onnx.reference gets wrong: it stacks scan outputs with ``np.vstack``, right only when
    each iteration's value is 1-D (a scalar comes out (N, 1), a matrix (N*a, b)), and it runs a
    Loop whose condition input is omitted zero times (ONNX: a for loop of M trips)."""
    stacks = "onnx.reference stacks Loop scan outputs other than 1-D per iteration wrongly"
    no_cond = "onnx.reference runs a Loop without a condition input zero times"
    if op.op_type == "Loop":
        if len(op.node_inputs) < 2 or not op.node_inputs[1]:
            return no_cond
        carried = max(len(op.node_inputs) - 2, 0)
        for t in op.outputs[carried:]:
            shape = _shape(graph, t)
            if t and (shape is None or len(shape) != 2):
                return stacks
    for node in iter_body_nodes(op):  # a nested Loop's ranks are not known here: any scan output is refused
        if node.op_type == "Loop" and (len(node.input) < 2 or not node.input[1]):
            return no_cond
        if node.op_type == "Loop" and len(node.output) > max(len(node.input) - 2, 0):
            return stacks
    return None


def subgraph_problem(subgraph: Subgraph) -> str | None:
    """Why the torch reference cannot run ``subgraph`` at all, or None (then it bids)."""
    graph = subgraph.graph
    for op in subgraph.ops:
        for name in (*op.inputs, *op.outputs):
            if not name:
                continue
            dtype = _dtype(graph, name)
            if dtype is None:
                return f"{op.op_type}: tensor {name!r} has no known dtype"
            if dtype not in TORCH_DTYPES:
                return f"{op.op_type}: tensor {name!r} is {dtype}, which torch does not hold"
        if kernel_problem(op, graph) is not None and (why := reference_problem(op, graph)) is not None:
            return why
    return None


def host_only_ops(subgraph: Subgraph) -> list[Op]:
    """The ops that run through onnx.reference (on the host CPU only)."""
    return [op for op in subgraph.ops if kernel_problem(op, subgraph.graph) is not None]
