"""Microbenchmarks of one execution provider: MatMul throughput and call/op overheads.

Measured once per (ORT version, provider, device, host) and kept in
:mod:`dspark.host.cache`; ``refresh`` measures again. Takes well under a second on
a laptop CPU.
"""

from __future__ import annotations

import platform
from typing import Any

import numpy as np

from dspark.sdk import cache, hostinfo, time_call
from dspark_plugins_npu import models, providers, session

NAMESPACE = "npu_onnxruntime"
_BENCH_VERSION = "ort-bench-v1"
_CHAIN = 16  # nodes in the op-overhead model


def cache_key(ep: str, index: int) -> dict[str, Any]:
    host = hostinfo.fingerprint() if providers.info(ep).kind == "cpu" else {"host": platform.node()}
    return {"bench": _BENCH_VERSION, "ort": session.ort().__version__, "ep": ep, "index": index, **host}


def measure(ep: str, index: int, refresh: bool) -> dict[str, float]:
    """{"float32_flops", "call_overhead_s", "op_overhead_s"} for ``ep`` on device ``index``."""
    key = cache_key(ep, index)
    if not refresh and (hit := cache.load(NAMESPACE, key)) is not None:
        return {k: float(v) for k, v in hit.items()}
    from dspark.sdk import cpu_benchmark_lock

    with cpu_benchmark_lock:  # also for GPU EPs: the host thread's timing must not be contended
        result = {
            "float32_flops": _matmul_flops(ep, index),
            **_overheads(ep, index),
        }
    cache.store(NAMESPACE, key, result)
    return result


def _matmul_flops(ep: str, index: int) -> float:
    # Big enough to reach the kernels' steady state, small enough to keep the probe short.
    cores = int(hostinfo.cpu_static()["usable_cores"] or 1)
    n = 2048 if providers.info(ep).io_device == "cuda" else (512 if cores <= 8 else 1024)
    sess = session.create(models.build_matmul_model(n), ep, index)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    if providers.info(ep).io_device == "cuda":
        # Keep operands on the device: plain run() would time PCIe copies, not the GPU.
        rt = session.ort()
        binding = sess.io_binding()
        binding.bind_ortvalue_input("A", rt.OrtValue.ortvalue_from_numpy(a, "cuda", index))
        binding.bind_ortvalue_input("B", rt.OrtValue.ortvalue_from_numpy(b, "cuda", index))
        binding.bind_output("Y", "cuda", index)

        def run() -> None:
            sess.run_with_iobinding(binding)
            binding.synchronize_outputs()
    else:
        feeds = {"A": a, "B": b}

        def run() -> None:
            sess.run(None, feeds)

    seconds = time_call(run, warmup=2, repeat=10, budget_s=0.3)
    return 2.0 * n**3 / seconds


def _overheads(ep: str, index: int) -> dict[str, float]:
    x = {"x": np.ones(1, dtype=np.float32)}
    one = session.create(models.PROBE_MODEL, ep, index)
    chain = session.create(models.build_chain_model(_CHAIN), ep, index)
    t_one = time_call(lambda: one.run(None, x), warmup=20, repeat=300, budget_s=0.1)
    t_chain = time_call(lambda: chain.run(None, x), warmup=20, repeat=300, budget_s=0.1)
    # Floor: a fused chain can make the difference vanish or go negative in noise.
    per_op = max((t_chain - t_one) / (_CHAIN - 1), 1e-7)
    return {"call_overhead_s": max(t_one - per_op, 1e-7), "op_overhead_s": per_op}
