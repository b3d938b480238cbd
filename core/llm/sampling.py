"""Per-request sampling parameters and the sampler.

Each seeded request owns a ``torch.Generator``, so its tokens depend only on
its own seed and logits, never on which other requests share the batch.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


GREEDY_BELOW = 1e-5  # temperature under which sampling is argmax


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
        # As vLLM: temperatures this small are greedy in all but name, and dividing by one
        # that underflows float32 would turn the logits into inf/NaN.
        return self.temperature < GREEDY_BELOW or self.top_k == 1


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from fp32 ``logits`` [vocab]."""
    if p.greedy:
        return int(torch.argmax(logits))
    # Shift by the max first: a tiny temperature then sends the others to -inf, not max to inf (NaN).
    logits = (logits - logits.max()) / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = (torch.cumsum(sp, 0) - sp) >= p.top_p
        drop[0] = False  # a top_p that underflows to 0 must still keep the top token
        sp = sp.masked_fill(drop, 0.0)
        return int(si[torch.multinomial(sp, 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The normalised distribution ``sample`` draws from, for each row of ``logits`` [..., vocab].

    Speculative verification compares it with the drafter's: greedy gives a
    one-hot at the argmax; otherwise temperature, top-k and top-p as in ``sample``.
    """
    if p.greedy:
        return torch.nn.functional.one_hot(torch.argmax(logits, dim=-1), logits.shape[-1]).to(logits.dtype)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        drop = (torch.cumsum(sp, -1) - sp) >= p.top_p
        drop[..., 0] = False
        probs = probs.scatter(-1, si, sp.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
