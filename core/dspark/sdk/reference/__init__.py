"""The torch reference executor, for plugins that wrap it.

A plugin that runs subgraphs with torch (on its own device, or as a fallback
for ops it has no kernel for) builds a :class:`ReferenceExecutable` instead of
reaching into its internals (:mod:`.executable`), whose members may change.
:func:`reference_problem` and :func:`unsupported_ops` answer "can the reference's
torch kernels run this?" without importing torch. The reference runs a node its
kernels do not cover exactly (an older opset's meaning, an attribute, a dtype)
through ``onnx.reference`` on the host, so on any other device such a node is
unsupported.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark.sdk.reference.names import TORCH_KERNEL_OPS
from dspark.graph.model import Subgraph

REFERENCE_OPS: frozenset[str] = TORCH_KERNEL_OPS
"""ONNX op types (default domain) the reference runs with its own torch kernels."""


def unsupported_ops(subgraph: Subgraph) -> list[str]:
    """The op types of ``subgraph`` no torch kernel of the reference runs exactly, in op order."""
    from dspark.sdk.reference.support import host_only_ops

    return [op.op_type for op in host_only_ops(subgraph)]


def reference_problem(subgraph: Subgraph) -> str | None:
    """Why the reference's torch kernels cannot run all of ``subgraph`` on a torch device; None when they can."""
    from dspark.sdk.reference.support import kernel_problem, subgraph_problem

    if (problem := subgraph_problem(subgraph)) is not None:
        return problem
    for op in subgraph.ops:
        if (why := kernel_problem(op, subgraph.graph)) is not None:
            return f"{op.op_type} {op.name!r}: {why}"
    return None


class ReferenceExecutable:
    """Runs ``subgraph`` op by op with the torch reference kernels on one torch device.

    ``device`` is a torch device string (``"cpu"``, ``"cuda:0"``). Weights are moved
    to it once; :meth:`run` copies inputs in and outputs back to the host.
    Importing torch happens here, not when this module is imported.
    """

    def __init__(self, subgraph: Subgraph, device: str) -> None:
        import torch

        from dspark.sdk.reference.executable import TorchExecutable

        self._torch = torch
        self._inner = TorchExecutable(subgraph, device)
        self.device = device
        self.inputs: list[str] = list(subgraph.inputs)
        self.outputs: list[str] = list(subgraph.outputs)

    @property
    def torch(self) -> Any:
        """The torch module the executable runs with (for precision flags, streams, devices)."""
        return self._torch

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The subgraph's outputs for ``inputs`` (host arrays in, host arrays out)."""
        return self._inner.run(inputs)

    def run_all(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor the subgraph computes, not only its outputs (for per-op checks)."""
        return self._inner.run_all(inputs)
