"""What the engine hands back: per-request outputs after a step, and the engine's statistics."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from dspark.llm.logits import TokenLogprobs

__all__ = ["EngineLayout", "EngineStats", "RequestOutput", "Usage"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class RequestOutput:
    """State of one request after a step; ``text``/``token_ids`` are cumulative, ``delta`` is new text."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta: str
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    usage: Usage
    num_preemptions: int = 0
    # One entry per token of ``token_ids`` (raw logprobs, vLLM's default) when params.logprobs is set.
    # A read-only view the length of ``token_ids``: ``logprobs[n_before:]`` is a stream's new part.
    logprobs: Seq[TokenLogprobs] | None = None
    first_scheduled: float | None = None  # time.perf_counter() when first scheduled (queue time = it - arrival)
    # With params.prompt_logprobs: entry k is prompt token k + 1's (the first token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True)
class EngineStats:
    kv_used_bytes: int
    kv_total_bytes: int
    kv_used_pages: int
    kv_free_pages: int
    kv_total_pages: int
    kv_usage: float
    kv_fragmentation: float
    page_size: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    effective_max_batch: int
    # Speculative decoding (all zero when it is off); the totals over every drafter:
    spec_strategy: str | None = None
    spec_drafts: int = 0  # (sequence, step) pairs that verified a draft
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0  # accepted tokens per draft
    spec_drafter_failures: int = 0
    spec_explore_steps: int = 0  # drafts DeepSpec made only to re-measure drafting costs
    spec_copy_runs: int = 0  # engine steps that ran a lone request's copy run (docs/decoders.md, "Copy runs")
    spec_calibration_error: float | None = None  # the acceptance predictor's expected calibration error
    spec_drafters: dict[str, dict[str, Any]] = field(default_factory=dict)  # the same, per drafter
    # Where a step's time goes: the decoder's forward, and the engine's own host work around it
    # (scheduling, block tables, drafting, sampling, stop checks, outputs); means over every step so far.
    # A greedy run (several decode steps in one decoder call) is one engine step; ``forward_steps`` counts
    # the decoder's forward passes, a run of n counting n.
    steps: int = 0
    forward_ms_per_step: float = 0.0
    host_ms_per_step: float = 0.0
    forward_steps: int = 0
    decoder: str = "torch"  # what runs the decoder now ("cpu@cpu", "torch", ...)
    decoder_failovers: int = 0


@dataclass(frozen=True)
class EngineLayout:
    """What runs the model and where, as an engine reports it (``LLMEngine.layout``): what a server logs,
    labels its metrics with and reports per trace, without reaching into the engine."""

    target: str  # e.g. "torch on cpu (float32)", "cpu@cpu (openvino/CPU), measured fastest (...)"
    devices: list[str]  # devices holding a piece of the model: "cpu", "cuda:0" ...
    plugins: list[str]  # plugins loaded and taking calls
    plugins_used: list[str]  # plugins the engine's pieces run through (decoder ranges, MLP offload, drafters)
    drafters: list[str] | None  # the speculative decoder's drafters; None: the engine drafts nothing
    # dspark.llm.device_map.DeviceMap: which layers run on which device and who runs them (torch or a plugin's
    # decoder), however they got there: devices=, a compiled decoder holding the model, or ranges chained
    device_map: Any = None
    mlp: tuple[str, str] | None = None  # (plugin, device) running the torch runner's prefill MLPs
