"""Runs of greedy decode steps in one call to the decoder (plugin API 1.13, ``greedy_steps``).

A decode step of a small model is short, and the engine's own work around it (scheduling, the batch,
sampling, stop checks, outputs) is a sizeable share of it (docs/benchmarks.md). While every running
request is plain greedy decoding and nothing waits to be admitted, the decoder can take its own argmax
and feed it back for several steps; the engine's work is then paid once per run (vLLM's multi-step
scheduling). The run's length is bounded in time, not in steps (``EngineConfig.decode_run_ms``). A
request that arrives during a run ends it after the step in flight where the decoder can (API 1.15,
``end_run``: llama.cpp's and OpenVINO's), else waits at most about the budget longer to be admitted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dspark.llm.scheduler import ScheduledChunk

MAX_RUN = 32  # steps in one run at most
# A closed batch's run (LLM.generate: no arrival can wait on it) may last this long: the engine's work is then
# paid a few times a second, and a run stays far inside the step watchdog's deadline on a large model.
CLOSED_RUN_MS = 250.0


class RunLength:
    """How many steps a run takes: as many as fit in ``budget_ms`` at the decode step's recent time."""

    def __init__(self, budget_ms: float) -> None:
        self.budget_ms = budget_ms
        self.step_ms: float | None = None  # a decode step's forward, smoothed

    def observe(self, forward_ms: float, steps: int = 1) -> None:
        ms = forward_ms / max(steps, 1)
        self.step_ms = ms if self.step_ms is None else 0.7 * self.step_ms + 0.3 * ms

    def steps(self, budget_ms: float | None = None) -> int:
        """Steps of the next run: as many as fit in ``budget_ms`` (default: the engine's ``decode_run_ms``)."""
        budget = self.budget_ms if budget_ms is None else budget_ms
        if self.budget_ms <= 0 or budget <= 0 or not self.step_ms:
            return 1
        return max(1, min(MAX_RUN, int(budget / self.step_ms)))


def is_decode(p: ScheduledChunk) -> bool:
    """A chunk of one token that completes its sequence (a decode step)."""
    return p.num_tokens == 1 and p.completes


def run_limits(planned: list[ScheduledChunk], steps: int, max_model_len: int) -> list[int] | None:
    """Tokens each planned chunk may get in one run of ``steps``, or None when this step must be a plain one:
    a chunk that is not a decode, a request that samples, processes logits or wants logprobs, or no
    request with room for more than one token (``max_tokens``, the model's length)."""
    if steps < 2:
        return None
    out = []
    for p in planned:
        s = p.seq
        if not is_decode(p) or not s.plain or not s.params.greedy or s.params.prompt_logprobs is not None:
            return None
        total = len(s.prompt_ids) + len(s.output_ids)
        left = s.params.max_tokens - len(s.output_ids)
        if max_model_len:
            left = min(left, max_model_len - total)
        out.append(max(1, min(steps, left)))
    return out if max(out, default=1) > 1 else None


def stop_ids(planned: list[ScheduledChunk], eos_ids: Iterable[int]) -> frozenset[int]:
    """Tokens after which the decoder stops feeding a sequence: any planned request's stop tokens (EOS unless
    it ignores it). A token that stops only another request just ends this one's run early."""
    eos = frozenset(eos_ids)
    out: set[int] = set()
    for p in planned:
        out.update(p.seq.params.stop_token_ids)
        if not p.seq.params.ignore_eos:
            out |= eos
    return frozenset(out)
