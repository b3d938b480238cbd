"""Per-request sampling parameters and the sampler.

Each seeded request owns a ``torch.Generator``, so its tokens depend only on
its own seed and logits, never on which other requests share the batch.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. ``temperature=0`` is greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, description="tokens to generate at most; must be >= 1")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, description="0 or -1 disables top-k")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, description="stop strings; output is cut before them")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"max_tokens must be >= 1, got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {v}")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        return [v] if isinstance(v, str) else v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from fp32 ``logits`` [vocab]."""
    if p.greedy:
        return int(torch.argmax(logits))
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (torch.cumsum(sp, 0) - sp) >= p.top_p
        sp = sp.masked_fill(drop, 0.0)
        return int(si[torch.multinomial(sp, 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))
