"""The process-wide OpenVINO ``Core`` and the mapping between OpenVINO and dspark device names.

Nothing here imports ``openvino`` at module import time: the import costs
~0.4 s and ``dspark devices`` must start fast.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import openvino as ov

    from dspark.types import Device, DType

RUNTIME_PREFIX = "openvino/"

_core: ov.Core | None = None
_core_lock = threading.Lock()


def core() -> ov.Core:
    """The one ``ov.Core`` of this process (created lazily, thread-safe).

    One Core shares its plugin instances, thread pools and model cache among
    every compiled subgraph; creating one per call would multiply them.
    """
    global _core
    if _core is None:
        with _core_lock:
            if _core is None:
                import openvino as ov

                _core = ov.Core()
    return _core


@functools.cache  # metadata parsing costs more than a cached bid: once per process
def version() -> str:
    """The installed OpenVINO version, read from package metadata (no import)."""
    try:
        return importlib.metadata.version("openvino")
    except importlib.metadata.PackageNotFoundError:
        return ""


def dspark_id(ov_device: str) -> tuple[str, str]:
    """(dspark device id, kind) for an OpenVINO device name: 'GPU.1' -> ('gpu:1', 'gpu')."""
    family, _, index = ov_device.partition(".")
    family = family.lower()
    kind = family if family in ("cpu", "gpu", "npu") else "other"
    if kind == "cpu":
        return "cpu", kind
    idx = index if index.isdigit() else "0"
    if kind == "other":  # keep the family in the id so two unknown devices stay apart
        return f"{re.sub(r'[^a-z0-9_]', '_', family) or 'dev'}:{idx}", kind
    return f"{kind}:{idx}", kind


def ov_device(device: Device) -> str:
    """The OpenVINO device name a dspark device was probed as ('CPU', 'GPU.0', 'NPU')."""
    return str(device.properties.get("openvino_device") or "CPU")


def compile_config(ov_name: str) -> dict[str, Any]:
    """Compile options: explicit f32 so results match the fp32 reference on bf16/f16-default
    devices (Xeon with AMX, Intel GPUs); NPUs only compute in f16 and reject the hint."""
    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY"}
    if not ov_name.startswith("NPU"):
        config["INFERENCE_PRECISION_HINT"] = "f32"
    return config


def precision(ov_name: str) -> DType:
    """The dspark precision a subgraph compiled with :func:`compile_config` computes in."""
    return "float16" if ov_name.startswith("NPU") else "float32"
