"""The graph model (public plugin API): tensors, ops, graphs and the subgraphs plugins bid on.

:mod:`.elements` holds tensor specs and ops, :mod:`.model` the graph and subgraph
types; :mod:`.onnx_io` reads and writes ONNX,
:mod:`.flops` annotates op costs, :mod:`.importers` turns PyTorch, ONNX and
other sources into ONNX files.
"""

from __future__ import annotations

from dspark.graph.model import Dim, Graph, Op, Subgraph, TensorSpec, dtype_of, numpy_dtype

__all__ = ["Dim", "Graph", "Op", "Subgraph", "TensorSpec", "dtype_of", "numpy_dtype"]
