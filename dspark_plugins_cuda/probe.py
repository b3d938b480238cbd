"""dspark_probe_devices: NVML first (cheap, no torch), then torch and microbenchmarks."""

from __future__ import annotations

import os

from dspark.types import Device, Unavailable

from dspark_plugins_cuda import bench, nvml, records, torch_side


def probe(refresh: bool) -> list[Device | Unavailable]:
    snap = nvml.snapshot()  # raises HardwareUnavailable before torch is ever imported
    readable = [g for g in snap["gpus"] if "error" not in g]
    out: list[Device | Unavailable] = [records.unavailable(g, g["error"]) for g in snap["gpus"] if "error" in g]
    if not readable:
        return out
    tc = torch_side.torch_cuda()
    if tc.reason:
        return out + [records.unavailable(g, tc.reason) for g in readable]
    triton = torch_side.triton_version()
    for g in readable:
        gpu = tc.match(g.get("uuid"), len(snap["gpus"]), g["index"])
        if gpu is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = ("not visible to CUDA in this process"
                   + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                   + "; MIG instances are not driven yet")
            out.append(records.unavailable(g, why, what=f"nvml:{g['index']}"))
            continue
        key = bench.cache_key(g["name"], snap["system"]["driver_version"], gpu["torch_version"])
        try:
            measured, cached = bench.measured(gpu["index"], key, g["compute_capability"],
                                              g["memory_free_bytes"], refresh)
        except Exception as exc:  # e.g. out of memory: this GPU cannot take work now
            out.append(records.unavailable(g, f"microbenchmark failed: {type(exc).__name__}: {exc}",
                                           what=f"cuda:{gpu['index']}"))
            continue
        out.append(records.device_record(g, snap["system"], gpu, measured, triton, from_cache=cached))
    return out
