"""A subgraph as the ONNX model ONNX Runtime loads (used by the executable and by quantize)."""

from __future__ import annotations

from typing import Any

from dspark.graph import Subgraph


def to_model(subgraph: Subgraph) -> Any:
    """The subgraph as an ``onnx.ModelProto`` that ONNX Runtime loads."""
    model = subgraph.to_onnx()
    # to_onnx() imports only the default domain's opset; ORT rejects a node of any
    # other domain (com.microsoft contrib ops, custom ops) without its own import.
    imported = {o.domain for o in model.opset_import}
    for domain in sorted({n.domain for n in model.graph.node} - imported - {"ai.onnx"}):
        model.opset_import.add(domain=domain, version=1)
    return model
