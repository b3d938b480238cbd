"""What the cuda plugin can run, decided from the subgraph alone (cheap, pure: no torch, NVML or Triton)."""

from __future__ import annotations

from dspark.graph import Subgraph
from dspark.sdk import reference_problem
from dspark.sdk import unsupported_ops as reference_unsupported

PLUGIN = "cuda"


def unsupported_ops(subgraph: Subgraph) -> list[str]:
    """Op types with no CUDA kernel: the plugin runs the torch reference's kernels on the GPU,
    and the reference runs what they do not cover exactly on the host only."""
    return reference_unsupported(subgraph)


def why_not(subgraph: Subgraph) -> str | None:
    """Why the plugin cannot run ``subgraph`` at all; None when it can (its own variants included).

    Whether a variant can be built at all is :func:`dspark_plugins_cuda.quantize.why_not`.
    """
    if subgraph.quantized_by == PLUGIN:
        return None
    if subgraph.quantized_by is not None:
        return f"quantized by plugin {subgraph.quantized_by!r}: this plugin has no kernels for its payload"
    if (problem := reference_problem(subgraph)) is not None:
        return f"no CUDA kernel: {problem}"
    return None


def peak_memory_bytes(subgraph: Subgraph) -> int:
    """Weights (a variant's at their packed size) + inputs + every tensor the ops produce: an
    upper bound, since eager execution keeps intermediates alive until the run ends."""
    tensors = subgraph.graph.tensors
    produced = [t for op in subgraph.ops for t in op.outputs if t]
    act = sum((tensors[t].nbytes() or 0) for t in subgraph.inputs + produced if t in tensors)
    weights = subgraph.param_bytes
    if subgraph.quantized_by == PLUGIN:
        weights = sum(p.nbytes for p in subgraph.payload.values())
    return int(weights + act)
