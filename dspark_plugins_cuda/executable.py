"""dspark_compile: float subgraphs on the torch reference executor pinned to one GPU and IEEE
float32, the plugin's own quantized variants on its Triton kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
from dspark.graph import Subgraph
from dspark.sdk import ReferenceExecutable
from dspark.types import Device, Executable, QuantSpec

from dspark_plugins_cuda.precision import fp32_mode
from dspark_plugins_cuda.support import PLUGIN


def compile_subgraph(subgraph: Subgraph, device: Device) -> Executable | None:
    """The ``dspark_compile`` hook: None for another plugin's variant (never bid on, see bidding.py)."""
    if subgraph.quantized_by == PLUGIN:
        return QuantExecutable(subgraph, device.id)
    if subgraph.quantized_by is not None:
        return None
    return CudaExecutable(subgraph, device.id)


class CudaExecutable:
    """Wraps :class:`dspark.sdk.ReferenceExecutable` (weights moved to the GPU once,
    inputs/outputs copied per run) and keeps TF32 off so results stay within the
    float32 tolerance the bid promised."""

    def __init__(self, subgraph: Subgraph, device_id: str) -> None:
        self._inner = ReferenceExecutable(subgraph, device_id)
        self.device = device_id

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with fp32_mode(self._inner.torch, tf32=False):
            return self._inner.run(inputs)


class QuantExecutable:
    """Runs a cuda-quantized variant with the Triton kernels, one launch per MatMul
    (two with dynamic int8 activations).

    ``run_torch`` takes and returns tensors on the GPU (any number of rows, float32, float16
    or bfloat16; outputs in the input's dtype); ``run`` wraps it with host copies.
    """

    def __init__(self, subgraph: Subgraph, device_id: str) -> None:
        import torch

        from dspark_plugins_cuda.triton_quant import QuantLinear

        if subgraph.quantized_by != PLUGIN:
            raise ValueError(f"not a {PLUGIN} variant (quantized_by={subgraph.quantized_by!r})")
        spec: QuantSpec = subgraph.quant_spec
        self._torch = torch
        self.device = torch.device(device_id)
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        a8 = spec.activations == "dynamic_int8"
        self._steps = [(op.inputs[0], op.outputs[0],
                        QuantLinear(subgraph.payload[op.inputs[1]], self.device, dynamic_int8=a8))
                       for op in subgraph.ops]
        # Triton launches on the current CUDA device: switch only when it is another one.
        self._index = self.device.index if self.device.type == "cuda" else None

    def run_torch(self, inputs: dict[str, Any]) -> dict[str, Any]:
        torch = self._torch
        if self._index is not None and self._index != torch.cuda.current_device():
            with torch.cuda.device(self._index):
                return self._evaluate(inputs)
        return self._evaluate(inputs)

    def _evaluate(self, inputs: dict[str, Any]) -> dict[str, Any]:
        env = dict(inputs)
        for x_name, y_name, linear in self._steps:
            env[y_name] = linear(env[x_name])
        return {name: env[name] for name in self.outputs}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        feeds = {name: torch.from_numpy(np.ascontiguousarray(inputs[name])).to(self.device)
                 for name in self.inputs}
        return {name: t.cpu().numpy() for name, t in self.run_torch(feeds).items()}
