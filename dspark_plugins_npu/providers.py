"""Which physical device each ONNX Runtime execution provider runs on.

Vendor builds of ONNX Runtime (onnxruntime-qnn, -openvino, -directml, ...)
replace the default wheel and list their own providers; this table maps every
provider we know of to a device id, device kind and the precision it
computes a float model in. Nothing here imports onnxruntime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from dspark.types import DeviceKind, DType

CPU_EP = "CPUExecutionProvider"


@dataclass(frozen=True)
class EpInfo:
    """How one execution provider maps onto hardware."""

    kind: DeviceKind
    # "cpu" is the host; "cuda" numbers devices (cuda:0, cuda:1); others get <prefix>:0.
    id_prefix: str
    precision: DType = "float32"
    # Name of the provider's shared library in onnxruntime/capi, to explain a failed load.
    library: str | None = None
    # Provider options that pin the EP to the device we report.
    options: dict[str, str] = field(default_factory=dict)
    # EPs that run on a remote service or only through another EP: not a local device.
    remote: bool = False
    multi_device: bool = False
    io_device: Literal["cpu", "cuda"] = "cpu"  # OrtValue device for benchmark inputs


PROVIDERS: dict[str, EpInfo] = {
    CPU_EP: EpInfo("cpu", "cpu"),
    "DnnlExecutionProvider": EpInfo("cpu", "cpu", library="dnnl"),
    "XnnpackExecutionProvider": EpInfo("cpu", "cpu"),
    "ACLExecutionProvider": EpInfo("cpu", "cpu"),
    "ArmNNExecutionProvider": EpInfo("cpu", "cpu"),
    # OpenVINO EP defaults to its CPU device; pin it so the id stays true.
    "OpenVINOExecutionProvider": EpInfo("cpu", "cpu", library="openvino", options={"device_type": "CPU"}),
    "CUDAExecutionProvider": EpInfo("cuda", "cuda", library="cuda", multi_device=True, io_device="cuda"),
    "TensorrtExecutionProvider": EpInfo("cuda", "cuda", library="tensorrt", multi_device=True, io_device="cuda"),
    "NvTensorRTRTXExecutionProvider": EpInfo("cuda", "cuda", library="nv_tensorrt_rtx", multi_device=True,
                                             io_device="cuda"),
    "ROCMExecutionProvider": EpInfo("gpu", "gpu", library="rocm"),
    "MIGraphXExecutionProvider": EpInfo("gpu", "gpu", library="migraphx"),
    "DmlExecutionProvider": EpInfo("gpu", "gpu"),
    "WebGpuExecutionProvider": EpInfo("gpu", "gpu"),
    # NPUs: the HTP and ANE run a float model in fp16, so that is what we promise.
    "QNNExecutionProvider": EpInfo("npu", "npu", precision="float16", library="qnn"),
    "CANNExecutionProvider": EpInfo("npu", "npu", library="cann"),
    "VitisAIExecutionProvider": EpInfo("npu", "npu", library="vitisai"),
    "CoreMLExecutionProvider": EpInfo("npu", "npu", precision="float16"),
    "NnapiExecutionProvider": EpInfo("npu", "npu", precision="float16"),
    "RknpuExecutionProvider": EpInfo("npu", "npu"),
    "SNPEExecutionProvider": EpInfo("npu", "npu", precision="float16"),
    "VSINPUExecutionProvider": EpInfo("npu", "npu"),
    "AzureExecutionProvider": EpInfo("other", "azure", remote=True),
}


def info(ep: str) -> EpInfo:
    """The table entry for ``ep``; an unknown provider is an 'other' device named after it."""
    if ep in PROVIDERS:
        return PROVIDERS[ep]
    stem = ep.removesuffix("ExecutionProvider").lower() or "ep"
    prefix = "".join(c for c in stem if c.isalnum() or c == "_")
    if not prefix[:1].isalpha():
        prefix = "ep_" + prefix
    return EpInfo("other", prefix)


def device_id(ep: str, index: int = 0) -> str:
    prefix = info(ep).id_prefix
    return "cpu" if prefix == "cpu" else f"{prefix}:{index}"


def provider_options(ep: str, index: int = 0) -> dict[str, str]:
    opts = dict(info(ep).options)
    if info(ep).multi_device:
        opts["device_id"] = str(index)
    return opts


def nvidia_gpu_count() -> int:
    """GPUs the NVIDIA driver exposes (0 without a driver), read without importing anything."""
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def device_indices(ep: str) -> list[int]:
    """Device indices to probe for ``ep`` (one for single-device EPs)."""
    if info(ep).multi_device:
        return list(range(max(1, nvidia_gpu_count())))
    return [0]


def runtime_name(ep: str) -> str:
    return f"onnxruntime/{ep}"
