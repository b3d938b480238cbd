"""Engine limits and policies, validated up front so a typo fails at construction."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SchedulerPolicy = Literal["fcfs_with_priority", "fcfs"]
# Which running sequence gives its pages back when a step runs out of them:
#   newest_first           the latest-arrived running sequence (vLLM's default; oldest work survives)
#   oldest_first           the earliest-arrived running sequence
#   lowest_priority_first  the largest priority number; ties go to the latest arrival
PreemptionPolicy = Literal["newest_first", "oldest_first", "lowest_priority_first"]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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
    dense_offload: str = Field(
        "off", description="prefill MLP through another plugin's compiled executable: 'off', 'auto' (when its "
        "bid beats torch's by a margin) or a plugin name to force it")
