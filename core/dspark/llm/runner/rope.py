"""Rotary position embeddings: every scaling type of the supported families.

Formulas follow transformers' ``ROPE_INIT_FUNCTIONS`` (modeling_rope_utils), op
for op in float32, so that a checkpoint gives the same numbers under our runner
as under Hugging Face. Two types change their frequencies with the context:

- dynamic NTK, as transformers computes it per forward call (the whole prompt at
  prefill, position + 1 at each decode step): here per row, the row's position + 1
  or its sequence's prompt length while that is longer, so chunked prefill,
  batching and speculative verification give each row what one-token-at-a-time
  decoding after a one-shot prefill gives it;
- LongRoPE (Phi-3), per sequence: short factors while the sequence is at most
  ``original_max_position_embeddings`` long, long factors for every position
  once it is longer, as Phi-3's generate does by recomputing its whole cache at
  the crossing. The runner does the same (ModelRunner._longrope_switch), and
  splits a chunk that crosses so each part runs in one mode (:func:`longrope_splits`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from dspark.llm.runner.kv_cache import PagedKVCache
    from dspark.llm.runner.types import SeqChunk


def _inv(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, max_pos: int, p: dict[str, Any]) -> tuple[torch.Tensor, float]:
    orig = p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / orig
    attention = p.get("attention_factor")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = float(mscale(factor, ms) / mscale(factor, ms_all)) if ms and ms_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attention)


class Rope:
    """One rotary embedding: its inverse frequencies, cos/sin scale and rotated width (partial rotary)."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_position_embeddings: int,
                 partial_rotary_factor: float = 1.0) -> None:
        self.kind = str(params.get("rope_type", "default"))
        self.params = params
        self.base = float(params["rope_theta"])
        self.dim = int(head_dim * partial_rotary_factor)  # rotated dims; the rest of the head passes through
        self.max_pos = max_position_embeddings
        self.scale = 1.0  # transformers' attention_scaling: multiplies cos and sin (YaRN, LongRoPE)
        self.inv_long: torch.Tensor | None = None
        self.orig = 0
        inv = _inv(self.base, self.dim)
        if self.kind == "linear":
            inv = inv / float(params["factor"])
        elif self.kind == "llama3":
            inv = _llama3(inv, params)
        elif self.kind == "yarn":
            inv, self.scale = _yarn(self.base, self.dim, max_position_embeddings, params)
        elif self.kind == "longrope":
            self.orig = int(params["original_max_position_embeddings"])
            factor = params.get("factor") or max_position_embeddings / self.orig
            att = params.get("attention_factor")
            if att is None:
                att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(self.orig))
            self.scale = float(att)
            shape = torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim
            inv = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * self.base ** shape)
            self.inv_long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float32) * self.base ** shape)
        self.inv = inv

    @property
    def by_context(self) -> bool:
        """Whether the frequencies depend on the context length (then cos_sin needs ``ctx``)."""
        return self.kind in ("longrope", "dynamic")

    def _dynamic(self, ctx: int) -> torch.Tensor:
        # As transformers' dynamic update, in its tensor arithmetic (float32), for a context past max_pos.
        seq = torch.maximum(torch.tensor(ctx), torch.tensor(self.max_pos))
        factor, d = float(self.params["factor"]), self.dim
        base = self.base * ((factor * seq / self.max_pos) - (factor - 1)) ** (d / (d - 2))
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))

    def _rows(self, ctx: torch.Tensor | None) -> torch.Tensor:
        """Inverse frequencies, [dim / 2] or per row [T, dim / 2] where they depend on ``ctx``."""
        if ctx is None or not self.by_context:
            return self.inv
        if self.kind == "longrope":
            assert self.inv_long is not None
            long = ctx > self.orig
            return torch.where(long[:, None], self.inv_long, self.inv) if bool(long.any()) else self.inv
        grown = ctx > self.max_pos
        if not bool(grown.any()):
            return self.inv
        rows = self.inv.expand(len(ctx), -1).clone()
        for c in sorted(set(ctx[grown].tolist())):
            rows[ctx == c] = self._dynamic(int(c))
        return rows

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                ctx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, dim] cos and sin for absolute ``positions``, computed in fp32 like HF; ``ctx``: per row, the
        context length its frequencies are chosen by (LongRoPE, dynamic NTK)."""
        inv = self._rows(ctx)
        freqs = positions.float()[:, None] * (inv[None, :] if inv.dim() == 1 else inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [T, heads, head_dim]; rotate-half convention of the HF Llama port, over the first
    ``cos.shape[-1]`` dims (partial rotary leaves the rest as they are)."""
    rd = cos.shape[-1]
    if rd != x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rd], cos, sin), x[..., rd:]), dim=-1)
    half = rd // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def longrope_splits(chunks: list[SeqChunk], seq_lens: dict[str, int], orig: int) -> dict[int, int]:
    """Chunks that cross LongRoPE's switch (row by row, a row at position p runs long once p + 1 > orig,
    a prompt row once the prompt is longer than orig): chunk index -> rows that run before the switch."""
    out = {}
    for i, ch in enumerate(chunks):
        s = seq_lens.get(ch.seq_id, 0)
        if (ch.prompt_len or 0) <= orig and s < orig < s + len(ch.token_ids):
            out[i] = orig - s
    return out


