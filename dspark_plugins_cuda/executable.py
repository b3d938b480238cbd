"""dspark_compile: the torch reference executor, pinned to one GPU and IEEE float32."""

from __future__ import annotations

import numpy as np

from dspark.graph.model import Subgraph
from dspark_plugins_cuda.precision import fp32_mode


class CudaExecutable:
    """Wraps :class:`dspark.builtin.torch_ref.TorchExecutable` (weights moved to
    the GPU once, inputs/outputs copied per run) and keeps TF32 off so results
    stay within the float32 tolerance the bid promised."""

    def __init__(self, subgraph: Subgraph, device_id: str) -> None:
        from dspark.builtin.torch_ref import TorchExecutable

        self._inner = TorchExecutable(subgraph, device_id)
        self.device = device_id

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with fp32_mode(self._inner._torch, tf32=False):
            return self._inner.run(inputs)
