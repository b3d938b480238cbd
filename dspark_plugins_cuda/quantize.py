"""dspark_quantize for the cuda plugin, and the bid and executable of its quantized variants.

A variant covers a subgraph made only of MatMuls whose right operand is a 2-D float32
weight initializer (``dspark.sdk.quant.linear_subgraph`` builds one per LLM projection). Its
payload maps each weight name to a :class:`~dspark_plugins_cuda.triton_quant.PackedWeight`
(numpy arrays: built without a GPU, moved to it by the executable). torch and Triton are
imported only when an executable is built.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark.sdk import calibration
from dspark.graph.model import Subgraph
from dspark.sdk.quant import quantizable_weights, quantize_weight
from dspark.types import Bid, Device, QuantSpec

PLUGIN = "cuda"
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
    from dspark_plugins_cuda.triton_quant import supported  # imports Triton: only once it can be used

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


# -- bid --------------------------------------------------------------------------------------


def roofline_s(subgraph: Subgraph, device: Device) -> float:
    """max(compute, traffic) over the packed weight bytes, plus one launch per kernel.

    In decode the packed weights are nearly all the traffic, which is what quantization buys.
    """
    from dspark_plugins_cuda.bid import LAUNCH_OVERHEAD_S

    spec: QuantSpec = subgraph.quant_spec
    a8 = spec.activations == "dynamic_int8"
    weight_bytes = sum(p.nbytes for p in subgraph.payload.values())
    io = subgraph.io_bytes()
    # W8A8 reads x again to quantize it and writes/reads the int8 copy: about 2 more passes.
    traffic = io + weight_bytes + (2 * io if a8 else 0)
    bw = device.memory_bandwidth_bytes_per_s
    # int8 tensor cores run at least at the fp16 rate; fp32 activations go through TF32.
    peak = device.peak_flops.get("float16" if a8 else "tf32") or device.peak_flops.get("float32")
    compute = subgraph.flops / peak if peak else 0.0
    launches = len(subgraph.ops) * (2 if a8 else 1)
    return max(compute, traffic / bw if bw else 0.0) + launches * LAUNCH_OVERHEAD_S


def peak_memory_bytes(subgraph: Subgraph) -> int:
    from dspark_plugins_cuda.bid import peak_memory_bytes as float_peak

    packed = sum(p.nbytes for p in subgraph.payload.values())
    return int(float_peak(subgraph) - subgraph.param_bytes + packed)


def bid_variant(subgraph: Subgraph, device: Device) -> Bid | None:
    """The bid on one of this plugin's own variants: timed through dspark_compile when it can
    be (cached), else :func:`roofline_s`."""
    from dspark_plugins_cuda.bid import LAUNCH_OVERHEAD_S, _compile, _torch_version

    spec: QuantSpec = subgraph.quant_spec
    memory = peak_memory_bytes(subgraph)
    if device.memory_free_bytes is not None and memory > device.memory_free_bytes:
        return None
    runtime_key = f"{device.runtime} {_torch_version()} triton {device.properties.get('triton')}"
    est = calibration.estimate(subgraph, device, runtime_key=runtime_key, compile=_compile(device),
                               op_overhead_s=LAUNCH_OVERHEAD_S)
    latency, note = est.latency_s, est.note
    if est.source == "roofline":
        latency = roofline_s(subgraph, device) + est.fixed_overhead_s
        note = f"roofline over int{spec.weight_bits} weight bytes"
    return Bid(device_id=device.id, runtime=device.runtime, latency_s=latency, peak_memory_bytes=memory,
               precision=spec.precision, fixed_overhead_s=est.fixed_overhead_s, source=est.source,
               note=note)


# -- executable -------------------------------------------------------------------------------


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
