"""The graph data model the hooks receive.

Ops use ONNX operator semantics (``op_type`` + ``domain``, opset in
``Graph.opset``): two of the three built-in runtimes consume ONNX directly and
OpenVINO reads it natively, so a subgraph can be handed to any of them as an
ONNX model (:meth:`Subgraph.to_onnx`). Importers from torch and ONNX files
fill this model; a subgraph is a set of op names over one graph.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dspark.graph.control_flow import graphs_of
from dspark.graph.elements import Dim, Op, TensorSpec, dtype_of, numpy_dtype
from dspark.graph.flops import annotate_costs

__all__ = ["Dim", "Graph", "Op", "Subgraph", "TensorSpec", "dtype_of", "numpy_dtype"]

if TYPE_CHECKING:
    import onnx


def _attr_key(value: Any) -> Any:
    """An attribute as a cache key: a control-flow body (GraphProto) by the hash of its bytes, not its text."""
    bodies = graphs_of(value)
    if not bodies:
        return value
    digests = [hashlib.sha256(b.SerializeToString(deterministic=True)).hexdigest()[:16] for b in bodies]
    return digests[0] if not isinstance(value, (list, tuple)) else digests


class Graph(BaseModel):
    """A model's compute graph: ops in topological order plus tensor metadata."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    name: str = "graph"
    opset: int = 17
    ops: list[Op]
    tensors: dict[str, TensorSpec]
    inputs: list[str]
    outputs: list[str]
    initializers: dict[str, np.ndarray] = Field(default_factory=dict)
    dim_hints: dict[str, int] = Field(
        default_factory=dict, description="Representative sizes of symbolic dims, for cost estimates."
    )

    @model_validator(mode="after")
    def _check(self) -> Graph:
        names = set()
        produced = set(self.inputs) | set(self.initializers)
        for op in self.ops:
            if op.name in names:
                raise ValueError(f"duplicate op name {op.name!r}")
            names.add(op.name)
            for t in op.inputs:
                if t and t not in produced:
                    raise ValueError(
                        f"op {op.name!r} ({op.op_type}) reads tensor {t!r} that no earlier op, "
                        "graph input or initializer produces (ops must be in topological order)"
                    )
            produced.update(o for o in op.outputs if o)
        for t in self.outputs:
            if t not in produced:
                raise ValueError(f"graph output {t!r} is never produced")
        return self

    def op(self, name: str) -> Op:
        try:
            return self._ops_by_name[name]
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no op {name!r}") from None

    @cached_property
    def _ops_by_name(self) -> dict[str, Op]:
        return {op.name: op for op in self.ops}

    @cached_property
    def producers(self) -> dict[str, str]:
        """Tensor name -> name of the op that produces it."""
        return {t: op.name for op in self.ops for t in op.outputs if t}

    @cached_property
    def consumers(self) -> dict[str, list[str]]:
        """Tensor name -> names of the ops that read it."""
        out: dict[str, list[str]] = {}
        for op in self.ops:
            for t in op.inputs:
                if t:
                    out.setdefault(t, []).append(op.name)
        return out

    def edges(self) -> list[tuple[str, str, str]]:
        """Dependency edges as (producer op, consumer op, tensor)."""
        prod = self.producers
        return [
            (prod[t], op.name, t) for op in self.ops for t in op.inputs if t and t in prod
        ]

    def subgraph(self, op_names: list[str] | None = None) -> Subgraph:
        return Subgraph(graph=self, op_names=op_names if op_names is not None else [o.name for o in self.ops])

    @classmethod
    def from_onnx(cls, model: onnx.ModelProto | str | bytes | Path, name: str | None = None, *,
                  dim_hints: dict[str, int] | None = None, domains: Collection[str] | None = None) -> Graph:
        """Import an ONNX model (file, bytes or proto), costs annotated; see :func:`.onnx_io.read_onnx`."""
        from dspark.graph.onnx_io import read_onnx  # imports onnx, which plugins importing this module need not

        graph = cls(**read_onnx(model, name=name, dim_hints=dim_hints, domains=domains))
        annotate_costs(graph)
        return graph


