"""Engine limits and policies, validated up front so a typo fails at construction."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dspark.llm.quantization.config import QuantizationConfig

SchedulerPolicy = Literal["fcfs_with_priority", "fcfs"]
# Which running sequence gives its pages back when a step runs out of them:
#   newest_first           the latest-arrived running sequence (vLLM's default; oldest work survives)
#   oldest_first           the earliest-arrived running sequence
#   lowest_priority_first  the largest priority number; ties go to the latest arrival
PreemptionPolicy = Literal["newest_first", "oldest_first", "lowest_priority_first"]


SpecStrategy = Literal["deepspec", "fixed", "off"]


class SpeculativeConfig(BaseModel):
    """Speculative decoding (``speculative_decoding={...}`` in ``LLM(...)`` and the server config).

    ``deepspec`` lets the adaptive controller pick, per request and step, the
    drafter and the number of drafted tokens (0 = plain decoding) from
    predicted acceptance and measured costs; ``fixed`` always drafts
    ``num_speculative_tokens`` with one drafter (the first of ``drafters``, or
    by preference the draft model, then self-drafting, then n-gram lookup: the
    request's own context before earlier requests' text).

    Greedy output is token-identical to plain decoding. Sampled output keeps
    the target's distribution exactly (the rejection rule), but a seeded
    request's tokens also depend on the drafts it was verified against, and
    under ``deepspec`` on timings, so they are not bit-reproducible the way
    plain seeded sampling is.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="false turns speculation off whatever the strategy")
    strategy: SpecStrategy = "deepspec"
    draft_model: str = Field(
        "auto", description="'auto' = a draft checkpoint made for the target if one is found (the embedded "
        "model's draft), 'none' = no separate draft model, or a checkpoint directory with the target's vocabulary")
    num_speculative_tokens: int = Field(4, ge=1, le=64, description="k of the fixed strategy")
    max_k: int = Field(32, ge=1, le=64, description="most tokens DeepSpec drafts per sequence and step (it "
                       "picks fewer, down to 0, where they do not pay; long drafts pay in copies and loops)")
    conservative: bool = Field(False, description="cap k for long open-ended text (and long contexts)")
    exit_layer: int | Literal["auto"] = Field(
        "auto", description="self-drafting exit layer: 'auto' = chosen by measured acceptance and cost among the "
        "early-exit layers the model was trained with and the lower half of its layers; or a layer count >= 1")
    drafters: list[str] | None = Field(
        None, description="drafters to use, by name or kind (model, self, ngram, other); None = every offer")
    drafter_timeout_s: float = Field(
        2.0, gt=0, description="a third-party drafter's call (propose, commit, release) that takes longer is "
        "abandoned and the drafter disabled, decoding going on without it; built-in drafters run inline")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        if isinstance(v, bool):
            return {"enabled": v}
        if isinstance(v, dict) and v.get("draft_model", "auto") is None:
            v = {**v, "draft_model": "none"}
        return v

    @field_validator("strategy", mode="before")
    @classmethod
    def _alias(cls, v: Any) -> Any:
        return "deepspec" if v == "deepspec_v2" else v  # the seed's name for the same strategy

    @field_validator("exit_layer")
    @classmethod
    def _exit(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"exit_layer must be 'auto' or >= 1, got {v}")
        return v

    @property
    def active(self) -> bool:
        return self.enabled and self.strategy != "off"


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    max_batch_size: int = Field(32, ge=1, description="sequences in one step at most")
    max_model_len: int | None = Field(None, ge=2, description="prompt + output tokens; default: the model's max_position_embeddings")
    max_total_tokens: int | None = Field(None, ge=1, description="KV budget in tokens over all sequences; rounded up to whole pages")
    page_size: int = Field(16, ge=1, description="tokens per KV page")
    max_num_batched_tokens: int = Field(512, ge=1, description="tokens per step; longer prompts are prefilled in chunks")
    scheduler_policy: SchedulerPolicy = "fcfs_with_priority"
    preemption_policy: PreemptionPolicy = "newest_first"
    priority_preemption: bool = Field(
        False, description="a waiting request may preempt running ones of a strictly lower priority "
        "(larger number), lowest and newest first, when no batch slot or pages are left for it")
    target_step_ms: float | None = Field(None, gt=0, description="adaptive batch size target; None keeps max_batch_size fixed")
    devices: str | None = Field(
        None, description="where the layers run: None = all on the CPU without asking the placer; 'auto' = "
        "the placer over the probed devices; or a device-profile YAML path (its devices torch can drive here)")
    packed_linear: Literal["auto", "on", "off"] = Field(
        "auto", description="oneDNN-packed copies of the float projections for steps of more than one row "
        "(batched decode, verification, prefill), one row staying on the plain weight: 'auto' = when the "
        "layers run float32 on the CPU and the copy is under a quarter of the available memory")
    dense_offload: str = Field(
        "off", description="prefill MLP through another plugin's compiled executable: 'off', 'auto' (when its "
        "bid beats torch's by a margin) or a plugin name to force it")
    speculative: SpeculativeConfig = Field(
        default_factory=lambda: SpeculativeConfig(enabled=False), alias="speculative_decoding",
        description="speculative decoding; a dict of SpeculativeConfig fields, or true/false")
    quantization: QuantizationConfig | None = Field(
        None, alias="quantization_config", description="mixed-precision quantization at load (calibrates first): "
        "a QuantizationConfig dict or a scheme name (int8, int4, int8_mixed, int4_mixed); None = as the checkpoint "
        "is (an optimized directory from `dspark convert` carries its own plan)")
