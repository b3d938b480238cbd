"""NVML queries: the only module that talks to the NVIDIA driver.

Readings are returned as plain dicts (see :class:`GpuReading`) so that the
mapping to :class:`~dspark.types.Device` records is a pure function that can
be tested with recorded values on machines without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

from dspark.types import HardwareUnavailable


class SystemReading(TypedDict):
    driver_version: str
    cuda_driver_version: str | None  # "12.4"


class GpuReading(TypedDict, total=False):
    index: int  # NVML index (PCI bus order), not necessarily the CUDA ordinal
    name: str
    uuid: str | None  # "GPU-..."
    pci_bus_id: str | None
    compute_capability: tuple[int, int]
    memory_total_bytes: int
    memory_free_bytes: int
    utilization_gpu_percent: int | None  # None where NVML does not support it (e.g. MIG)
    pcie_current_generation: int | None
    pcie_current_width: int | None
    pcie_max_generation: int | None
    pcie_max_width: int | None
    error: str  # set instead of the fields above when the GPU could not be read


class NvmlSnapshot(TypedDict):
    system: SystemReading
    gpus: list[GpuReading]


def init_failure_reason(exc: BaseException) -> str:
    """A user-facing reason for an nvmlInit failure, built from the NVMLError."""
    import pynvml

    value = getattr(exc, "value", None)
    detail = str(exc) or type(exc).__name__
    if value == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND:
        return "no NVIDIA driver: NVML library not found (libnvidia-ml.so.1)"
    if value == pynvml.NVML_ERROR_DRIVER_NOT_LOADED:
        return f"NVIDIA driver not loaded (NVML: {detail}); is the nvidia kernel module loaded?"
    if value == pynvml.NVML_ERROR_NO_PERMISSION:
        return f"no permission to use the NVIDIA driver (NVML: {detail})"
    if value == pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH:
        return f"NVIDIA driver/library version mismatch (NVML: {detail}); reboot or reload the driver"
    return f"NVML failed to initialize: {detail}"


def _text(value: Any) -> str:
    # Older pynvml releases return bytes, newer ones str.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _optional(fn: Callable[[], Any]) -> Any:
    """A reading that some GPUs or configurations lack (MIG, vGPU): None on NVMLError."""
    import pynvml

    try:
        return fn()
    except pynvml.NVMLError:
        return None


def _cuda_version(v: int | None) -> str | None:
    # NVML encodes it as major * 1000 + minor * 10.
    return None if not v else f"{v // 1000}.{(v % 1000) // 10}"


def read_gpu(index: int) -> GpuReading:
    """Read one GPU; NVML must be initialized. Essential queries raise NVMLError."""
    import pynvml as nv

    h = nv.nvmlDeviceGetHandleByIndex(index)
    mem = nv.nvmlDeviceGetMemoryInfo(h)
    major, minor = nv.nvmlDeviceGetCudaComputeCapability(h)
    util = _optional(lambda: nv.nvmlDeviceGetUtilizationRates(h))
    pci = _optional(lambda: nv.nvmlDeviceGetPciInfo(h))
    uuid = _optional(lambda: nv.nvmlDeviceGetUUID(h))
    return GpuReading(
        index=index,
        name=_text(nv.nvmlDeviceGetName(h)),
        uuid=_text(uuid) if uuid is not None else None,
        pci_bus_id=_text(pci.busId) if pci is not None else None,
        compute_capability=(int(major), int(minor)),
        memory_total_bytes=int(mem.total),
        memory_free_bytes=int(mem.free),
        utilization_gpu_percent=int(util.gpu) if util is not None else None,
        pcie_current_generation=_optional(lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
        pcie_current_width=_optional(lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h)),
        pcie_max_generation=_optional(lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h)),
        pcie_max_width=_optional(lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h)),
    )


def snapshot() -> NvmlSnapshot:
    """System and per-GPU readings. Raises HardwareUnavailable when NVML is unusable.

    A GPU whose essential queries fail is returned with ``error`` set, so the
    caller can report it as Unavailable instead of failing the whole probe.
    """
    try:
        import pynvml as nv
    except ImportError as exc:
        raise HardwareUnavailable(f"nvidia-ml-py (module pynvml) is not installed: {exc}") from None
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise HardwareUnavailable(init_failure_reason(exc)) from None
    try:
        count = nv.nvmlDeviceGetCount()
        if count == 0:
            raise HardwareUnavailable("NVML found no NVIDIA GPU")
        system = SystemReading(
            driver_version=_text(nv.nvmlSystemGetDriverVersion()),
            cuda_driver_version=_cuda_version(_optional(nv.nvmlSystemGetCudaDriverVersion)),
        )
        gpus: list[GpuReading] = []
        for i in range(count):
            try:
                gpus.append(read_gpu(i))
            except nv.NVMLError as exc:
                gpus.append(GpuReading(index=i, error=f"NVML query failed: {exc}"))
        return NvmlSnapshot(system=system, gpus=gpus)
    finally:
        _optional(nv.nvmlShutdown)
