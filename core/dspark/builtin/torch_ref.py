"""The hardware-neutral torch reference backend (plugin name ``torch``).

It can run any op on any torch device, so every op always has a bidder:
ONNX ops are executed with torch kernels (:mod:`dspark.sdk.reference.ops`);
the few that have none run through ``onnx.reference`` on the host. Its
numbers are the reference every other plugin is checked against.

Quantized variants (CPU only) run real int8/int4 kernels
(:mod:`dspark.sdk.reference.quant_kernels`). On the CPU, the LLM's unit, a one-op
linear ``x @ W`` (:func:`dspark.sdk.quant.linear_subgraph`), float or
quantized, compiles to a lean :class:`LinearExecutable` with ``run_torch``:
it sits in the decode loop, and its bid then times the kernel as the engine
calls it rather than the op-by-op interpreter's overhead. Weight-bound
linears, float or quantized, are bid with cold caches
(:func:`dspark.sdk.calibration.streams_weights`), so the two compare as in a
real decode step.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
from typing import Any

from dspark.graph.model import Subgraph
from dspark.hookspecs import hookimpl
from dspark.host import cache, hostinfo
from dspark.sdk import calibration
from dspark.sdk.quant import (
    quantizable_weights,
    quantize_weight,
)
from dspark.sdk.reference.executable import (
    LinearExecutable,
    TorchExecutable,
    linear_executable,
)
from dspark.sdk.reference.support import host_only_ops, subgraph_problem
from dspark.types import Bid, Device, QuantSpec

DSPARK_API_VERSION = "1.2"  # run_torch on LinearExecutable
RUNTIME = "torch"
_OP_OVERHEAD_S = 8e-6  # eager dispatch per op, before calibration


@functools.cache  # metadata parsing costs more than a cached bid: once per process
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


@hookimpl
def dspark_bid(subgraph: Subgraph, device: Device) -> Bid | None:
    if subgraph_problem(subgraph) is not None:
        return None  # a dtype torch does not hold, or an op neither a kernel nor onnx.reference runs
    host_only = host_only_ops(subgraph)
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


@hookimpl
def dspark_compile(subgraph: Subgraph, device: Device) -> TorchExecutable | LinearExecutable | None:
    if subgraph.quantized_by not in (None, "torch"):
        return None
    if device.kind == "cpu" and (linear := linear_executable(subgraph)) is not None:
        return linear
    if subgraph.quantized_by and device.kind != "cpu":
        return None
    return TorchExecutable(subgraph, device.id)


@hookimpl
def dspark_quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    from dspark.sdk.reference import quant_kernels as torch_quant

    if device.kind != "cpu" or torch_quant.unsupported_reason(spec) is not None:
        return None  # CPU kernels only; no kernel for this spec
    names = quantizable_weights(subgraph)
    if not names:
        return None
    payload = {n: torch_quant.pack(quantize_weight(subgraph.graph.initializers[n], spec), spec) for n in names}
    return subgraph.model_copy(update={"quantized_by": "torch", "quant_spec": spec, "payload": payload})
