"""dspark_quantize for the cuda plugin: int8 / int4 weight variants of MatMul subgraphs.

A variant covers a subgraph made only of MatMuls whose right operand is a 2-D float32
weight initializer (``dspark.sdk.linear_subgraph`` builds one per LLM projection). Its
payload maps each weight name to a :class:`~dspark_plugins_cuda.triton_quant.PackedWeight`
(numpy arrays: built without a GPU, moved to it by the executable). Variants are priced in
:mod:`.bidding` and run by :class:`.executable.QuantExecutable`; Triton is imported only once
the device can use it.
"""

from __future__ import annotations

from dspark.graph import Subgraph
from dspark.sdk import quantizable_weights, quantize_weight
from dspark.types import Device, QuantSpec

from dspark_plugins_cuda.support import PLUGIN

MIN_COMPUTE_CAPABILITY = (8, 0)  # int8 tensor-core dots and bf16 in Triton: Ampere and later


def _compute_capability(device: Device) -> tuple[int, int] | None:
    try:
        major, minor = str(device.properties.get("compute_capability", "")).split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def why_not(subgraph: Subgraph, device: Device, spec: QuantSpec) -> str | None:
    """Why the plugin has no kernel for ``spec`` on ``subgraph`` and ``device``; None when it has one."""
    if device.kind != "cuda":
        return f"device {device.id} is not a CUDA GPU"
    if not device.properties.get("triton"):
        return "Triton is not installed"
    cc = _compute_capability(device)
    if cc is None or cc < MIN_COMPUTE_CAPABILITY:
        return f"compute capability {device.properties.get('compute_capability')} < 8.0"
    from dspark_plugins_cuda.triton_quant import (
        supported,  # imports Triton: only once it can be used
    )

    weights = quantizable_weights(subgraph)
    inits = subgraph.graph.initializers
    for op in subgraph.ops:
        if op.op_type != "MatMul" or op.domain not in ("", "ai.onnx"):
            return f"op {op.name!r} is a {op.op_type}, not a MatMul"
        if op.inputs[1] not in weights or op.inputs[0] in inits:
            return f"MatMul {op.name!r} does not multiply an activation by a 2-D float32 weight"
        x = subgraph.graph.tensors.get(op.inputs[0])
        if x is None or x.dtype not in ("float32", "float16", "bfloat16"):
            return f"MatMul {op.name!r}: activation {op.inputs[0]!r} is not float32/float16/bfloat16"
        if problem := supported(spec, int(inits[op.inputs[1]].shape[0])):
            return problem
    return None


def quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    if why_not(subgraph, device, spec) is not None:
        return None
    from dspark_plugins_cuda.triton_quant import repack

    inits = subgraph.graph.initializers
    payload = {op.inputs[1]: repack(quantize_weight(inits[op.inputs[1]], spec)) for op in subgraph.ops}
    return subgraph.model_copy(update={"quantized_by": PLUGIN, "quant_spec": spec, "payload": payload})
