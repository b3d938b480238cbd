"""``dspark_probe_devices``: every device OpenVINO reports, with measured figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from dspark.sdk import cached_devices, hostinfo, store_devices
from dspark.types import Device, DType, HardwareUnavailable, Unavailable
from dspark_plugins_cpu import bench, runtime
from dspark_plugins_cpu.properties import read_properties

# OPTIMIZATION_CAPABILITIES entry -> dtype the device computes in.
_CAPABILITY_DTYPES: dict[str, DType] = {
    "FP32": "float32", "BF16": "bfloat16", "FP16": "float16", "INT8": "int8",
}
# Integer and boolean tensors every OpenVINO device handles (shape arithmetic, masks).
_ALWAYS: list[DType] = ["int64", "int32", "bool"]


def probe(refresh: bool) -> list[Device | Unavailable]:
    key = _snapshot_key()
    installed = importlib.util.find_spec("openvino") is not None
    if not refresh and installed and (hit := cached_devices(bench.CACHE_NAMESPACE, key)) is not None:
        return hit
    found = _probe(refresh)
    store_devices(bench.CACHE_NAMESPACE, key, found)
    return found


def _snapshot_key() -> dict[str, Any]:
    """What the device list depends on. Importing OpenVINO and enumerating its
    devices costs ~0.25 s of the 1.5 s ``dspark devices`` budget, so a cached
    list is reused while the OpenVINO version, the CPU and the accelerator
    device nodes (Intel GPU render nodes, NPU accel nodes) are unchanged."""
    nodes = sorted(str(p) for pattern in ("/dev/dri/renderD*", "/dev/accel/accel*")
                   for p in Path("/").glob(pattern.lstrip("/")))
    return {"snapshot": "ov-devices-v1", "openvino": runtime.version(), "nodes": nodes, **hostinfo.fingerprint()}


def _probe(refresh: bool) -> list[Device | Unavailable]:
    try:
        core = runtime.core()
        names = list(core.available_devices)
    except Exception as exc:  # a broken install is "no hardware", with the reason
        raise HardwareUnavailable(f"OpenVINO is not usable: {type(exc).__name__}: {exc}") from exc
    if not names:
        raise HardwareUnavailable(f"OpenVINO {runtime.version()} reports no devices")
    found: list[Device | Unavailable] = []
    for name in names:
        try:
            found.append(_device(core, name, refresh))
        except Exception as exc:  # one bad device must not hide the others
            found.append(Unavailable(what=f"openvino/{name}", reason=f"{type(exc).__name__}: {exc}"))
    return found


def _dtypes(capabilities: list[str], ov_name: str) -> list[DType]:
    dtypes: list[DType] = [runtime.precision(ov_name)]
    dtypes += [d for c, d in _CAPABILITY_DTYPES.items() if c in capabilities and d not in dtypes]
    return dtypes + [d for d in _ALWAYS if d not in dtypes]


def _device(core: Any, ov_name: str, refresh: bool) -> Device:
    ov_props = read_properties(core, ov_name)
    full_name = str(ov_props.get("FULL_DEVICE_NAME") or ov_name)
    capabilities = [str(c) for c in ov_props.get("OPTIMIZATION_CAPABILITIES") or []]
    figures = bench.measure(ov_name, full_name, capabilities, refresh)
    dev_id, kind = runtime.dspark_id(ov_name)
    properties: dict[str, Any] = {
        "openvino_version": runtime.version(),
        "openvino_device": ov_name,
        "call_overhead_s": figures["call_overhead_s"],
        "op_overhead_s": figures["op_overhead_s"],
        "benchmark": {"matmul_n": figures["matmul_n"], "measured_in_s": figures.get("measured_in_s")},
        "openvino": ov_props,
    }
    common: dict[str, Any] = dict(
        id=dev_id, kind=kind, name=full_name, runtime=runtime.RUNTIME_PREFIX + ov_name,
        peak_flops=figures["peak_flops"], dtypes=_dtypes(capabilities, ov_name),
    )
    if kind == "cpu":
        cpu = hostinfo.cpu_static()
        total, free = hostinfo.memory()
        properties.update({
            "cpu_model": cpu["model"], "arch": cpu["arch"], "physical_cores": cpu["physical_cores"],
            "logical_cores": cpu["logical_cores"], "usable_cores": cpu["usable_cores"],
            "isa_features": cpu["isa_features"], "numa_nodes": cpu["numa_nodes"],
        })
        return Device(**common, memory_total_bytes=total, memory_free_bytes=free,
                      memory_bandwidth_bytes_per_s=hostinfo.memory_bandwidth(refresh),
                      utilization=hostinfo.cpu_utilization(), properties=properties)
    # Accelerators: only what their properties tell; an integrated GPU shares
    # host memory, so its "total" is the share the driver grants it.
    total_mem = ov_props.get("GPU_DEVICE_TOTAL_MEM_SIZE") or ov_props.get("DEVICE_TOTAL_MEM_SIZE")
    return Device(**common, memory_total_bytes=int(total_mem) if isinstance(total_mem, (int, float)) else None,
                  properties=properties)

