"""Compiling a subgraph into an ONNX Runtime session on one execution provider."""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark.graph import Subgraph
from dspark.types import Device
from dspark_plugins_npu import session


def ep_of(device: Device) -> tuple[str, int]:
    """The execution provider and device index a Device record of this plugin stands for."""
    return str(device.properties["execution_provider"]), int(device.properties.get("device_index", 0))


def serialize(subgraph: Subgraph) -> bytes:
    model = subgraph.to_onnx()
    # to_onnx() imports only the default domain's opset; ORT rejects a node of any
    # other domain (com.microsoft contrib ops, custom ops) without its own import.
    imported = {o.domain for o in model.opset_import}
    for domain in sorted({n.domain for n in model.graph.node} - imported - {"ai.onnx"}):
        model.opset_import.add(domain=domain, version=1)
    return bytes(model.SerializeToString())


class OrtExecutable:
    """One subgraph as an InferenceSession; ``run`` maps subgraph tensor names to host arrays."""

    def __init__(self, subgraph: Subgraph, device: Device, *, record_assignment: bool = False) -> None:
        ep, index = ep_of(device)
        self.execution_provider = ep
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        self.session: Any = session.create(serialize(subgraph), ep, index, record_assignment=record_assignment)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: np.ascontiguousarray(inputs[name]) for name in self.inputs}
        results = self.session.run(self.outputs, feeds)
        return dict(zip(self.outputs, results, strict=True))

    def assignment(self) -> dict[str, int]:
        """Nodes per EP after ORT's partitioning (when built with ``record_assignment``)."""
        return session.assigned_nodes(self.session)