def run_split(chunks: list[SeqChunk], splits: dict[int, int], run: Callable[[list[SeqChunk]], list[torch.Tensor]]
              ) -> list[torch.Tensor]:
    """Run chunks that cross LongRoPE's switch (``splits``, :func:`longrope_splits`) in two steps, the rows
    before the switch first, and join each chunk's logits as one step would have given them."""
    first = run([replace(chunks[i], token_ids=chunks[i].token_ids[:k]) for i, k in splits.items()])
    rest = run([replace(ch, token_ids=ch.token_ids[splits[i]:]) if i in splits else ch for i, ch in enumerate(chunks)])
    heads = dict(zip(splits, first))
    return [torch.cat([heads[i], r]) if i in heads and ch.all_logits else r for i, (ch, r) in enumerate(zip(chunks, rest))]


def longrope_switch(cache: PagedKVCache, chunks: list[SeqChunk], orig: int,
                    recompute: Callable[[SeqChunk, bool], object]) -> list[bool]:
    """Per chunk, whether it runs in LongRoPE's long mode. Before that, a sequence whose cache holds the other
    mode (its chunk crosses the switch, or a rollback took it back) is recomputed in the chunk's mode from
    its tokens, as Phi-3's generate recomputes its cache at the crossing: its length goes to 0, then
    ``recompute(prefix_chunk, long)``."""
    from dspark.llm.runner.types import SeqChunk

    modes = []
    for ch in chunks:
        s = cache.seq_lens.get(ch.seq_id, 0)
        long = max(s + len(ch.token_ids), ch.prompt_len or 0) > orig
        was = ch.seq_id in cache.long_rope
        (cache.long_rope.add if long else cache.long_rope.discard)(ch.seq_id)
        if s > 0 and long != was:
            prefix = cache.tokens[ch.seq_id][:s]
            if len(prefix) != s:
                raise RuntimeError(f"sequence {ch.seq_id}: {len(prefix)} recorded tokens for {s} cached")
            cache.set_len(ch.seq_id, 0)
            recompute(SeqChunk(ch.seq_id, prefix), long)
        modes.append(long)
    return modes


def rope_positions(positions: np.ndarray, chunks: list[SeqChunk], modes: list[bool], offset: int
                   ) -> np.ndarray | None:
    """For a compiled decoder: each row's row of the spec's RoPE tables, its position plus ``offset``
    (``max_position_embeddings``) in long mode (``StepBatch.rope_positions``); None when no row is."""
    if not any(modes):
        return None
    return positions + np.repeat(np.where(modes, offset, 0), [len(ch.token_ids) for ch in chunks])
