"""Microbenchmarks of one OpenVINO device: peak MatMul throughput per dtype and call overheads.

Run once per (OpenVINO version, host, device) and cached on disk; the whole
measurement takes about a second on a laptop-class CPU.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from dspark.sdk import cache, hostinfo
from dspark_plugins_cpu import runtime

CACHE_NAMESPACE = "openvino"
_BENCH_VERSION = "ov-bench-v2"
_MATMUL_BUDGET_S = 0.15
_OVERHEAD_BUDGET_S = 0.08
_MIN_CALL_S = 2e-3  # a MatMul faster than this measures dispatch, not compute: grow it
_MAX_N = 4096
_CHAIN = 16
_BATCHES = 5  # overhead timings: the lowest of this many batch medians


def cache_key(ov_name: str, full_name: str) -> dict[str, Any]:
    return {"bench": _BENCH_VERSION, "openvino": runtime.version(), "device": ov_name,
            "device_name": full_name, **hostinfo.fingerprint()}


def measure(ov_name: str, full_name: str, capabilities: list[str], refresh: bool) -> dict[str, Any]:
    """{'peak_flops': {dtype: ops/s}, 'call_overhead_s', 'op_overhead_s', 'matmul_n'}, cached."""
    key = cache_key(ov_name, full_name)
    if not refresh and (hit := cache.load(CACHE_NAMESPACE, key)) is not None:
        return dict(hit)
    from dspark.sdk import cpu_benchmark_lock

    with cpu_benchmark_lock:  # not while another plugin benchmarks the same cores
        t0 = time.perf_counter()
        result = _measure(ov_name, capabilities)
    result["measured_in_s"] = round(time.perf_counter() - t0, 3)
    cache.store(CACHE_NAMESPACE, key, result)
    return result


def _best_time(request: Any, feed: dict[int, np.ndarray], budget_s: float, stat: str = "min") -> float:
    """Min (peak figures) or lowest batch median (overheads) of repeated ``infer`` calls within
    ``budget_s``: one median over the whole budget is raised for good by a burst of load or by
    worker threads still spinning from the previous benchmark."""
    request.infer(feed)  # the first call allocates and primes caches
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(samples) < 3 or (time.perf_counter() < deadline and len(samples) < 2000):
        t = time.perf_counter()
        request.infer(feed)
        samples.append(time.perf_counter() - t)
    if stat == "min":
        return float(np.min(samples))
    batches = np.array_split(np.array(samples), _BATCHES) if len(samples) >= 5 * _BATCHES else [samples]
    return float(min(np.median(b) for b in batches))


def _compile(model: Any, ov_name: str, config: dict[str, Any]) -> Any:
    return runtime.core().compile_model(model, ov_name, config).create_infer_request()


def _matmul_model(n: int, int8: bool = False) -> Any:
    import openvino as ov
    import openvino.opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([n, n], ov.Type.f32, name="x")
    if int8:
        # The pattern OpenVINO's low-precision transformations turn into an
        # integer GEMM: u8 activations by FakeQuantize, i8 weights with scales.
        lo, hi = ops.constant(np.float32(0.0)), ops.constant(np.float32(2.55))
        lhs = ops.fake_quantize(x, lo, hi, lo, hi, 256)
        w8 = ops.constant(rng.integers(-127, 127, (n, n), dtype=np.int8))
        rhs = ops.multiply(ops.convert(w8, ov.Type.f32), ops.constant(np.full((1, n), 0.01, np.float32)))
    else:
        lhs, rhs = x, ops.constant(rng.standard_normal((n, n), dtype=np.float32))
    return ov.Model([ops.matmul(lhs, rhs, False, False)], [x], f"matmul{n}")


def _matmul_flops(ov_name: str, config: dict[str, Any], n: int, int8: bool = False) -> tuple[float, int, Any]:
    """Peak ops/s of an n x n MatMul, growing n until one call is long enough to time."""
    while True:
        request = _compile(_matmul_model(n, int8), ov_name, config)
        feed = {0: np.random.default_rng(1).random((n, n), dtype=np.float32)}
        t = _best_time(request, feed, _MATMUL_BUDGET_S)
        if t >= _MIN_CALL_S or n >= _MAX_N:
            return 2.0 * n**3 / t, n, request
        n *= 2


def _runs_int8(request: Any) -> bool:
    """Whether the compiled MatMul really executes in an integer precision."""
    try:
        ops = request.get_compiled_model().get_runtime_model().get_ordered_ops()
        for op in ops:
            info = op.get_rt_info()
            if info["layerType"].astype(str) in ("FullyConnected", "MatMul", "Gemm") and \
                    info["runtimePrecision"].astype(str) in ("u8", "i8"):
                return True
    except Exception:  # no runtime graph on this device: cannot tell, so do not claim it
        return False
    return False


def _overheads(ov_name: str, config: dict[str, Any]) -> tuple[float, float]:
    """(per-call, per-op) overhead: a 1-op model, and a chain of small MatMuls that
    OpenVINO cannot fuse, timed on a persistent request as the executable uses it."""
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([1, 16], ov.Type.f32, name="x")
    trivial = _compile(ov.Model([ops.relu(x)], [x], "trivial"), ov_name, config)
    feed = {0: np.zeros((1, 16), np.float32)}
    call = _best_time(trivial, feed, _OVERHEAD_BUDGET_S, stat="median")
    y = ops.parameter([1, 16], ov.Type.f32, name="y")
    node: Any = y
    w = np.eye(16, dtype=np.float32)
    for _ in range(_CHAIN):
        node = ops.matmul(node, ops.constant(w), False, False)
    chain = _compile(ov.Model([node], [y], "chain"), ov_name, config)
    per_op = (_best_time(chain, feed, _OVERHEAD_BUDGET_S, stat="median") - call) / (_CHAIN - 1)
    return call, max(per_op, 1e-7)


def _measure(ov_name: str, capabilities: list[str]) -> dict[str, Any]:
    base = runtime.compile_config(ov_name)
    peak: dict[str, float] = {}
    first = runtime.precision(ov_name)
    peak[first], n, _ = _matmul_flops(ov_name, base, 512)
    # Lower float precisions only where the device says it computes in them.
    for cap, dtype, hint in (("BF16", "bfloat16", "bf16"), ("FP16", "float16", "f16")):
        if cap in capabilities and dtype not in peak:
            peak[dtype], _, _ = _matmul_flops(ov_name, {**base, "INFERENCE_PRECISION_HINT": hint}, n)
    if "INT8" in capabilities:
        try:
            flops, _, request = _matmul_flops(ov_name, {"PERFORMANCE_HINT": "LATENCY"}, n, int8=True)
            if _runs_int8(request):
                peak["int8"] = flops
        except RuntimeError:
            pass  # the device lists INT8 but rejects this pattern: report no int8 figure
    call, per_op = _overheads(ov_name, base)
    return {"peak_flops": peak, "call_overhead_s": call, "op_overhead_s": per_op, "matmul_n": n}
