"""``dspark_compile``: a subgraph compiled by OpenVINO, run through one persistent InferRequest."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dspark.graph import Subgraph
from dspark.types import Device
from dspark_plugins_cpu import runtime, support


def _port_index(ports: list[Any], name: str, what: str) -> int:
    for i, port in enumerate(ports):
        if name in port.get_names():
            return i
    raise KeyError(f"compiled model has no {what} tensor named {name!r}")


class OpenVINOExecutable:
    """Runs one compiled subgraph; thread-safe (one InferRequest, used under a lock)."""

    def __init__(self, subgraph: Subgraph, device: Device) -> None:
        self.device_name = runtime.ov_device(device)
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        model = support.read_model(subgraph)
        self.compiled = runtime.core().compile_model(model, self.device_name,
                                                     runtime.compile_config(self.device_name))
        # Map by tensor name, not position: the ONNX frontend keeps the names.
        in_ports = list(self.compiled.inputs)
        out_ports = list(self.compiled.outputs)
        self._in = [(n, _port_index(in_ports, n, "input"), in_ports[_port_index(in_ports, n, "input")]
                     .get_element_type().to_dtype()) for n in self.inputs]
        self._out = [(n, _port_index(out_ports, n, "output")) for n in self.outputs]
        self._request = self.compiled.create_infer_request()
        self._lock = threading.Lock()

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise KeyError(f"missing inputs {missing}; this subgraph reads {self.inputs}")
        feed = {i: np.ascontiguousarray(inputs[n], dtype=dt) for n, i, dt in self._in}
        with self._lock:
            self._request.infer(feed)
            # Copy out: the request's output buffers are reused by the next call.
            return {n: np.array(self._request.get_output_tensor(i).data, copy=True) for n, i in self._out}


def compile_subgraph(subgraph: Subgraph, device: Device) -> OpenVINOExecutable | None:
    if subgraph.quantized_by is not None:
        return None
    return OpenVINOExecutable(subgraph, device)
