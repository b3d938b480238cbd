"""``dspark_compile``: a subgraph compiled by OpenVINO, run through one persistent InferRequest.

Quantized variants (``quantized_by == "cpu"``) are compiled from the model
:mod:`dspark_plugins_cpu.quantize` builds, with the activation setting their
spec asks for. ``run_torch`` (API 1.2) feeds CPU tensors as zero-copy numpy
views and wraps the outputs the same way: this sits in the LLM's decode loop.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dspark.graph import Subgraph
from dspark.types import Device
from dspark_plugins_cpu import ports, runtime, support
from dspark_plugins_cpu.quantize import PLUGIN_NAME, build_model, dq_group_size


def _ov_tensor() -> Any:
    import openvino as ov

    return ov.Tensor


class OpenVINOExecutable:
    """Runs one compiled subgraph; thread-safe (one InferRequest, used under a lock)."""

    def __init__(self, subgraph: Subgraph, device: Device) -> None:
        self.device_name = runtime.ov_device(device)
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        config = runtime.compile_config(self.device_name)
        if subgraph.quantized_by == PLUGIN_NAME:
            model = build_model(subgraph)
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(dq_group_size(subgraph.quant_spec))
        else:
            model = support.read_model(subgraph)
        self.compiled = runtime.core().compile_model(model, self.device_name, config)
        # Map by tensor name, not position: the ONNX frontend keeps the names (see .ports for the exceptions).
        in_ports = list(self.compiled.inputs)
        self._in = [(n, i, in_ports[i].get_element_type().to_dtype())
                    for n, i in ports.input_ports(subgraph, in_ports).items() if i is not None]
        self._out = list(ports.output_ports(subgraph, list(self.compiled.outputs)).items())
        self._request = self.compiled.create_infer_request()
        self._lock = threading.Lock()
        self._tensor = _ov_tensor()

    def _check(self, inputs: dict[str, Any]) -> None:
        missing = [n for n in self.inputs if n not in inputs]
        if missing:
            raise KeyError(f"missing inputs {missing}; this subgraph reads {self.inputs}")

    def _infer(self, feed: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            # The request reads the caller's arrays in place (they live through the call), and the
            # outputs are copied out of its buffers, which the next call reuses. Setting tensors and
            # calling infer() bare costs less per call than infer(dict).
            for i, array in feed.items():
                if not array.flags.writeable:  # OpenVINO only shares writeable buffers
                    array = array.copy()
                self._request.set_input_tensor(i, self._tensor(array, shared_memory=True))
            self._request.infer()
            return {n: self._request.get_output_tensor(i).data.copy() for n, i in self._out}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self._check(inputs)
        return self._infer({i: np.asarray(inputs[n], dtype=dt, order="C") for n, i, dt in self._in})

    def run_torch(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """``run`` on CPU torch tensors, without copying them (API 1.2)."""
        import torch

        self._check(inputs)
        feed = {}
        for n, i, dt in self._in:
            t = inputs[n]
            if t.device.type != "cpu":
                raise ValueError(f"input {n!r} is on {t.device}; the OpenVINO CPU executable takes CPU tensors")
            t = t.detach()
            feed[i] = np.asarray((t.float() if t.dtype == torch.bfloat16 else t).numpy(), dtype=dt, order="C")
        return {n: torch.from_numpy(a) for n, a in self._infer(feed).items()}


def compile_subgraph(subgraph: Subgraph, device: Device) -> OpenVINOExecutable | None:
    if subgraph.quantized_by not in (None, PLUGIN_NAME):
        return None
    return OpenVINOExecutable(subgraph, device)
