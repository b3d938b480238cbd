"""The drafters an engine's speculative decoder uses: handles, their counters, and guarded calls.

A drafter that raises or returns a malformed draft is logged (``spec.drafter_failed``),
counted, and disabled for the rest of the engine's life; decoding goes on without it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark.host.log import get_logger
from dspark.llm.speculative.call_guard import CallGuard
from dspark.llm.speculative.controller import RLS, draft_x
from dspark.types import Draft, DraftRequest

log = get_logger("dspark.llm.spec")


@dataclass
class DrafterStats:
    drafts: int = 0  # (sequence, step) pairs with at least one drafted token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0  # steps in which the drafter drafted for anyone
    draft_ms: float = 0.0
    failures: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            "mean_accepted_length": self.accepted_tokens / self.drafts if self.drafts else 0.0,
            "steps": self.steps, "draft_ms": round(self.draft_ms, 3), "failures": self.failures,
        }


@dataclass
class Handle:
    """One drafter offered for this engine's target."""

    idx: int
    name: str
    kind: str
    plugin: str
    obj: Any
    cost: RLS | None = None
    probe: bool = False  # cheap enough to run for every sequence before choosing
    disabled: str | None = None
    stats: DrafterStats = field(default_factory=DrafterStats)
    calls: int = 0
    guard: CallGuard | None = None  # a third party's drafter: its calls run with a deadline

    def call_batch(self, reqs: list[DraftRequest]) -> list[Draft]:
        if self.guard is not None:
            return list(self.guard(self._call_batch, reqs))
        return self._call_batch(reqs)

    def _call_batch(self, reqs: list[DraftRequest]) -> list[Draft]:
        fn = getattr(self.obj, "propose_batch", None)
        if fn is not None:
            return list(fn(reqs))
        return [self.obj.propose(list(r.tokens), r.k) for r in reqs]


def guarded_create(offer: Any, timeout_s: float) -> Any:
    """A third party's ``create()``, which may load a model: 10x the call deadline, at least 30 s."""
    g = CallGuard(f"{offer.name}.create", max(30.0, 10 * timeout_s))
    try:
        return g(offer.create)
    finally:
        g.close()


def positions(h: Handle, reqs: list[DraftRequest], drafts: list[Draft]) -> int:
    """The draft positions a call paid for: a model drafter runs one forward per position until every
    request has its tokens or its ``keep_going`` stopped it, so the longest draft returned (asked for k=16
    and stopped after 2, it paid for 2: priced at 16, each position would be learned 8x too cheap); a
    lookup's time barely depends on positions, so what was asked."""
    if h.probe:
        return max(r.k for r in reqs)
    return max(1, max((len(d.tokens) for d in drafts), default=0))


def stateful(h: Handle) -> bool:
    """A built-in drafter whose learned state ``snapshot``/``restore`` cover (a third party's is its own)."""
    return h.guard is None and callable(getattr(h.obj, "snapshot", None)) \
        and callable(getattr(h.obj, "restore", None))


class DrafterCalls:
    """Calls into the drafters, each checked: a fault disables that drafter and is counted."""

    handles: list[Handle]
    failures: int
    vocab: int

    # -- failures -----------------------------------------------------------
    def _disable(self, h: Handle, reason: str) -> None:
        if h.disabled is None:
            h.disabled = reason
            h.stats.failures += 1
            self.failures += 1
            log.warning("spec.drafter_failed", drafter=h.name, plugin=h.plugin, error=reason,
                        note="disabled for the rest of this engine's run; decoding goes on without it")

    def _run(self, h: Handle, reqs: list[DraftRequest]) -> list[Draft] | None:
        """Call a drafter, check what it returns; None (and the drafter disabled) on any fault."""
        t0 = time.perf_counter()
        try:
            drafts = h.call_batch(reqs)
        except Exception as exc:
            self._disable(h, f"propose raised {type(exc).__name__}: {exc}")
            return None
        ms = (time.perf_counter() - t0) * 1e3
        if len(drafts) != len(reqs):
            self._disable(h, f"returned {len(drafts)} drafts for {len(reqs)} requests")
            return None
        for r, d in zip(reqs, drafts):
            if not isinstance(d, Draft):
                self._disable(h, f"returned {type(d).__name__}, not dspark.Draft")
                return None
            n = len(d.tokens)
            if n > r.k or any(not (isinstance(t, int) and 0 <= t < self.vocab) for t in d.tokens):
                self._disable(h, f"returned draft {d.tokens[:8]} for k={r.k} (too long or outside the vocabulary)")
                return None
            if d.probs is not None and tuple(np.shape(d.probs)) != (n, self.vocab):
                self._disable(h, f"returned probs of shape {np.shape(d.probs)} for {n} tokens")
                return None
            if d.confidence is not None and len(d.confidence) != n:
                self._disable(h, f"returned {len(d.confidence)} confidences for {n} tokens")
                return None
        if reqs:
            h.stats.draft_ms += ms
            h.calls += 1
            # A lookup's cost barely moves and it is called every step: refresh its model now and then.
            if h.cost is not None and (not h.probe or h.calls % 8 == 0):
                h.cost.update(draft_x(positions(h, reqs, drafts), len(reqs)), ms)
        return drafts

    def _tell(self, h: Handle, method: str, *args: Any) -> None:
        fn = getattr(h.obj, method, None)
        if fn is None or h.disabled:
            return
        try:
            if h.guard is not None:
                h.guard(fn, *args)
            else:
                fn(*args)
        except Exception as exc:
            self._disable(h, f"{method} raised {type(exc).__name__}: {exc}")

    def _drafter_states(self) -> dict[int, Any]:
        """What built-in drafters learn across requests (suffix-lookup's store), by handle."""
        return {h.idx: h.obj.snapshot() for h in self.handles if stateful(h)}

    def _load_drafter_states(self, states: dict[int, Any]) -> None:
        for h in self.handles:
            if h.idx in states and stateful(h):
                h.obj.restore(states[h.idx])
