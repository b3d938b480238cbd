"""Probing: every execution provider of the installed ONNX Runtime build, tried for real.

An EP that ``get_available_providers()`` lists is only compiled in; it is
usable when a session on a one-node model really runs on it. Usable EPs
become :class:`~dspark.types.Device` records, the others
:class:`~dspark.types.Unavailable` with the reason.

The list is kept in the disk cache (:mod:`dspark.sdk.devices`) under a snapshot of what it depends on,
read without importing ONNX Runtime (:func:`snapshot_key`), and reused while that is unchanged: importing
ONNX Runtime and trying its providers would add tens of MB to a process that then runs its model elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

from dspark.sdk import cached_devices, hostinfo, store_devices
from dspark.types import Device, DType, HardwareUnavailable, Unavailable
from dspark_plugins_npu import bench, models, providers, session

_CPU_DTYPES: list[DType] = ["float32", "float64", "float16", "int64", "int32", "int8", "uint8", "bool"]
_ACCEL_DTYPES: list[DType] = ["float32", "float16", "int64", "int32", "int8", "uint8", "bool"]


# Device nodes of the accelerators an execution provider may drive; a driver's version where it says one.
_NODES = ("/dev/nvidia*", "/dev/dri/renderD*", "/dev/accel/accel*", "/dev/kfd", "/dev/dxg")
_DRIVER_FILES = ("/proc/driver/nvidia/version",)
# What decides which GPU a provider sees, or whether its libraries load.
_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "LD_LIBRARY_PATH")


def probe(refresh: bool) -> list[Device | Unavailable]:
    key = snapshot_key()
    if key is None:  # ONNX Runtime is not installed: what session.ort() raises says so
        return _probe(refresh)
    if not refresh and (hit := cached_devices(bench.NAMESPACE, key, _relive)) is not None:
        return hit
    found = _probe(refresh)
    store_devices(bench.NAMESPACE, key, found)
    return found


def snapshot_key() -> dict[str, Any] | None:
    """What the list of devices depends on, read without importing ONNX Runtime: the installed build (its
    distributions' names and versions, the libraries in ``onnxruntime/capi`` with their sizes and times), the
    accelerators' device nodes and driver version, the environment that picks a GPU or finds a provider's
    libraries, and the host's CPU. None when ONNX Runtime is not installed."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    capi = Path(next(iter(spec.submodule_search_locations))) / "capi"
    libs = sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in capi.glob("*.so*")) \
        if capi.is_dir() else []
    # Every distribution that installs the package (vendor builds replace the default wheel): name and version
    dists = sorted(p.name for p in capi.parent.parent.glob("onnxruntime*.dist-info"))
    nodes = sorted(str(p) for pattern in _NODES for p in Path("/").glob(pattern.lstrip("/")))
    drivers = {}
    for f in _DRIVER_FILES:
        try:
            drivers[f] = Path(f).read_text(errors="replace").strip()
        except OSError:
            pass
    return {"snapshot": "ort-devices-v1", "package": str(capi.parent), "distributions": dists, "libs": libs,
            "nodes": nodes, "drivers": drivers, "env": {k: os.environ.get(k) for k in _ENV},
            **hostinfo.fingerprint()}


def _relive(device: Device) -> None:
    """An accelerator's live figures (NVML's free memory and load), read now."""
    info = providers.info(device.properties["execution_provider"])
    _, total, free, util = _accelerator_facts(info.id_prefix, int(device.properties["device_index"]))
    if total is not None:
        device.memory_total_bytes, device.memory_free_bytes, device.utilization = total, free, util


def _probe(refresh: bool) -> list[Device | Unavailable]:
    rt = session.ort()
    available = list(rt.get_available_providers())
    common = {"ort_version": rt.__version__, "ort_device": rt.get_device(), "available_providers": available}
    found: list[Device | Unavailable] = []
    start = time.perf_counter()
    with session.quiet_ort():
        for ep in available:
            found.extend(_probe_ep(ep, refresh, common))
    if not any(isinstance(d, Device) for d in found):
        reasons = "; ".join(u.reason for u in found if isinstance(u, Unavailable))
        raise HardwareUnavailable(f"no usable ONNX Runtime execution provider ({reasons or 'none listed'})")
    elapsed = time.perf_counter() - start
    for d in found:
        if isinstance(d, Device):
            d.properties["probe_s"] = round(elapsed, 4)
    return found


def _probe_ep(ep: str, refresh: bool, common: dict[str, Any]) -> list[Device | Unavailable]:
    info = providers.info(ep)
    if info.remote:
        return [Unavailable(what=ep, reason=f"{ep} runs models on a remote endpoint, not on a local device")]
    out: list[Device | Unavailable] = []
    for index in providers.device_indices(ep):
        what = ep if len(providers.device_indices(ep)) == 1 else f"{ep} on {providers.device_id(ep, index)}"
        try:
            # Not strict: a fallback shows in get_providers(), and that is the reason we report.
            session.create(models.PROBE_MODEL, ep, index, strict=False)
            figures = bench.measure(ep, index, refresh)
        except session.EpUnusable as exc:
            out.append(Unavailable(what=what, reason=str(exc)))
            continue
        except Exception as exc:  # a provider that loads but cannot run a MatMul is no use either
            out.append(Unavailable(what=what, reason=f"{ep}: {session.clean_error(exc)}"))
            continue
        out.append(_device(ep, index, figures, refresh, common))
    return out


def _device(ep: str, index: int, figures: dict[str, float], refresh: bool, common: dict[str, Any]) -> Device:
    info = providers.info(ep)
    props: dict[str, Any] = {
        **common,
        "execution_provider": ep,
        "provider_options": providers.provider_options(ep, index),
        "device_index": index,
        "call_overhead_s": figures["call_overhead_s"],
        "op_overhead_s": figures["op_overhead_s"],
    }
    base: dict[str, Any] = {
        "id": providers.device_id(ep, index), "kind": info.kind, "runtime": providers.runtime_name(ep),
        "peak_flops": {"float32": figures["float32_flops"]},
    }
    if info.kind == "cpu":
        # The same silicon as the other CPU plugins report, from the shared host facts.
        static = hostinfo.cpu_static()
        total, free = hostinfo.memory()
        props.update(threads=static["usable_cores"], isa_features=static["isa_features"])
        return Device(**base, name=static["model"], memory_total_bytes=total, memory_free_bytes=free,
                      memory_bandwidth_bytes_per_s=hostinfo.memory_bandwidth(refresh),
                      utilization=hostinfo.cpu_utilization(), dtypes=list(_CPU_DTYPES), properties=props)
    name, total_b, free_b, util = _accelerator_facts(info.id_prefix, index)
    return Device(**base, name=name or f"{ep.removesuffix('ExecutionProvider')} device {index}",
                  memory_total_bytes=total_b, memory_free_bytes=free_b, utilization=util,
                  dtypes=list(_ACCEL_DTYPES), properties=props)


def _accelerator_facts(prefix: str, index: int) -> tuple[str | None, int | None, int | None, float | None]:
    """Name, total/free memory and load of an NVIDIA GPU through NVML; unknowns for anything else."""
    if prefix != "cuda":
        return None, None, None, None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            return (name.decode() if isinstance(name, bytes) else str(name)), int(mem.total), int(mem.free), util
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or the device busy: the EP still works
        return None, None, None, None
