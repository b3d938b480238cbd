"""Torch CPU kernels for the torch plugin's quantized linears.

``pack`` repacks a canonical :class:`~dspark.sdk.quant.QuantizedWeight` into the
layout a kernel reads; ``apply`` runs ``x @ W`` with it. What runs which
:class:`~dspark.types.QuantSpec` (chosen by measurement on torch 2.13, AVX2):

* int8 per channel: ``aten._weight_int8pack_mm`` (int8 ``[N, K]``, one scale
  per output channel). Activations go in as bfloat16: its float32 path is
  scalar code, ~100x slower, while the bfloat16 one is vectorized. K is
  zero-padded to a multiple of 8: with any other K it returns wrong values
  or crashes.
* int8 with ``dynamic_int8`` activations: each row is quantized to int8 per
  token exactly as :func:`dspark.sdk.quant.quantize_activations_per_token` does;
  the integers (exact in bfloat16) go through the same kernel and the row
  scales multiply the result. No integer GEMM is used: ``torch._int_mm`` is
  a reference loop on CPU (~100x slower than float), and fbgemm's dynamic
  linear quantizes per tensor with 7-bit activations (``reduce_range``: its
  AVX2 kernel saturates otherwise), which misses the per-token reference by
  more than the int8 tolerance.
* int4, group-wise or per channel: ``aten._weight_int4pack_mm_for_cpu``
  (tinygemm layout: uint4 ``w = (q - 8) * scale + zero``, groups of 32, 64,
  128 or 256 along K, N a multiple of 16), bfloat16 activations for the same
  reason. The canonical signed nibble ``q`` becomes ``q + 8`` with zero 0;
  K and N are zero-padded to what the kernel needs.

Group-wise int8 has no kernel here. Results are float32 like the float path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dspark.sdk.quant import QuantizedWeight
from dspark.types import QuantSpec

INT4_GROUPS = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts, largest first
_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu needs N divisible by 16
_INT8_K_MULTIPLE = 16  # _weight_int8pack_mm reads K in blocks of 8, and of 16 for one row on AVX512-BF16 CPUs (wrong results or a crash otherwise)
_INNER_K_TILES = 2  # the CPU int4 packing ignores it beyond validation; 2 is what torchao passes


@dataclass(frozen=True)
class PackedLinear:
    """A weight in a kernel's layout, with what ``apply`` needs to run it."""

    kind: Literal["int8", "int4"]
    weight: Any  # torch: int8 [N, K], or the int4pack uint8 [N_pad, K_pad / 2]
    scales: Any  # torch bfloat16: [N] (int8), or scales_and_zeros [G, N_pad, 2] (int4)
    k: int
    n: int
    k_pad: int  # K the kernel reads; activations are zero-padded to it
    group: int  # int4 kernel group size; k_pad for int8
    dynamic: bool  # quantize activations per token first (dynamic_int8)

    @property
    def nbytes(self) -> int:
        return int(self.weight.numel() * self.weight.element_size() + self.scales.numel() * self.scales.element_size())


def unsupported_reason(spec: QuantSpec) -> str | None:
    """None when a kernel here computes ``spec``, else why not."""
    import torch

    if spec.weight_bits == 8:
        if spec.granularity != "per_channel":
            return "no group-wise int8 kernel in torch (per channel only)"
        if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            return f"torch {torch.__version__} has no aten._weight_int8pack_mm"
        return None
    if spec.activations != "float":
        return "no int4 kernel with quantized activations in torch"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no aten._weight_int4pack_mm_for_cpu"
    if spec.granularity == "group" and _int4_group(spec.group_size, None) is None:
        return f"group size {spec.group_size} is not a multiple of one of {INT4_GROUPS}"
    return None


