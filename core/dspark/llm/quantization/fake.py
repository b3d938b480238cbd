"""Fake quantization in torch: the canonical rounding, run as float matmuls.

Calibration measures what a precision does to the model's output without
compiling kernels: weights are quantized and dequantized exactly as
:func:`dspark.sdk.quant.quantize_weight` does (symmetric absmax, per output
channel or per group along the input), activations per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def fake_weight(w_t: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """``w_t`` [K, N] quantized and dequantized; ``group_size`` None = per output channel."""
    w = w_t.detach().float()
    k, n = w.shape
    g = k if group_size is None else min(group_size, k)
    groups = -(-k // g)
    pad = torch.zeros(groups * g, n, dtype=torch.float32)
    pad[:k] = w
    blocks = pad.view(groups, g, n)
    qmax = 127.0 if bits == 8 else 7.0
    scales = blocks.abs().amax(dim=1, keepdim=True) / qmax
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.clamp(torch.round(blocks / scales), -qmax, qmax)
    return (q * scales).view(-1, n)[:k].to(w_t.dtype)


def fake_activations(x: torch.Tensor) -> torch.Tensor:
    """Dynamic symmetric int8 per token (row), dequantized."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (torch.clamp(torch.round(xf / s), -127, 127) * s).to(x.dtype)


def fake_linear(w_t: torch.Tensor, bits: int, group_size: int | None,
                act_int8: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    wq = fake_weight(w_t, bits, group_size)
    if act_int8:
        return lambda x: fake_activations(x) @ wq
    return lambda x: x @ wq


def quantize_rows_int8(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedding table [V, H] as int8 with one scale per row (token)."""
    t = table.detach().float()
    s = t.abs().amax(dim=1, keepdim=True) / 127.0
    s = torch.where(s == 0, torch.ones_like(s), s)
    return torch.clamp(torch.round(t / s), -127, 127).to(torch.int8), s
