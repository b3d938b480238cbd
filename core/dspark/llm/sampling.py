"""Per-request sampling parameters and the sampler.

Each seeded request owns a ``torch.Generator``, so its tokens depend only on
its own seed and logits, never on which other requests share the batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence as Seq
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


GREEDY_BELOW = 1e-5  # temperature under which sampling is argmax
MAX_LOGPROBS = 20  # alternatives per token at most, as OpenAI and vLLM's default


class GuidedSpec(BaseModel):
    """What output must look like; pure data: ``dspark.llm.structured`` compiles it into a constraint.

    ``value``: the schema as JSON text (json_schema), the regex, the grammar
    text, or a JSON list of strings (choice); None for json_object.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema", "regex", "grammar", "choice"]
    value: str | None = None

    @model_validator(mode="after")
    def _value_needed(self) -> GuidedSpec:
        if self.kind != "json_object" and not self.value:
            raise ValueError(f"guided decoding of kind {self.kind!r} needs a value")
        if self.kind == "choice":
            try:
                choices = json.loads(self.value or "")
            except json.JSONDecodeError as e:
                raise ValueError(f"guided choice must be a JSON list of strings: {e}") from e
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                raise ValueError("guided choice must be a non-empty JSON list of strings")
        return self


REPETITION_MIN, REPETITION_MAX = 0.01, 100.0
_FLOATS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. ``temperature=0`` is greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_tokens: int = Field(16, description="tokens to generate at most; must be >= 1")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, description="0 or -1 disables top-k")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, description="stop strings; output is cut before them")
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = Field(None, description="None: no logprobs; N: the sampled token's and the N "
                                                   f"most likely (0..{MAX_LOGPROBS})")
    presence_penalty: float = Field(0.0, description="in [-2, 2]; subtracted once from tokens already generated")
    frequency_penalty: float = Field(0.0, description="in [-2, 2]; subtracted per time a token was generated")
    repetition_penalty: float = Field(1.0, description="0.01..100; divides positive (multiplies negative) logits of "
                                                       "tokens in the prompt or the output")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> bias in [-100, 100]")
    min_tokens: int = Field(0, description="EOS and stop_token_ids are blocked until this many tokens")
    prompt_logprobs: int | None = Field(None, description="None: none; N: each prompt token's logprob (but the "
                                                          f"first's) and the N most likely (0..{MAX_LOGPROBS})")
    guided: GuidedSpec | None = None

    @field_validator(*_FLOATS, mode="before")
    @classmethod
    def _finite(cls, v: object, info: object) -> object:
        # Before the range checks: NaN fails every comparison and would read "should be <= 2".
        if isinstance(v, (int, float, str)) and not isinstance(v, bool):
            try:
                f = float(v)
            except ValueError:
                return v  # pydantic reports the type error
            if not math.isfinite(f):
                raise ValueError(f"{info.field_name} must be a finite number, got {v!r}")  # type: ignore[attr-defined]
        return v

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

    @field_validator("logprobs", "prompt_logprobs")
    @classmethod
    def _logprobs(cls, v: int | None, info: object) -> int | None:
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"{info.field_name} must be between 0 and {MAX_LOGPROBS}, got {v}")  # type: ignore[attr-defined]
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v: float, info: object) -> float:
        if not -2.0 <= v <= 2.0:
            raise ValueError(f"{info.field_name} must be between -2 and 2, got {v}")  # type: ignore[attr-defined]
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, v: float) -> float:
        # Bounded away from 0 and infinity: logits divided or multiplied by it must stay finite in float32.
        if not REPETITION_MIN <= v <= REPETITION_MAX:
            raise ValueError(f"repetition_penalty must be between {REPETITION_MIN} and {REPETITION_MAX}, got {v}")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_finite(cls, v: object) -> object:
        if isinstance(v, dict):
            for t, b in v.items():
                if isinstance(b, (int, float)) and not isinstance(b, bool) and not math.isfinite(b):
                    raise ValueError(f"logit_bias for token {t} must be a finite number, got {b!r}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[int, float]) -> dict[int, float]:
        for t, b in v.items():
            if t < 0:
                raise ValueError(f"logit_bias token id {t} is negative")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias for token {t} must be between -100 and 100, got {b}")
        return v

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"min_tokens must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        # As vLLM: temperatures this small are greedy in all but name, and dividing by one
        # that underflows float32 would turn the logits into inf/NaN.
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def needs_processing(self) -> bool:
        """Whether logits go through ``dspark.llm.logits.process`` before sampling."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias) or self.min_tokens > 0 or self.guided is not None)


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from fp32 ``logits`` [vocab]: ``distribution``'s, drawn with uniform numbers from ``gen``
    (one, or a few with top_p) and no sort of the vocabulary: torch's sort of a row on the CPU cost more than
    a decode step of a small model at 32 rows (docs/benchmarks.md, decoder targets, "Sampling")."""
    return sample_rows(logits[None], [p], [gen])[0]


def sample_rows(logits: torch.Tensor, params: Seq[SamplingParams], gens: Seq[torch.Generator | None]) -> list[int]:
    """A token for each row of fp32 ``logits`` [n, vocab], row i from ``params[i]`` and uniform numbers of
    ``gens[i]``: the temperature, softmax, draws and top_p checks of all rows as one batch of tensor work
    (row by row they were most of a sampled step's host time at 32 rows). A row draws the same numbers,
    and picks the same token, alone or in a batch; a generator shared by several rows is drawn in row order,
    round by round. The work runs on one torch thread: OpenMP's workers spin after a parallel region and
    would take a core from the decoder's next step."""
    n, vocab = logits.shape
    out = [0] * n
    batch: list[int] = []
    for i, p in enumerate(params):
        if p.greedy:
            out[i] = int(torch.argmax(logits[i]))
        else:
            batch.append(i)
    if not batch:
        return out
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _draw_rows(logits if len(batch) == n else logits[batch], [params[i] for i in batch],
                   [gens[i] for i in batch], batch, out)
    finally:
        torch.set_num_threads(threads)
    return out


def _draw_rows(x: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None], where: list[int],
               out: list[int]) -> None:
    """``sample_rows``'s draws for rows that are not greedy; row r's token goes to ``out[where[r]]``. The work
    over the vocabulary (scaling, top_k, softmax, cumulative sums, the mass above a pick) is torch's, batched;
    each row's few numbers (its draw, pick and top_p check) are read on the host: a small tensor op per row
    cost more than the vocabulary's work at one row, all the more right after a step, with cold caches."""
    vocab = x.shape[-1]
    x = x.detach().float().cpu()  # the sampler lives on the host, in float32 (in place where it is so already)
    # softmax subtracts each row's max itself; 1 / temperature is at most 1e5 (GREEDY_BELOW), so no finite
    # float32 logit overflows on the way.
    x = x * torch.tensor([1.0 / p.temperature for p in params], dtype=x.dtype)[:, None]
    ks = [r for r, p in enumerate(params) if 0 < p.top_k < vocab]
    if ks:
        kk = torch.tensor([params[r].top_k for r in ks])
        sub = x[ks]
        kth = torch.topk(sub, int(kk.max()), dim=-1).values.gather(1, kk[:, None] - 1)
        x[ks] = sub.masked_fill(sub < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    pn = probs.numpy()
    live = list(range(len(params)))  # rows of ``probs`` still drawing
    w = probs
    while live:
        total = torch.cumsum(w, -1).numpy()
        u = np.array([float(torch.rand((), generator=gens[r])) for r in live], np.float32) * total[:, -1]
        if len(live) <= 4:  # the same binary search either way; one call for many rows
            picks = [min(int(np.searchsorted(total[i], u[i], side="right")), vocab - 1) for i in range(len(live))]
        else:
            picks = torch.searchsorted(torch.from_numpy(total), torch.from_numpy(u)[:, None], right=True)[:, 0] \
                .clamp_(max=vocab - 1).tolist()
        pxs = [float(pn[r, k]) for r, k in zip(live, picks)]
        # top_p by rejection: a token drawn from those above a rising pivot is kept when the more probable
        # tokens carry less than top_p; else none as probable as it is kept, and the pivot rises to it. Those
        # carry at most 1 - p(token): a token that probable is kept without the sum.
        tps = [params[r].top_p for r in live]
        kept = [tp >= 1.0 or px > 1.0 - tp + 1e-4 for px, tp in zip(pxs, tps)]
        check = [i for i, ok in enumerate(kept) if not ok]
        if check:
            sub = probs[torch.tensor([live[i] for i in check])]
            pc = torch.tensor([pxs[i] for i in check], dtype=sub.dtype)[:, None]
            for i, mass in zip(check, torch.where(sub > pc, sub, 0.0).sum(-1).tolist()):
                kept[i] = mass < tps[i]
        again = [i for i, ok in enumerate(kept) if not ok]
        for i, r in enumerate(live):
            if kept[i]:
                out[where[r]] = picks[i]
        if not again:
            break
        pr = probs[torch.tensor([live[i] for i in again])]
        w = pr * (pr > torch.tensor([pxs[i] for i in again], dtype=pr.dtype)[:, None])
        live = [live[i] for i in again]


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
        # numpy's sort: torch's is several times slower on the CPU.
        si = torch.from_numpy(np.argsort(-probs.detach().float().cpu().numpy(), axis=-1)).to(probs.device)
        sp = torch.gather(probs, -1, si)
        drop = (torch.cumsum(sp, -1) - sp) >= p.top_p
        drop[..., 0] = False
        # Tokens as probable as the least probable kept one are kept too (sample's rule, whatever the
        # sort's order among equals).
        low = sp.masked_fill(drop, float("inf")).min(-1, keepdim=True).values
        probs = probs.masked_fill(probs < low, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