def _int4_group(group_size: int, k: int | None) -> int | None:
    """The kernel group for a canonical group: the largest supported size dividing it, so each kernel
    group lies inside one canonical group. Per channel (``k`` given): any size fits, padding K."""
    if k is not None and group_size >= k:
        return next((g for g in INT4_GROUPS if k % g == 0), INT4_GROUPS[-1])
    return next((g for g in INT4_GROUPS if group_size % g == 0), None)


def pack(qw: QuantizedWeight, spec: QuantSpec) -> PackedLinear:
    """``qw`` (canonical [K, N]) in the layout of the kernel for ``spec``; ValueError if there is none."""
    import torch

    reason = unsupported_reason(spec)
    if reason is not None:
        raise ValueError(f"cannot pack {spec}: {reason}")
    k, n = qw.shape
    if qw.bits == 8:
        k_pad = -(-k // _INT8_K_MULTIPLE) * _INT8_K_MULTIPLE
        w8 = np.zeros((n, k_pad), dtype=np.int8)
        w8[:, :k] = qw.data.T
        scales = torch.from_numpy(qw.scales[0].copy()).to(torch.bfloat16)
        return PackedLinear("int8", torch.from_numpy(w8), scales, k, n, k_pad, k_pad,
                            spec.activations == "dynamic_int8")

    group = _int4_group(qw.group_size, k if qw.scales.shape[0] == 1 else None)
    if group is None:
        raise ValueError(f"int4 group size {qw.group_size} is not a multiple of one of {INT4_GROUPS}")
    kernel_groups = -(-k // group)
    k_pad = kernel_groups * group
    n_pad = -(-n // _INT4_N_MULTIPLE) * _INT4_N_MULTIPLE
    # Canonical nibbles are two's complement int4, low nibble first along K; tinygemm wants
    # q + 8 as uint4, which is the nibble with its top bit flipped. Padding is q = 0, i.e. 8.
    low, high = qw.data & 0x0F, qw.data >> 4
    nib = np.empty((qw.data.shape[0] * 2, n), dtype=np.uint8)
    nib[0::2], nib[1::2] = low, high
    u4 = np.full((n_pad, k_pad), 8, dtype=np.int32)
    u4[:n, :k] = (nib[:k] ^ 8).T
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(u4), _INNER_K_TILES)
    # One canonical scale per kernel group (each lies inside one canonical group); zero stays 0.
    rows = (np.arange(kernel_groups) * group) // qw.group_size
    sz = np.zeros((kernel_groups, n_pad, 2), dtype=np.float32)
    sz[:, :n, 0] = qw.scales[rows]
    sz[:, n:, 0] = 1.0
    scales = torch.from_numpy(sz).to(torch.bfloat16)
    return PackedLinear("int4", weight, scales, k, n, k_pad, group, False)


def apply(p: PackedLinear, x: Any) -> Any:
    """``x[..., K] @ W`` as float32 ``[..., N]`` (``x`` a CPU tensor of any float dtype).

    A handful of tensor ops on top of the kernel: this runs once per projection per decode step.
    """
    import torch

    x2 = x if x.dim() == 2 else x.reshape(-1, p.k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    row_scale = None
    if p.dynamic:
        # Per-token symmetric int8, as the canonical reference (an all-zero row stays zero
        # whatever its scale): the integers are exact in bfloat16.
        row_scale = x2.abs().amax(dim=1, keepdim=True).div_(127.0).clamp_min_(1e-30)
        xb = x2.div(row_scale).round_().clamp_(-127, 127).to(torch.bfloat16)
    else:
        xb = x2.to(torch.bfloat16)
    if p.k_pad != p.k:
        xb = torch.nn.functional.pad(xb, (0, p.k_pad - p.k))
    if p.kind == "int8":
        y = torch.ops.aten._weight_int8pack_mm(xb, p.weight, p.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p.weight, p.group, p.scales)
        if y.shape[1] != p.n:
            y = y[:, : p.n]
    y = y.float()
    if row_scale is not None:
        y.mul_(row_scale)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], p.n)
