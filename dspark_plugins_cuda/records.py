"""Pure mapping from NVML readings, torch facts and measurements to inventory records."""

from __future__ import annotations

from typing import Any

from dspark.types import Device, DType, Unavailable

from dspark_plugins_cuda.bench import Measured
from dspark_plugins_cuda.nvml import GpuReading, SystemReading
from dspark_plugins_cuda.pcie import link_bandwidth_bytes_per_s
from dspark_plugins_cuda.torch_side import TorchGpu

RUNTIME = "torch-cuda"


def dtypes_for(compute_capability: tuple[int, int]) -> list[DType]:
    dtypes: list[DType] = ["float32", "float16", "int64", "int32", "int8", "bool"]
    if compute_capability >= (8, 0):  # native bf16 from Ampere on
        dtypes.insert(2, "bfloat16")
    return dtypes


def device_record(reading: GpuReading, system: SystemReading, gpu: TorchGpu, measured: Measured,
                  triton: str | None, *, from_cache: bool = False) -> Device:
    """The Device for one GPU. Host-link bandwidth uses the *max* PCIe link:
    GPUs drop the link to gen1 when idle and retrain under load, so the
    current link understates what a transfer will see."""
    cc = tuple(reading["compute_capability"])
    cur_gen, cur_width = reading.get("pcie_current_generation"), reading.get("pcie_current_width")
    max_gen, max_width = reading.get("pcie_max_generation"), reading.get("pcie_max_width")
    util = reading.get("utilization_gpu_percent")
    properties: dict[str, Any] = {
        "compute_capability": f"{cc[0]}.{cc[1]}",
        "sm_count": gpu["sm_count"],
        "uuid": reading.get("uuid"),
        "pci_bus_id": reading.get("pci_bus_id"),
        "nvml_index": reading["index"],
        "driver_version": system["driver_version"],
        "cuda_driver_version": system["cuda_driver_version"],
        "torch_version": gpu["torch_version"],
        "torch_cuda_version": gpu["torch_cuda_version"],
        "triton": triton,
        "pcie": {
            "current_generation": cur_gen, "current_width": cur_width,
            "max_generation": max_gen, "max_width": max_width,
            "current_bandwidth_bytes_per_s": link_bandwidth_bytes_per_s(cur_gen, cur_width),
        },
        "benchmarks": "cached" if from_cache else "measured",
    }
    return Device(
        id=f"cuda:{gpu['index']}", kind="cuda", name=reading["name"], runtime=RUNTIME,
        memory_total_bytes=reading["memory_total_bytes"],
        memory_free_bytes=reading["memory_free_bytes"],
        peak_flops=dict(measured["peak_flops"]),
        memory_bandwidth_bytes_per_s=measured["memory_bandwidth_bytes_per_s"],
        host_link_bandwidth_bytes_per_s=(link_bandwidth_bytes_per_s(max_gen, max_width)
                                         or link_bandwidth_bytes_per_s(cur_gen, cur_width)),
        dtypes=dtypes_for(cc),  # type: ignore[arg-type]
        utilization=None if util is None else min(max(util / 100.0, 0.0), 1.0),
        properties=properties,
    )


def unavailable(reading: GpuReading, reason: str, what: str | None = None) -> Unavailable:
    name = reading.get("name")
    return Unavailable(what=what or f"cuda:{reading['index']}",
                       reason=f"{name}: {reason}" if name else reason)