class Subgraph(BaseModel):
    """A set of ops of one graph, the unit plugins bid on and compile."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    graph: Graph
    op_names: list[str] = Field(min_length=1)
    # Set when a plugin's dspark_quantize produced this variant: who made it,
    # with which spec, and the plugin-private payload (e.g. packed weights).
    quantized_by: str | None = None
    quant_spec: Any = None
    payload: Any = None

    @model_validator(mode="after")
    def _check(self) -> Subgraph:
        for n in self.op_names:
            self.graph.op(n)
        if len(set(self.op_names)) != len(self.op_names):
            raise ValueError("subgraph lists an op twice")
        return self

    @cached_property
    def ops(self) -> list[Op]:
        """The ops, in the graph's topological order."""
        chosen = set(self.op_names)
        return [op for op in self.graph.ops if op.name in chosen]

    @cached_property
    def _produced(self) -> set[str]:
        return {t for op in self.ops for t in op.outputs if t}

    @cached_property
    def inputs(self) -> list[str]:
        """Activation tensors read from outside the subgraph (graph inputs or other ops)."""
        seen: list[str] = []
        for op in self.ops:
            for t in op.inputs:
                if t and t not in self._produced and t not in self.graph.initializers and t not in seen:
                    seen.append(t)
        return seen

    @cached_property
    def params(self) -> list[str]:
        """Initializers (weights, constants) the subgraph reads."""
        seen: list[str] = []
        for op in self.ops:
            for t in op.inputs:
                if t in self.graph.initializers and t not in seen:
                    seen.append(t)
        return seen

    @cached_property
    def outputs(self) -> list[str]:
        """Tensors produced here that the rest of the graph or the caller needs."""
        chosen = set(self.op_names)
        outs: list[str] = []
        for op in self.ops:
            for t in op.outputs:
                if not t:
                    continue
                external = any(c not in chosen for c in self.graph.consumers.get(t, []))
                if external or t in self.graph.outputs:
                    outs.append(t)
        return outs

    @property
    def flops(self) -> float:
        return float(sum(op.flops or 0.0 for op in self.ops))

    @property
    def param_bytes(self) -> int:
        return sum(int(self.graph.initializers[p].nbytes) for p in self.params)

    def io_bytes(self, bindings: dict[str, int] | None = None) -> int:
        """Bytes of activations crossing the subgraph boundary (inputs + outputs)."""
        bindings = self.graph.dim_hints if bindings is None else bindings
        total = 0
        for t in self.inputs + self.outputs:
            spec = self.graph.tensors.get(t)
            n = spec.nbytes(bindings) if spec else None
            total += n or 0
        return total

    def signature(self) -> str:
        """A stable key for caches: op types, attributes, shapes and dtypes, not names or values."""
        rename: dict[str, str] = {}

        def key(t: str) -> Any:
            if not t:
                return None
            spec = self.graph.tensors.get(t)
            desc = [spec.dtype, list(spec.shape) if spec.rank_known else None] if spec else None
            if t not in rename:
                rename[t] = f"t{len(rename)}"
            return [rename[t], desc, t in self.graph.initializers]

        body = [
            [op.domain, op.op_type, sorted((k, _attr_key(v)) for k, v in op.attrs.items()),
             [key(t) for t in op.inputs], [key(t) for t in op.outputs]] + ([len(op.captures)] if op.captures else [])
            for op in self.ops
        ]
        extra = [self.quantized_by, repr(self.quant_spec)] if self.quantized_by else []
        blob = json.dumps([self.graph.opset, body, extra], sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def to_onnx(self, *, dynamic: bool = False) -> onnx.ModelProto:
        """This subgraph as a standalone ONNX model (inputs, weights as initializers, outputs)."""
        from dspark.graph.onnx_io import ops_to_onnx

        g = self.graph
        return ops_to_onnx(self.ops, self.inputs, self.outputs, self.params, name=g.name, opset=g.opset,
                           tensors=g.tensors, initializers=g.initializers, dynamic=dynamic)
