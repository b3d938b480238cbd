"""The hardware-neutral torch reference backend (plugin name ``torch``).

It can run any op on any torch device, so every op always has a bidder:
ONNX ops are executed with torch kernels (:mod:`dspark.builtin.torch_ops`);
the few that have none run through ``onnx.reference`` on the host. Its
numbers are the reference every other plugin is checked against.

Quantized variants (CPU only) run real int8/int4 kernels
(:mod:`dspark.builtin.torch_quant`). On the CPU, the LLM's unit, a one-op
linear ``x @ W`` (:func:`dspark.sdk.quant.linear_subgraph`), float or
quantized, compiles to a lean :class:`LinearExecutable` with ``run_torch``:
it sits in the decode loop, and its bid then times the kernel as the engine
calls it rather than the op-by-op interpreter's overhead. Weight-bound
linears, float or quantized, are bid with cold caches
(:func:`dspark.sdk.calibration.streams_weights`), so the two compare as in a
real decode step.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from functools import partial
from typing import Any

import numpy as np

from dspark.host import cache, hostinfo
from dspark.sdk import calibration
from dspark.builtin.op_names import TORCH_KERNEL_OPS
from dspark.graph.model import Op, Subgraph
from dspark.hookspecs import hookimpl
from dspark.sdk.quant import LINEAR_INPUT, LINEAR_OUTPUT, quantizable_weights, quantize_weight
from dspark.types import Bid, Device, QuantSpec

DSPARK_API_VERSION = "1.2"  # run_torch on LinearExecutable
RUNTIME = "torch"
_OP_OVERHEAD_S = 8e-6  # eager dispatch per op, before calibration


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _nvidia_driver_present() -> bool:
    # Checked before importing torch, which takes seconds.
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def _peak_flops(device: str, refresh: bool) -> dict[str, float]:
    key = {"bench": "torch-matmul-v2", "device": device, "torch": _torch_version(),
           **(hostinfo.fingerprint() if device == "cpu" else {"host": platform.node()})}
    if not refresh and (hit := cache.load("torch_ref", key)) is not None:
        return dict(hit)
    import torch

    result: dict[str, float] = {}
    n = 512 if device == "cpu" else 4096
    with hostinfo.cpu_benchmark_lock:
        _measure_into(result, torch, device, n)
    cache.store("torch_ref", key, result)
    return result


def _measure_into(result: dict[str, float], torch: Any, device: str, n: int) -> None:
    from dspark.sdk.cost import time_call

    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)

        def mm(a: Any = a, b: Any = b) -> None:
            torch.matmul(a, b)
            if device != "cpu":
                torch.cuda.synchronize(device)

        result[name] = 2.0 * n**3 / time_call(mm, warmup=2, repeat=5, budget_s=0.5)


@hookimpl
def dspark_probe_devices(refresh: bool) -> list[Device]:
    info = hostinfo.cpu_static()
    total, free = hostinfo.memory()
    devices = [Device(
        id="cpu", kind="cpu", name=info["model"], runtime=RUNTIME,
        memory_total_bytes=total, memory_free_bytes=free,
        peak_flops=_peak_flops("cpu", refresh),
        memory_bandwidth_bytes_per_s=hostinfo.memory_bandwidth(refresh),
        dtypes=["float32", "float64", "bfloat16", "float16", "int64", "int32", "int8", "bool"],
        utilization=hostinfo.cpu_utilization(),
        properties={"torch_version": _torch_version(), "threads": info["usable_cores"]},
    )]
    if _nvidia_driver_present():
        import torch

        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            props = torch.cuda.get_device_properties(i)
            free_b, total_b = torch.cuda.mem_get_info(i)
            devices.append(Device(
                id=f"cuda:{i}", kind="cuda", name=props.name, runtime=RUNTIME,
                memory_total_bytes=int(total_b), memory_free_bytes=int(free_b),
                peak_flops=_peak_flops(f"cuda:{i}", refresh),
                dtypes=["float32", "bfloat16", "float16", "int64", "int32", "int8", "bool"],
                properties={"torch_version": _torch_version()},
            ))
    return devices


def _supported(op: Op) -> bool:
    return op.domain in ("", "ai.onnx") and op.op_type in TORCH_KERNEL_OPS


@hookimpl
def dspark_bid(subgraph: Subgraph, device: Device) -> Bid | None:
    host_only = [op for op in subgraph.ops if not _supported(op)]
    if host_only and device.kind != "cpu":
        return None  # the onnx.reference fallback runs on the host only
    if subgraph.quantized_by not in (None, "torch"):
        return None
    if subgraph.quantized_by and device.kind != "cpu":
        return None  # the quantized kernels are CPU kernels
    precision = subgraph.quant_spec.precision if subgraph.quantized_by else "float32"
    # Timed through dspark_compile (cached); the roofline when it cannot be.
    cold = calibration.streams_weights(subgraph)
    baseline = calibration.linear_baseline(
        subgraph, lambda base: dspark_quantize(base, device, subgraph.quant_spec)) if cold else None
    est = calibration.estimate(subgraph, device, runtime_key=f"{RUNTIME} {_torch_version()}",
                               compile=lambda sg: dspark_compile(sg, device), op_overhead_s=_OP_OVERHEAD_S,
                               flush_caches=cold, cold_baseline=baseline)
    latency = est.latency_s + 2e-4 * len(host_only)  # the numpy reference is slow; never prefer it
    notes = [est.note] + ([f"{len(host_only)} op(s) via onnx.reference"] if host_only else [])
    return Bid(device_id=device.id, runtime=RUNTIME, latency_s=latency, precision=precision,
               peak_memory_bytes=_weight_bytes(subgraph) + subgraph.io_bytes(),
               fixed_overhead_s=est.fixed_overhead_s, source=est.source, note="; ".join(n for n in notes if n))


def _weight_bytes(subgraph: Subgraph) -> int:
    """What the compiled subgraph holds: a quantized weight at its packed size."""
    packed = subgraph.payload if subgraph.quantized_by == "torch" else {}
    inits = subgraph.graph.initializers
    return sum(int(packed[p].nbytes) if p in packed else int(inits[p].nbytes) for p in subgraph.params)


class TorchExecutable:
    """Runs a subgraph op by op with torch kernels on one torch device."""

    def __init__(self, subgraph: Subgraph, device: str) -> None:
        import torch

        from dspark.builtin.torch_ops import KERNELS

        self._torch = torch
        self.device = torch.device(device)
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        packed = subgraph.payload if subgraph.quantized_by == "torch" else {}
        steps: list[tuple[Op, Any]] = []
        for op in subgraph.ops:
            if _quantized_use(op, packed):
                # The packed weight is the kernel's own: the step reads no float weight ("" is None).
                unweighted = op.model_copy(update={"inputs": [op.inputs[0], "", *op.inputs[2:]]})
                steps.append((unweighted, _quantized_kernel(op, packed[op.inputs[1]])))
            elif _supported(op):
                steps.append((op, KERNELS[op.op_type]))
            else:
                steps.append((op, _reference_kernel(subgraph, op)))
        # A quantized weight is held packed only, unless another op reads it as a float.
        read = {t for op, _ in steps for t in op.inputs}
        self.weights = {k: torch.from_numpy(np.array(subgraph.graph.initializers[k])).to(self.device)
                        for k in subgraph.params if k in read}
        self.steps = steps

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = self._evaluate(inputs)
        return {name: env[name].detach().cpu().numpy() for name in self.outputs}

    def run_all(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every tensor the subgraph computes, not only its outputs (for per-op checks)."""
        env = self._evaluate(inputs)
        return {name: value.detach().cpu().numpy() for name, value in env.items() if name not in self.weights}

    def _evaluate(self, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
        torch = self._torch
        env: dict[str, Any] = dict(self.weights)
        for name in self.inputs:
            env[name] = torch.from_numpy(np.ascontiguousarray(inputs[name])).to(self.device)
        with torch.inference_mode():
            for op, fn in self.steps:
                args = [env[t] if t else None for t in op.inputs]
                attrs = op.attrs if "num_outputs" in op.attrs else {**op.attrs, "_num_outputs": len(op.outputs)}
                for name, value in zip(op.outputs, fn(attrs, args), strict=False):
                    if name:
                        env[name] = value
        return env


def _quantized_use(op: Op, packed: dict[str, Any]) -> bool:
    """``op`` reads a packed weight as its right operand (what :func:`dspark.sdk.quant.quantizable_weights` picks)."""
    return len(op.inputs) > 1 and op.inputs[1] in packed and (
        op.op_type == "MatMul" or (op.op_type == "Gemm" and not op.attrs.get("transB")))


def _quantized_kernel(op: Op, packed: Any) -> Any:
    """A step computing MatMul / Gemm(transB=0) through the packed weight's int8/int4 kernel."""
    from dspark.builtin import torch_quant

    def run(attrs: dict[str, Any], args: list[Any]) -> list[Any]:
        a = args[0]
        if op.op_type == "MatMul":
            return [torch_quant.apply(packed, a).to(a.dtype)]
        if attrs.get("transA"):
            a = a.T
        y = torch_quant.apply(packed, a) * float(attrs.get("alpha", 1.0))
        if len(args) > 2 and args[2] is not None:
            y = y + float(attrs.get("beta", 1.0)) * args[2]
        return [y.to(a.dtype)]

    return run


class LinearExecutable:
    """One linear ``y = x @ W`` on the CPU (the LLM's unit), with as little per-call work as
    possible: it sits in the decode loop, and its bid must time the kernel, not the op-by-op
    interpreter. ``kernel`` is ``torch.matmul`` with the float weight (what the float path
    computes) or a quantized kernel (:func:`dspark.builtin.torch_quant.apply`)."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self.inputs, self.outputs = [LINEAR_INPUT], [LINEAR_OUTPUT]

    def run_torch(self, inputs: dict[str, Any]) -> dict[str, Any]:
        x = inputs[LINEAR_INPUT]
        if x.device.type != "cpu":
            raise ValueError(f"input on {x.device}: this linear runs on the CPU")
        return {LINEAR_OUTPUT: self._kernel(x)}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        x = torch.from_numpy(np.ascontiguousarray(inputs[LINEAR_INPUT], dtype=np.float32))
        with torch.inference_mode():
            return {LINEAR_OUTPUT: self._kernel(x).numpy()}


def _linear_executable(subgraph: Subgraph) -> LinearExecutable | None:
    """A :class:`LinearExecutable` for the one-op float32 ``x @ W`` of
    :func:`dspark.sdk.quant.linear_subgraph` (W packed or a float initializer); None for anything else."""
    ops = subgraph.ops
    if len(ops) != 1 or ops[0].op_type != "MatMul" or ops[0].inputs[0] != LINEAR_INPUT \
            or subgraph.inputs != [LINEAR_INPUT] or subgraph.outputs != [LINEAR_OUTPUT]:
        return None
    tensors, weight = subgraph.graph.tensors, ops[0].inputs[1]
    if any(t not in tensors or tensors[t].dtype != "float32" for t in (LINEAR_INPUT, LINEAR_OUTPUT)):
        return None
    if subgraph.quantized_by == "torch":
        packed = (subgraph.payload or {}).get(weight)
        if packed is None:
            return None
        from dspark.builtin import torch_quant

        return LinearExecutable(partial(torch_quant.apply, packed))
    w = subgraph.graph.initializers.get(weight)
    if w is None or w.ndim != 2 or w.dtype != np.float32:
        return None
    import torch

    w_t = torch.from_numpy(np.array(w))
    return LinearExecutable(partial(torch.matmul, other=w_t))


def _reference_kernel(subgraph: Subgraph, op: Op) -> Any:
    """An ``onnx.reference`` evaluator for one op that has no torch kernel."""
    from onnx.reference import ReferenceEvaluator

    single = Subgraph(graph=subgraph.graph, op_names=[op.name])
    evaluator = ReferenceEvaluator(single.to_onnx())
    in_names = single.inputs

    def run(attrs: dict[str, Any], args: list[Any]) -> list[Any]:
        import torch

        feeds = {n: a.cpu().numpy() for n, a, t in zip(op.inputs, args, op.inputs, strict=True) if t in in_names}
        outs = evaluator.run(None, feeds)
        return [torch.from_numpy(np.asarray(o)) for o in outs]

    return run


@hookimpl
def dspark_compile(subgraph: Subgraph, device: Device) -> TorchExecutable | LinearExecutable | None:
    if subgraph.quantized_by not in (None, "torch"):
        return None
    if device.kind == "cpu" and (linear := _linear_executable(subgraph)) is not None:
        return linear
    if subgraph.quantized_by and device.kind != "cpu":
        return None
    return TorchExecutable(subgraph, device.id)


@hookimpl
def dspark_quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    from dspark.builtin import torch_quant

    if device.kind != "cpu" or torch_quant.unsupported_reason(spec) is not None:
        return None  # CPU kernels only; no kernel for this spec
    names = quantizable_weights(subgraph)
    if not names:
        return None
    payload = {n: torch_quant.pack(quantize_weight(subgraph.graph.initializers[n], spec), spec) for n in names}
    return subgraph.model_copy(update={"quantized_by": "torch", "quant_spec": spec, "payload": payload})
