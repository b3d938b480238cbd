"""Control flow (``If``, ``Loop``, ``Scan``, any op with subgraph attributes) as single ops.

A control-flow node is imported as one :class:`~dspark.graph.elements.Op`
whose graph attributes (``then_branch``, ``body``, ...) stay ``onnx.GraphProto``
values in ``attrs``. The outer-scope tensors its bodies read are appended to
``op.inputs`` and named in ``op.captures``, so partitioning and the executor
see every dependency; they are not inputs of the ONNX node
(:attr:`Op.node_inputs` are). Costs: :func:`trip_count` and
:func:`combine_body_flops` turn the bodies' FLOPs into the op's.

Duck-typed over protobuf messages, so importing this module (the graph's
public API does) never imports onnx.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dspark.graph.elements import Op, TensorSpec

__all__ = [
    "ASSUMED_TRIP_COUNT", "body_op_types", "combine_body_flops", "free_names", "graphs_of",
    "has_subgraphs", "iter_body_nodes", "node_captures", "op_graphs", "trip_count",
]

# A Loop whose trip count is not a constant (a run-time input, or only a
# condition) is costed as this many runs of its body; a Scan over a symbolic
# axis without a dim hint likewise. The placer needs a number; this one says
# "several", so a loop is never priced as cheap as a single pass.
ASSUMED_TRIP_COUNT = 10


def _is_graph(value: Any) -> bool:
    return type(value).__name__ == "GraphProto"


def graphs_of(value: Any) -> list[Any]:
    """The ``GraphProto``s in an attribute value (one graph, or a list of them for GRAPHS)."""
    if _is_graph(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if _is_graph(v)]
    return []


def op_graphs(op: Op) -> list[Any]:
    """Every subgraph attribute of ``op``, in attribute order."""
    return [g for v in op.attrs.values() for g in graphs_of(v)]


def has_subgraphs(op: Op) -> bool:
    """True for a control-flow op (one carrying subgraph attributes)."""
    return bool(op_graphs(op))


def _node_graphs(node: Any) -> list[Any]:
    """The subgraphs of an ``onnx.NodeProto``'s attributes (GRAPH = 5, GRAPHS = 10)."""
    out: list[Any] = []
    for attr in node.attribute:
        if attr.type == 5:
            out.append(attr.g)
        elif attr.type == 10:
            out.extend(attr.graphs)
    return out


def node_has_subgraphs(node: Any) -> bool:
    return bool(_node_graphs(node))


def free_names(graph: Any) -> list[str]:
    """Tensors ``graph`` (a body) reads from outer scopes, nested bodies included, in first-use order."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    free: list[str] = []

    def use(name: str) -> None:
        if name and name not in defined and name not in free:
            free.append(name)

    for node in graph.node:
        for t in node.input:
            use(t)
        for sub in _node_graphs(node):
            for t in free_names(sub):
                use(t)
        defined.update(o for o in node.output if o)
    for out in graph.output:  # a branch may return an outer value as it is
        use(out.name)
    return free


def node_captures(node: Any) -> list[str]:
    """Outer-scope tensors a node's subgraphs read that are not already among its inputs."""
    own = set(node.input)
    found: list[str] = []
    for sub in _node_graphs(node):
        found += [t for t in free_names(sub) if t not in own and t not in found]
    return found


def iter_body_nodes(op: Op) -> Iterator[Any]:
    """Every ``onnx.NodeProto`` inside ``op``'s subgraphs, nested bodies included."""
    stack = list(op_graphs(op))
    while stack:
        graph = stack.pop()
        for node in graph.node:
            yield node
            stack.extend(_node_graphs(node))


def body_op_types(op: Op) -> frozenset[tuple[str, str]]:
    """(domain, op type) of every node inside ``op``'s subgraphs ('' for the default domain)."""
    return frozenset(("" if n.domain == "ai.onnx" else n.domain, n.op_type) for n in iter_body_nodes(op))


def _dim(spec: TensorSpec | None, axis: int, hints: Mapping[str, int]) -> int | None:
    if spec is None or not -len(spec.shape) <= axis < len(spec.shape):
        return None
    d = spec.shape[axis]
    return d if isinstance(d, int) else hints.get(d)


def trip_count(op: Op, tensors: Mapping[str, TensorSpec], hints: Mapping[str, int],
               constants: Mapping[str, Any], opset: int) -> tuple[int, bool]:
    """(runs of the body per run of ``op``, whether that number is known rather than assumed).

    Loop: the constant ``M`` (an initializer or a ``Constant``'s value in
    ``constants``), else :data:`ASSUMED_TRIP_COUNT`; a constant false initial
    condition runs it zero times. Scan: the scan axis of its first scan input
    (times the batch for opset-8 Scan). Anything else (If, an op with a
    function-like body) runs its body once.
    """
    inputs = op.node_inputs
    if op.op_type == "Loop":
        m = constants.get(inputs[0]) if inputs and inputs[0] else None
        cond = constants.get(inputs[1]) if len(inputs) > 1 and inputs[1] else None
        if cond is not None and not bool(_scalar(cond)):
            return 0, True
        return (max(int(_scalar(m)), 0), True) if m is not None else (ASSUMED_TRIP_COUNT, False)
    if op.op_type == "Scan":
        n_scan = int(op.attrs.get("num_scan_inputs", 1))
        if opset < 9:  # Scan-8: optional sequence_lens first, batch axis 0, scan axis 1
            first = inputs[len(inputs) - n_scan] if n_scan else ""
            spec = tensors.get(first)
            batch, steps = _dim(spec, 0, hints), _dim(spec, 1, hints)
            if batch is None or steps is None:
                return ASSUMED_TRIP_COUNT, False
            return batch * steps, True
        axes = list(op.attrs.get("scan_input_axes", [0] * n_scan))
        first = inputs[len(inputs) - n_scan] if n_scan else ""
        steps = _dim(tensors.get(first), int(axes[0]) if axes else 0, hints)
        return (steps, True) if steps is not None else (ASSUMED_TRIP_COUNT, False)
    return 1, True


def _scalar(value: Any) -> Any:
    try:
        return value.reshape(-1)[0] if hasattr(value, "reshape") and value.size else value
    except (AttributeError, IndexError):
        return value


def combine_body_flops(op: Op, body_flops: Sequence[float | None], trips: int) -> float | None:
    """The op's FLOPs from its bodies': the costlier branch of an If (which one runs is known only
    at run time), ``trips`` runs of a Loop's or Scan's body, one run of each body of anything else."""
    if not body_flops or any(f is None for f in body_flops):
        return None
    known = [float(f) for f in body_flops if f is not None]
    if op.op_type == "If":
        return max(known)
    total = math.fsum(known)
    return total * trips if op.op_type in ("Loop", "Scan") else total
