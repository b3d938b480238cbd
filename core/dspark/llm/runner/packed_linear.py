"""oneDNN-packed copies of the float projections, for steps with more than one row.

The matmuls of a multi-row step (a batched decode, a verification chunk) run
through MKL's GEMM much slower than the same weights reach in oneDNN's
blocked layout, while a single row is fastest through MKL's GEMV on the plain
weight (oneDNN's per-call overhead shows at batch 1; docs/benchmarks.md has
the figures). So the plain weight stays for one-row steps and a packed
copy serves every step with more rows: one more copy of the float projection
weights in memory, which ``auto`` only spends when it is small next to the
memory available.

The packing is torch's own: ``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise`` are what torch's inductor uses for frozen CPU linears.
They are private ops, so availability and numerics are probed once, and any
failure leaves the plain path with the reason logged.
"""

from __future__ import annotations

import functools
from typing import Any, Literal, Protocol

import torch

from dspark.host.log import get_logger

log = get_logger(__name__)

PackMode = Literal["auto", "on", "off"]
# ``auto`` packs while the extra copy stays under this share of the available memory.
AUTO_MEMORY_SHARE = 0.25
_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; one hint serves every step size


class Packable(Protocol):
    """What packing reads of a runner (:class:`dspark.llm.runner.model.ModelRunner` is one)."""

    dtype: torch.dtype
    layer_devices: list[torch.device] | None

    def float_projections(self) -> list[tuple[Any, str, bool, str]]:
        """(owner, weight attribute, stored transposed?, packed slot) of each float projection."""
        ...


@functools.cache
def unavailable_reason() -> str | None:
    """None when oneDNN packing works in this torch build, else why not (probed once per process)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g)
        x = torch.randn(3, 16, generator=g)
        y = linear(x, pack(w))
    except Exception as e:  # a build or CPU without the op: the plain path runs
        return f"torch.ops.mkldnn linear failed: {type(e).__name__}: {e}"
    err = float((y - x @ w.t()).abs().max())
    if not err < 1e-4:
        return f"oneDNN linear differs from torch's by {err:.2e} on a probe"
    return None


def pack(w: torch.Tensor) -> torch.Tensor:
    """A float32 weight [out, in] in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _BATCH_HINT)


def row_bucket(m: int) -> int:
    """The row count ``m`` rows run as: exact up to 8, then four buckets per doubling (<= 25% padding).

    oneDNN builds (JIT-compiles) a primitive per input shape and keeps it, so row counts left
    free grow the process's memory without bound over a long run; padded to these buckets (a
    few per doubling) it stays bounded.
    """
    if m <= 8:
        return m
    step = 1 << (m.bit_length() - 3)
    return -(-m // step) * step


def linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` for a weight packed by :func:`pack`; rows padded to their bucket."""
    m = x.shape[0]
    b = row_bucket(m)
    if b != m:
        x = torch.cat([x, x.new_zeros(b - m, x.shape[1])])
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")[:m]


def packable(runner: Packable) -> str | None:
    """None when ``runner`` can take packed copies, else why not."""
    if runner.dtype != torch.float32:
        return f"the model runs in {runner.dtype} (packing is float32 only)"
    if runner.layer_devices is not None:
        return "layers are placed off the CPU"
    return unavailable_reason()


def pack_runner(runner: Packable, mode: PackMode = "auto", available_bytes: int | None = None) -> str:
    """Give ``runner``'s float projections (and LM head) packed copies per ``mode``; returns what was done.

    Projections already replaced by a quantized kernel keep that kernel and get no copy.
    """
    if mode == "off":
        return "off"
    why = packable(runner)
    if why is not None:
        if mode == "on":
            raise ValueError(f"packed_linear='on' is not possible: {why}")
        log.info("llm.packed_linear", packed=False, reason=why)
        return f"not packed: {why}"
    todo = runner.float_projections()
    extra = sum(getattr(owner, attr).numel() * 4 for owner, attr, _, _ in todo)
    if mode == "auto":
        if available_bytes is None:
            import psutil

            available_bytes = int(psutil.virtual_memory().available)
        if extra > AUTO_MEMORY_SHARE * available_bytes:
            why = (f"the packed copy would take {extra / 2**20:.0f} MiB, over {AUTO_MEMORY_SHARE:.0%} of the "
                   f"{available_bytes / 2**20:.0f} MiB available")
            log.info("llm.packed_linear", packed=False, reason=why)
            return f"not packed: {why}"
    for owner, attr, transposed, slot in todo:
        w = getattr(owner, attr)
        setattr(owner, slot, pack(w.t() if transposed else w))
    log.info("llm.packed_linear", packed=True, projections=len(todo), extra_mib=round(extra / 2**20, 1))
    return f"packed {len(todo)} projections ({extra / 2**20:.1f} MiB more)"
