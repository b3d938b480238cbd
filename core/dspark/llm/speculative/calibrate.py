"""Startup calibration of the speculative decoder's cost models: the target's verify forwards and
every drafter timed on this machine before serving, with neutral priors where there is no room."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from dspark.llm.config import SpeculativeConfig
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.model import ModelRunner, SeqChunk
from dspark.llm.speculative.controller import (
    RLS,
    Controller,
    VerifyCost,
    draft_x,
    fit,
    padded_drafted,
    verify_x,
)
from dspark.llm.speculative.handles import DrafterCalls, DrafterStats
from dspark.llm.speculative.verify import HEAD_BLOCK
from dspark.types import DraftRequest


class Calibration(DrafterCalls):
    """The cost models' startup measurement (a part of :class:`~dspark.llm.speculative.decoder.SpecDecoder`)."""

    cfg: SpeculativeConfig
    runner: ModelRunner
    cache: PagedKVCache
    calibration: dict[str, Any]
    controller: Controller | None
    verify_cost: VerifyCost
    change_ms: float = 0.0  # what a change of the step's row count costs (_change_cost)

    def _calibrate(self, costs: bool = True) -> None:
        """Time the target's verify forwards and every drafter on this machine, before serving; with
        ``costs`` False only what a change of the step's shape costs (the fixed strategy's width)."""
        cache, runner = self.cache, self.runner
        ctx_len, kmax = 48, self.cfg.max_k
        V = self.vocab
        pattern = [3 + (i * 7919) % max(V - 3, 1) for i in range(12)]
        per = cache.pages_for(ctx_len + kmax + 2)
        # No more sequences than the cache may hold at once (a runtime keeping its own KV refuses more).
        # The change of shape alone needs one.
        nseq = max(0, min(4 if costs else 1, cache.allocator.num_free // per, getattr(runner, "max_seqs", 4)))
        if nseq == 0:  # no room to measure: priors for DeepSpec, no change of shape priced
            if costs:
                self._prior_costs(None)
                self.controller = self._make_controller()
            return
        ids = [f"__spec_cal_{i}" for i in range(nseq)]
        ctx = {s: (pattern[i:] + pattern[:i]) * (ctx_len // len(pattern)) for i, s in enumerate(ids)}
        before = self._drafter_states()  # timing calls teach the drafters nothing
        xs: list[list[float]] = []
        ys: list[float] = []

        def timed(fn: Any, reps: int = 5) -> float:
            fn()  # warm
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return _low(ts)

        try:
            prefill_ms = []
            last_rows = {}  # the row that chose each context's last token, for drafters that read it
            for s in ids:
                t0 = time.perf_counter()
                last_rows[s] = runner.step(cache, [SeqChunk(s, ctx[s][:-1])])[0]
                prefill_ms.append((time.perf_counter() - t0) * 1e3)
            # (sequences, drafted tokens each, logits for every row or only the first block): the two
            # kinds of long verification separate a drafted token's layers from its head row.
            configs = [(1, 0, True), (1, 1, True), (1, 2, True), (1, 4, True), (1, kmax, True), (1, kmax, False),
                       (nseq, 0, True), (nseq, 2, True), (nseq, 4, True)]
            if kmax > 2 * HEAD_BLOCK:
                configs.append((1, kmax // 2, False))

            def head_rows(B: int, k: int, full: bool) -> int:
                return B * (k if full else min(k + 1, HEAD_BLOCK) - 1)

            def fwd(B: int, k: int, full: bool) -> None:
                sel = ids[:B]
                out = runner.step(cache, [SeqChunk(s, [ctx[s][-1]] * (1 + k), all_logits=k > 0, hidden_only=k > 0)
                                          for s in sel])
                if k > 0:
                    torch.argmax(runner.head(torch.cat([h if full else h[:HEAD_BLOCK] for h in out])), dim=-1)
                for s in sel:
                    cache.truncate(s, 1 + k)

            if not costs:
                self._change_cost(fwd)
                return
            for c in configs:
                fwd(*c)  # warm
            times: dict[tuple[int, int, bool], list[float]] = {c: [] for c in configs}
            for _ in range(7):  # interleaved rounds: a busy spell of the machine hits every config alike
                for c in configs:
                    t0 = time.perf_counter()
                    fwd(*c)
                    times[c].append((time.perf_counter() - t0) * 1e3)
            self._change_cost(fwd)
            labels = []
            for j, ((B, k, full), ts) in enumerate(times.items()):
                rows, head = padded_drafted(runner.padded_rows, B, B * k), head_rows(B, k, full)
                xs.append(verify_x(B, rows, B if k else 0, 0, head))
                before_c = configs[j - 1]  # each was timed right after the one before it (the first after the last)
                changed = before_c[0] * (1 + before_c[1]) != B * (1 + k)
                ys.append(max(_low(ts) - (self.change_ms if changed else 0.0), 0.5 * _low(ts)))
                labels.append(f"B{B}+{B * k}" + ("" if rows == B * k else f" ({rows} rows)")
                              + ("" if full else f" head {head}"))
            t1 = ys[0]
            prior = [t1, 0.05 * t1, 0.05 * t1, 0.05 * t1, 0.0, 0.05 * t1]
            theta = fit(xs, ys, prior)
            # Prefill tokens: what a prefill step costs beyond an empty step, per token.
            theta[4] = max(0.0, (statistics.median(prefill_ms) - theta[0]) / (ctx_len - 1))
            self.calibration["verify_ms"] = {lb: round(y, 3) for lb, y in zip(labels, ys)}
            self._prior_costs(theta)
            for h in self.handles:
                dx, dy = [], []
                for S, k in [(1, 1), (1, 4), (nseq, 1), (nseq, 4)]:
                    for s in ids[:S]:
                        cache.reserve(s, len(ctx[s]) + k + 1)

                    def draft(S: int = S, k: int = k) -> None:
                        reqs = [DraftRequest(s, ctx[s], k, target_rows=[last_rows[s]]) for s in ids[:S]]
                        if self._run(h, reqs) is None:
                            raise RuntimeError(h.disabled)

                    try:
                        dy.append(timed(draft))
                    except RuntimeError:
                        break
                    dx.append(draft_x(k, S))
                if h.disabled:
                    continue
                for s in ids:
                    self._tell(h, "release", s)
                    cache.truncate(s, 0)
                dtheta = fit(dx, dy, [0.0, dy[0], 0.0, 0.0])
                h.cost = RLS(dtheta, [max(v, 0.05 * dy[0]) ** 2 for v in dtheta])
                h.stats = DrafterStats(failures=h.stats.failures)  # calibration calls are not drafts
                h.probe = h.probe or h.cost.predict(draft_x(kmax, 1)) < 0.02 * t1
                self.calibration[h.name] = {"ms_k1": round(dy[0], 3), "ms_k4": round(dy[1], 3) if len(dy) > 1 else None}
        finally:
            for s in ids:
                cache.free(s)
                for h in self.handles:
                    self._tell(h, "release", s)
            self._load_drafter_states(before)
            if self.controller is None and hasattr(self, "verify_cost"):
                self.controller = self._make_controller()

    def _change_cost(self, fwd: Any) -> None:
        """Measure ``change_ms``, what a step costs beyond its rows when its row count differs from the previous
        step's: a one-row and a five-row step each timed after one of their own shape and after the other,
        interleaved. Below a twentieth of a one-row step it is taken as none (runtimes that build each step's
        work afresh)."""
        one, five = (1, 0, True), (1, 4, True)
        same1: list[float] = []
        after5: list[float] = []
        same5: list[float] = []
        after1: list[float] = []
        fwd(*one)
        for _ in range(5):
            for shape, same, other in ((one, same1, after5), (five, same5, after1)):
                fwd(*shape)
                t0 = time.perf_counter()
                fwd(*shape)
                same.append((time.perf_counter() - t0) * 1e3)
                fwd(*(five if shape is one else one))
                t0 = time.perf_counter()
                fwd(*shape)
                other.append((time.perf_counter() - t0) * 1e3)
        cost = 0.5 * ((_low(after5) - _low(same1)) + (_low(after1) - _low(same5)))
        self.change_ms = cost if cost > 0.05 * _low(same1) else 0.0
        self.calibration["shape_change_ms"] = round(self.change_ms, 3)

    def _make_controller(self) -> Controller:
        return Controller(self.verify_cost, [h.cost for h in self.handles], head_block=HEAD_BLOCK,  # type: ignore[misc]
                          pad=self.runner.padded_rows, change_ms=self.change_ms)

    def _prior_costs(self, theta: list[float] | None) -> None:
        if theta is None:  # no room to measure: a neutral prior, corrected online
            theta = [10.0, 0.5, 0.5, 0.5, 0.1, 0.2]
        self.verify_cost = VerifyCost(theta, [(0.5 * max(v, 0.02 * theta[0])) ** 2 for v in theta])
        for h in self.handles:
            if h.cost is None:
                h.cost = RLS([0.1, 0.1 * theta[0], 0.0, 0.0], [(0.1 * theta[0]) ** 2] * 4)

def _low(ts: list[float]) -> float:
    """The lower quartile: what a call costs when the machine is not busy with something else."""
    ts = sorted(ts)
    return ts[(len(ts) - 1) // 4]
