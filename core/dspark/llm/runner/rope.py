"""Rotary position embeddings with the scaling variants of the Llama family.

Formulas follow transformers' ``ROPE_INIT_FUNCTIONS`` so that a checkpoint
gives the same numbers under our runner as under Hugging Face.
"""

from __future__ import annotations

import math

import torch

from dspark.llm.runner.loader import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = cfg.rope_scaling or {}
    kind = cfg.rope_type
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "llama3":
        factor = float(sc["factor"])
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_ctx = float(sc["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, head_dim] cos and sin for absolute ``positions``; computed in fp32 like HF."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [T, heads, head_dim]; rotate-half convention of the HF Llama port."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
