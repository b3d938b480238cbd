"""The graph model (public plugin API): tensors, ops, graphs and the subgraphs plugins bid on.

:mod:`.elements` holds tensor specs and ops, :mod:`.model` the graph and subgraph
types; :mod:`.onnx_io` reads and writes ONNX,
:mod:`.flops` annotates op costs, :mod:`.control_flow` holds control-flow ops'
bodies and captures, :mod:`.importers` turns PyTorch, ONNX and
other sources into ONNX files (:mod:`.jax_import`: JAX functions and Flax modules).
"""

from __future__ import annotations

from dspark.graph.control_flow import (
    ASSUMED_TRIP_COUNT,
    body_op_types,
    free_names,
    has_subgraphs,
    iter_body_nodes,
    op_graphs,
)
from dspark.graph.model import Dim, Graph, Op, Subgraph, TensorSpec, dtype_of, numpy_dtype

__all__ = ["ASSUMED_TRIP_COUNT", "Dim", "Graph", "Op", "Subgraph", "TensorSpec", "body_op_types", "dtype_of",
           "free_names", "has_subgraphs", "iter_body_nodes", "numpy_dtype", "op_graphs"]
