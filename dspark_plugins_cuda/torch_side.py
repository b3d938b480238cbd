"""What torch can do with the GPUs NVML found: CUDA build, ordinals, SM counts.

Imported only once NVML has found a GPU, because importing torch takes seconds.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass, field
from typing import TypedDict


class TorchGpu(TypedDict):
    index: int  # CUDA ordinal in this process: the N of "cuda:N"
    sm_count: int
    torch_version: str
    torch_cuda_version: str


@dataclass
class TorchCuda:
    """Torch's view of CUDA: either usable (``gpus`` by normalized UUID) or a reason why not."""

    reason: str = ""
    gpus: dict[str, TorchGpu] = field(default_factory=dict)
    by_order: list[TorchGpu] = field(default_factory=list)

    def match(self, uuid: str | None, nvml_count: int, nvml_index: int) -> TorchGpu | None:
        """The CUDA ordinal of an NVML GPU, matched by UUID.

        NVML enumerates in PCI bus order while CUDA defaults to fastest-first
        and honours CUDA_VISIBLE_DEVICES, so indices alone can disagree.
        """
        if uuid and self.gpus:
            # No match: hidden by CUDA_VISIBLE_DEVICES, or split into MIG instances.
            return self.gpus.get(normalize_uuid(uuid))
        # No UUIDs to compare (old torch): only an unfiltered, same-size view
        # is safe to pair by position.
        if len(self.by_order) == nvml_count and "CUDA_VISIBLE_DEVICES" not in os.environ:
            return self.by_order[nvml_index]
        return None


def normalize_uuid(uuid: str) -> str:
    """NVML says "GPU-8e7f...-..."; torch prints the bare UUID. Compare hex digits only."""
    u = uuid.strip().lower()
    return (u[4:] if u.startswith("gpu-") else u).replace("-", "")


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return ""


def triton_version() -> str | None:
    """Installed Triton version, found without importing it (None when absent)."""
    if importlib.util.find_spec("triton") is None:
        return None
    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def torch_cuda() -> TorchCuda:
    if importlib.util.find_spec("torch") is None:
        return TorchCuda(reason="torch is not installed")
    import torch

    version = str(torch.__version__)
    if torch.version.cuda is None:
        return TorchCuda(reason=f"torch {version} was built without CUDA (a CPU-only build); "
                                "install a CUDA build of torch to use this GPU")
    if not torch.cuda.is_available():
        try:
            # Raises with the real cause (driver too old for this CUDA build, no device visible, ...).
            torch.cuda.init()  # type: ignore[no-untyped-call]
            cause = "torch.cuda.is_available() is False"
        except Exception as exc:
            cause = f"{type(exc).__name__}: {exc}"
        return TorchCuda(reason=f"torch {version} (CUDA {torch.version.cuda}) cannot use the GPU: {cause}")
    state = TorchCuda()
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpu = TorchGpu(index=i, sm_count=int(props.multi_processor_count), torch_version=version,
                       torch_cuda_version=str(torch.version.cuda))
        state.by_order.append(gpu)
        uuid = getattr(props, "uuid", None)
        if uuid is not None:
            state.gpus[normalize_uuid(str(uuid))] = gpu
    return state
