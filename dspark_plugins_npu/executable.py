"""Compiling a subgraph into an ONNX Runtime session on one execution provider."""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark.graph import Subgraph
from dspark.types import Device
from dspark_plugins_npu import session
from dspark_plugins_npu.export import to_model
from dspark_plugins_npu.quantize import QuantPayload


def ep_of(device: Device) -> tuple[str, int]:
    """The execution provider and device index a Device record of this plugin stands for."""
    return str(device.properties["execution_provider"]), int(device.properties.get("device_index", 0))


def compile_subgraph(subgraph: Subgraph, device: Device, plugin: str) -> OrtExecutable | None:
    """The ``dspark_compile`` hook: None for another plugin's variant or a device record without a provider."""
    if subgraph.quantized_by not in (None, plugin) or "execution_provider" not in device.properties:
        return None
    return OrtExecutable(subgraph, device)


def serialize(subgraph: Subgraph) -> bytes:
    return bytes(to_model(subgraph).SerializeToString())


def model_bytes(subgraph: Subgraph) -> bytes:
    """The ONNX model a session runs: the float subgraph, or one of our quantized variants' payload."""
    if subgraph.quantized_by is None:
        return serialize(subgraph)
    payload = subgraph.payload
    if not isinstance(payload, QuantPayload):
        raise TypeError(f"a variant quantized by {subgraph.quantized_by!r} carries a "
                        f"{type(payload).__name__} payload, not this plugin's QuantPayload")
    return payload.model


def model_format(subgraph: Subgraph) -> str:
    """What distinguishes models of the same signature: float, or the quantized format."""
    payload = subgraph.payload
    return payload.format if isinstance(payload, QuantPayload) else "float"


def _c_order(array: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape: ``np.ascontiguousarray`` would make a 0-d array 1-d."""
    return np.asarray(array, order="C")


class OrtExecutable:
    """One subgraph as an InferenceSession; ``run`` maps subgraph tensor names to host arrays."""

    def __init__(self, subgraph: Subgraph, device: Device, *, record_assignment: bool = False) -> None:
        ep, index = ep_of(device)
        self.execution_provider = ep
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        self.session: Any = session.create(model_bytes(subgraph), ep, index, record_assignment=record_assignment)
        # InferenceSession.run re-validates the feed names and wraps fallback handling on every call,
        # a large share of a small op's call; the session was created without fallback, so the
        # bound C++ run is called directly, with RunOptions made once.
        self._single = (self.inputs[0], self.outputs[0]) if len(self.inputs) == len(self.outputs) == 1 else None
        # The closures hold locals, not self: no reference cycle keeps a session's weights alive.
        sess, outputs, run_options = self.session, self.outputs, session.ort().RunOptions()
        inner = getattr(sess, "_sess", None)
        if inner is not None and callable(getattr(inner, "run", None)):
            self._run: Any = lambda feeds: inner.run(outputs, feeds, run_options)
        else:  # an ORT without the private binding: the public path
            self._run = lambda feeds: sess.run(outputs, feeds, run_options)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = {name: _c_order(inputs[name]) for name in self.inputs}
        return dict(zip(self.outputs, self._run(feeds), strict=True))

    def run_torch(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``run`` on torch tensors (API 1.2). Host tensors and results share memory with the numpy arrays
        ORT reads and writes (no copies); tensors on another device go through the host."""
        import torch  # already loaded when torch tensors come in: a dict lookup

        if self._single is not None:  # one projection per decode step: the shortest path
            i, o = self._single
            t = inputs[i]
            if t.is_cpu and not t.requires_grad:
                return {o: torch.from_numpy(self._run({i: _c_order(t.numpy())})[0])}
        feeds: dict[str, np.ndarray] = {}
        device = None
        for name in self.inputs:
            t = inputs[name]
            if not t.is_cpu:
                device, t = t.device, t.cpu()
            feeds[name] = _c_order(t.detach().numpy())
        out = {name: torch.from_numpy(v) for name, v in zip(self.outputs, self._run(feeds), strict=True)}
        return out if device is None else {name: v.to(device) for name, v in out.items()}

    def assignment(self) -> dict[str, int]:
        """Nodes per EP after ORT's partitioning (when built with ``record_assignment``)."""
        return session.assigned_nodes(self.session)
