"""Facts about the host CPU and memory, read from the OS without heavy imports.

Shared by every plugin that drives the CPU, so they report the same device.
"""

from __future__ import annotations

import functools
import os
import platform
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

# ISA features that change which kernels are fast; /proc/cpuinfo flag names.
_X86_FEATURES = {
    "avx2": "avx2", "fma": "fma", "avx512f": "avx512f", "avx512_vnni": "avx512_vnni",
    "avx_vnni": "avx_vnni", "avx512_bf16": "avx512_bf16", "avx512_fp16": "avx512_fp16",
    "amx_tile": "amx_tile", "amx_bf16": "amx_bf16", "amx_int8": "amx_int8", "f16c": "f16c",
}
_ARM_FEATURES = {"asimd": "neon", "asimddp": "dotprod", "bf16": "bf16", "i8mm": "i8mm",
                 "sve": "sve", "sve2": "sve2", "fphp": "fp16"}


@functools.lru_cache(maxsize=1)
def cpu_static() -> dict[str, Any]:
    """CPU model, core counts, ISA features, NUMA nodes (cached: these never change)."""
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    table = _ARM_FEATURES if platform.machine().lower() in ("aarch64", "arm64") else _X86_FEATURES
    features = sorted(name for flag, name in table.items() if flag in flags)
    nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    return {
        "model": model,
        "arch": platform.machine(),
        "physical_cores": psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        "logical_cores": psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "isa_features": features,
        "numa_nodes": max(1, len(nodes)),
    }


def memory() -> tuple[int, int]:
    """(total, available) host memory in bytes, honouring a cgroup limit when set."""
    vm = psutil.virtual_memory()
    total, available = int(vm.total), int(vm.available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max" and int(limit) < total:
            total = int(limit)
            available = max(0, min(available, total - used))
    except (OSError, ValueError):
        pass
    return total, available


def return_freed_memory() -> None:
    """Give the memory freed on the C heap back to the OS (glibc's ``malloc_trim``; elsewhere nothing).
    glibc keeps freed blocks below its mmap threshold (which grows to 32 MiB) for reuse, so a dropped copy
    of a model's weights would otherwise stay in the process's RSS."""
    if platform.system() != "Linux":
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # musl or another libc: no malloc_trim
        pass


def cpu_utilization() -> float:
    """System-wide CPU load over the last minute, 0..1 (load average / cores)."""
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        return 0.0
    return max(0.0, min(1.0, load1 / (cpu_static()["logical_cores"] or 1)))


@dataclass(frozen=True)
class CpuSample:
    """CPU seconds spent so far on this process's usable cores: by every process (the hypervisor's steal
    included) and by this one (every thread), at ``wall`` (``time.monotonic``)."""

    wall: float
    busy: float
    own: float
    cores: int


def cpu_sample() -> CpuSample:
    """Now's :class:`CpuSample` (psutil: /proc/stat per core on Linux)."""
    per = psutil.cpu_times(percpu=True)
    ids = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(len(per))
    use = [per[i] for i in ids if i < len(per)] or per
    busy = sum(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
               + getattr(t, "steal", 0.0) for t in use)
    own = psutil.Process().cpu_times()
    return CpuSample(time.monotonic(), busy, own.user + own.system, len(use))


def others_share(a: CpuSample, b: CpuSample) -> float:
    """The share of the usable cores' time from ``a`` to ``b`` that went to other processes (and to steal):
    0 on a machine doing nothing else, 1 when they held every core throughout."""
    span = (b.wall - a.wall) * b.cores
    if span <= 0:
        return 0.0
    return max(0.0, min(1.0, ((b.busy - a.busy) - (b.own - a.own)) / span))


def fingerprint() -> dict[str, Any]:
    """What a cached CPU microbenchmark depends on."""
    s = cpu_static()
    return {"host": platform.node(), "model": s["model"], "cores": s["usable_cores"], "isa": s["isa_features"]}


class BenchmarkLock:
    """A lock that knows who waits on it and for how long: a plugin call's deadline
    (:mod:`dspark.host.hook_threads`) does not count the time its thread queued here behind another
    plugin's benchmark, as the queueing is no fault of the waiting plugin. Used as ``threading.Lock``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._books = threading.Lock()
        self._waited: dict[int, float] = {}  # thread ident -> seconds of finished waits
        self._since: dict[int, float] = {}  # thread ident -> when its current wait began
        self.holder: int | None = None  # ident of the thread holding the lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            self.holder = threading.get_ident()
            return True
        if not blocking:
            return False
        me = threading.get_ident()
        with self._books:
            self._since[me] = time.perf_counter()
        try:
            got = self._lock.acquire(True, timeout)
        finally:
            with self._books:
                began = self._since.pop(me)
                self._waited[me] = self._waited.get(me, 0.0) + time.perf_counter() - began
        if got:
            self.holder = me
        return got

    def release(self) -> None:
        self.holder = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def waited(self, ident: int | None) -> tuple[float, float | None]:
        """Thread ``ident``'s finished waits in seconds, and when its current wait began (None: not waiting)."""
        with self._books:
            return self._waited.get(ident or 0, 0.0), self._since.get(ident or 0)


# Plugins probe concurrently; CPU microbenchmarks running at the same time
# would share the cores and cache figures that are too low. Every CPU
# microbenchmark runs under this lock.
cpu_benchmark_lock = BenchmarkLock()


def memory_bandwidth(refresh: bool = False) -> float:
    """Host memory bandwidth in bytes/s, by a short copy microbenchmark (cached on disk)."""
    from dspark.host import cache

    key = {"bench": "memcpy-v1", **fingerprint()}
    if not refresh and (hit := cache.load("hostinfo", key)) is not None:
        return float(hit)
    import time

    import numpy as np

    src = np.ones(32 * 1024 * 1024 // 8, dtype=np.float64)  # 32 MiB: past the caches
    dst = np.empty_like(src)
    best = float("inf")
    with cpu_benchmark_lock:
        for _ in range(7):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            best = min(best, time.perf_counter() - t0)
    value = 2 * src.nbytes / best  # read + write
    cache.store("hostinfo", key, value)
    return value
