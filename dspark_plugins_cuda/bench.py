"""Microbenchmarks for a GPU's peak compute and memory bandwidth, cached on disk.

Measured, not taken from spec sheets: clocks, power caps and MIG slices make
real figures differ from datasheet numbers, and the cost model needs the real ones.
"""

from __future__ import annotations

from typing import Any, TypedDict

from dspark.sdk import cache

NAMESPACE = "cuda_bench"
BENCH_VERSION = "cuda-bench-v1"


class Measured(TypedDict):
    peak_flops: dict[str, float]
    memory_bandwidth_bytes_per_s: float


def cache_key(gpu_name: str, driver_version: str, torch_version: str) -> dict[str, str]:
    return {"bench": BENCH_VERSION, "gpu": gpu_name, "driver": driver_version, "torch": torch_version}


def _time_cuda(torch: Any, fn: Any, iters: int) -> float:
    """Seconds per call of ``fn``, timed with CUDA events after a warm-up."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / iters


def run(index: int, compute_capability: tuple[int, int], free_bytes: int) -> Measured:
    import torch

    from dspark_plugins_cuda.precision import fp32_mode

    device = torch.device("cuda", index)
    # 3 square fp32 matrices must fit comfortably in what is free now.
    n = 8192 if free_bytes > 3 * 8192 * 8192 * 4 * 4 else 4096 if free_bytes > 3 * 4096 * 4096 * 4 * 4 else 2048
    cases: list[tuple[str, Any, bool]] = [("float32", torch.float32, False), ("float16", torch.float16, False)]
    if compute_capability >= (8, 0):  # bf16 and TF32 tensor cores start with Ampere
        cases += [("bfloat16", torch.bfloat16, False), ("tf32", torch.float32, True)]
    flops: dict[str, float] = {}
    with torch.cuda.device(device), torch.inference_mode():
        for name, dtype, tf32 in cases:
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            c = torch.empty(n, n, device=device, dtype=dtype)
            with fp32_mode(torch, tf32=tf32):
                seconds = _time_cuda(torch, lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), iters=10)
            flops[name] = 2.0 * n**3 / seconds
            del a, b, c
        # Device-to-device copy: every byte is read once and written once.
        numel = min(256 << 20, free_bytes // 8) // 4
        src = torch.empty(numel, device=device, dtype=torch.float32)
        dst = torch.empty_like(src)
        seconds = _time_cuda(torch, lambda src=src, dst=dst: dst.copy_(src), iters=20)
        bandwidth = 2.0 * numel * 4 / seconds
        del src, dst
        torch.cuda.empty_cache()
    return Measured(peak_flops=flops, memory_bandwidth_bytes_per_s=bandwidth)


def measured(index: int, key: dict[str, str], compute_capability: tuple[int, int], free_bytes: int,
             refresh: bool) -> tuple[Measured, bool]:
    """(figures, came_from_cache). ``refresh`` re-measures and overwrites the cache."""
    if not refresh and (hit := cache.load(NAMESPACE, key)) is not None:
        return Measured(peak_flops=dict(hit["peak_flops"]),
                        memory_bandwidth_bytes_per_s=float(hit["memory_bandwidth_bytes_per_s"])), True
    result = run(index, compute_capability, free_bytes)
    cache.store(NAMESPACE, key, dict(result))
    return result, False
