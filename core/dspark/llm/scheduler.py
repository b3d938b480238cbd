"""Iteration-level scheduler: who runs in the next step, with how many tokens.

Every step it (1) gives each running decode its one token, (2) continues
running prefills with what is left of the token budget, (3) admits waiting
requests in policy order while batch slots, budget and pages last. When a
running sequence cannot get a page, a victim chosen by the preemption policy
is preempted by recompute: its pages are freed and it re-queues with
prompt + generated tokens as its new prefill, so greedy output is unchanged.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from dspark.llm.config import EngineConfig
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    generator: torch.Generator | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    emitted: int = 0  # characters of ``text`` already streamed
    num_preemptions: int = 0
    constraint: Any = None  # a dspark.llm.structured constraint when params.guided is set
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprobs per output token, when asked for
    prompt_logprobs: list[Any] = field(default_factory=list)  # TokenLogprobs of prompt tokens 1.., when asked for
    first_scheduled: float | None = None  # time.perf_counter() when first planned into a step
    stop_floor: int = 0  # characters of ``text`` before which stop strings are not searched (min_tokens)
    penalty_counts: Any = None  # dspark.llm.logits.PenaltyCounts, made on first use by the batched processing
    detok: Any = None  # the incremental decoder of the output text (dspark.llm.detokenize), made on first use
    detok_n: int = 0  # output tokens it has been fed
    detok_text: str = ""  # the text it has given
    # No logits processing, logprobs or grammar: the engine's batched fast path. Set at construction.
    plain: bool = field(init=False, default=True)

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Recompute ``plain`` (after attaching a constraint, say)."""
        p = self.params
        self.plain = not (p.needs_processing or p.logprobs is not None) and self.constraint is None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_pending(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the end of the sequence, so its logits are sampled."""
        return self.seq.num_computed + self.num_tokens == len(self.seq.all_ids)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: PagedKVCache) -> None:
        self.config = config
        self.cache = cache
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.effective_max_batch = config.max_batch_size
        self._ema_ms: float | None = None

    # -- queues -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Leave the batch now and give the pages back at once."""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.cache.free(seq.request_id)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit_key(self, s: Sequence) -> tuple[int, int]:
        if self.config.scheduler_policy == "fcfs_with_priority":
            return (s.priority, s.arrival)
        return (0, s.arrival)

    def _keep_key(self, s: Sequence) -> tuple[int, int]:
        """Sort key of running sequences: the largest key is the next preemption victim."""
        pol = self.config.preemption_policy
        if pol == "newest_first":
            return (0, s.arrival)
        if pol == "oldest_first":
            return (0, -s.arrival)
        return (s.priority, s.arrival)

    def _preempt(self, victim: Sequence) -> None:
        self.cache.free(victim.request_id)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(victim)
        self.waiting.append(victim)

    # -- one step -----------------------------------------------------------
    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        done: set[int] = set()
        preempted = False
        by_keep = sorted(self.running, key=self._keep_key)
        # Decodes first so that a long prefill never stalls them; then running prefills.
        for seq in [s for s in by_keep if s.num_pending == 1] + [s for s in by_keep if s.num_pending > 1]:
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            n = min(seq.num_pending, budget)
            while not self.cache.can_grow(seq.request_id, seq.num_computed + n):
                candidates = [s for s in self.running if id(s) not in done]
                victim = max(candidates, key=self._keep_key)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            self.cache.reserve(seq.request_id, seq.num_computed + n)
            out.append(ScheduledChunk(seq, n))
            done.add(id(seq))
            budget -= n
        if preempted:
            return out  # admitting now would only thrash against what was just evicted
        for seq in sorted(self.waiting, key=self._admit_key):
            if budget <= 0:
                break
            n = min(seq.num_pending, budget)
            while self.config.priority_preemption and not self._fits(seq, n):
                lower = [s for s in self.running if s.priority > seq.priority]
                if not lower:
                    break
                victim = max(lower, key=lambda s: (s.priority, s.arrival))
                for i, chunk in enumerate(out):  # it may already be planned for this step
                    if chunk.seq is victim:
                        budget += out.pop(i).num_tokens
                        break
                self._preempt(victim)
                n = min(seq.num_pending, budget)
            if not self._fits(seq, n):
                break  # strict order: a later, smaller request must not overtake
            self.waiting.remove(seq)
            if seq.first_scheduled is None:
                seq.first_scheduled = time.perf_counter()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self.cache.reserve(seq.request_id, seq.num_computed + n)
            out.append(ScheduledChunk(seq, n))
            budget -= n
        return out

    def _fits(self, seq: Sequence, n: int) -> bool:
        return len(self.running) < self.effective_max_batch and self.cache.can_grow(
            seq.request_id, seq.num_computed + n)

    # -- adaptive batch size --------------------------------------------------
    def record_step(self, step_ms: float) -> None:
        """Tune the effective batch limit towards ``target_step_ms`` (AIMD on a smoothed latency)."""
        target = self.config.target_step_ms
        if target is None:
            return
        self._ema_ms = step_ms if self._ema_ms is None else 0.5 * self._ema_ms + 0.5 * step_ms
        eff = self.effective_max_batch
        if self._ema_ms > 1.2 * target and eff > 1:
            # Multiplicative decrease reacts fast to overload; running sequences are not evicted.
            self.effective_max_batch = max(1, min(eff - 1, int(eff * 0.75)))
        elif self._ema_ms < 0.8 * target and eff < self.config.max_batch_size:
            self.effective_max_batch = eff + 1
