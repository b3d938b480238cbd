"""The hardware-neutral torch reference backend (plugin name ``torch``).

It can run any op on any torch device, so every op always has a bidder:
ONNX ops are executed with torch kernels (:mod:`dspark.builtin.torch_ops`);
the few that have none run through ``onnx.reference`` on the host. Its
numbers are the reference every other plugin is checked against.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

import numpy as np

from dspark import cache, calibration, hostinfo
from dspark.builtin.op_names import TORCH_KERNEL_OPS
from dspark.graph import Op, Subgraph
from dspark.hookspecs import hookimpl
from dspark.quant import dequantize, quantize_weight, quantizable_weights
from dspark.types import Bid, Device, QuantSpec

DSPARK_API_VERSION = "1.0"
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
    from dspark.cost import time_call

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
    precision = subgraph.quant_spec.precision if subgraph.quantized_by else "float32"
    # Timed through dspark_compile (cached); the roofline when it cannot be.
    est = calibration.estimate(subgraph, device, runtime_key=f"{RUNTIME} {_torch_version()}",
                               compile=lambda sg: dspark_compile(sg, device), op_overhead_s=_OP_OVERHEAD_S)
    latency = est.latency_s + 2e-4 * len(host_only)  # the numpy reference is slow; never prefer it
    notes = [est.note] + ([f"{len(host_only)} op(s) via onnx.reference"] if host_only else [])
    return Bid(device_id=device.id, runtime=RUNTIME, latency_s=latency, precision=precision,
               peak_memory_bytes=subgraph.param_bytes + subgraph.io_bytes(),
               fixed_overhead_s=est.fixed_overhead_s, source=est.source, note="; ".join(n for n in notes if n))


class TorchExecutable:
    """Runs a subgraph op by op with torch kernels on one torch device."""

    def __init__(self, subgraph: Subgraph, device: str) -> None:
        import torch

        from dspark.builtin.torch_ops import KERNELS

        self._torch = torch
        self.device = torch.device(device)
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        weights = dict(subgraph.graph.initializers)
        if subgraph.quantized_by == "torch":
            for name, q in subgraph.payload.items():
                weights[name] = dequantize(q)
        self.weights = {k: torch.from_numpy(np.array(weights[k])).to(self.device) for k in subgraph.params}
        self.steps: list[tuple[Op, Any]] = []
        for op in subgraph.ops:
            if _supported(op):
                self.steps.append((op, KERNELS[op.op_type]))
            else:
                self.steps.append((op, _reference_kernel(subgraph, op)))

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
def dspark_compile(subgraph: Subgraph, device: Device) -> TorchExecutable | None:
    if subgraph.quantized_by not in (None, "torch"):
        return None
    return TorchExecutable(subgraph, device.id)


@hookimpl
def dspark_quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    names = quantizable_weights(subgraph)
    if not names or spec.activations != "float":  # weight-only kernels here
        return None
    payload = {n: quantize_weight(subgraph.graph.initializers[n], spec) for n in names}
    return subgraph.model_copy(update={"quantized_by": "torch", "quant_spec": spec, "payload": payload})
