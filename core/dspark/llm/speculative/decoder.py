"""Speculative decoding inside the engine's continuous batching (DeepSpec).

One engine step with speculation:

1. the scheduler plans the step as usual (decode tokens first, then prefill chunks);
2. for each decode sequence the controller (``strategy: deepspec``) picks a
   drafter and a length k from predicted acceptance and measured costs, or
   the fixed drafter and k (``strategy: fixed``); cheap lookup drafters run
   for everyone first so their real drafts inform the choice; KV room for
   the 1 + k tokens is taken from free pages only (k shrinks, nothing is
   preempted for a draft);
3. drafters run batched (one draft-model forward per draft position for all
   its sequences; the self-drafter's forwards stop at its exit layer);
4. ONE target forward verifies every sequence's [last token + draft] and runs
   the step's prefill chunks;
5. per sequence the verifier keeps what plain decoding would have produced
   (greedy: matching prefix + the target's token; sampling: the rejection
   rule), token by token through the same stop checks (eos, stop strings,
   max_tokens); rejected positions are rolled back in the target's KV cache
   (``truncate``) and the drafter's (``commit``);
6. every verified token trains the acceptance predictor, every timed call the cost model.

Drafters come from the plugin hook ``dspark_drafters``; they run in the
engine's thread. A drafter that raises or returns a malformed draft is logged
(``spec.drafter_failed``), counted, and disabled for the rest of the engine's
life; the step goes on without it.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dspark.llm.call_guard import CallGuard
from dspark.llm.runner.config import SpeculativeConfig
from dspark.llm.runner.model import SeqChunk
from dspark.llm.sampling import distribution
from dspark.llm.scheduler import ScheduledChunk, Sequence, Status
from dspark.llm.speculative.controller import (RLS, Controller, Option, Plan, VerifyCost, draft_x, fit, padded_drafted,
                                        verify_x)
from dspark.llm.speculative.drafters import compatibility_problem, read_raw_config, tokenizer_fingerprint
from dspark.llm.speculative.predictor import PAIR, AcceptancePredictor, along, features
from dspark.llm.speculative.verify import HEAD_BLOCK, accept_greedy_blocks, accept_processed, accept_sampling, clip_to_grammar
from dspark.host.log import get_logger
from dspark.host.plugin_manager import BUILTINS
from dspark.types import Draft, DraftRequest, TargetModel

if TYPE_CHECKING:
    from dspark.llm.engine import LLMEngine, RequestOutput
    from dspark.host.plugin_manager import PluginHost

log = get_logger("dspark.llm.spec")

_KIND_ORDER = {"model": 0, "self": 1, "ngram": 2, "other": 3}
_CONSERVATIVE_K = 2  # cap of conservative mode for long open-ended text
_LONG_OUTPUT = 64  # output tokens after which open-ended text counts as long
_OPEN_ENDED = 0.35  # prompt repetitiveness below which text is open-ended
# A probed draft's token pairs and their learned terms (SpecDecoder._pair_terms).
_PairTerms = tuple[list[tuple[int, int]], list[float]]
# Quiet steps (drafts on offer, none taken; a step counts 1/4 unless the best draft was near break-even)
# before one exploratory draft; the wait doubles after each, up to the maximum.
_EXPLORE_FIRST, _EXPLORE_MAX = 8, 512

_default_host: PluginHost | None = None


def default_host() -> PluginHost:
    """The process's plugin host for drafters, loaded once (built-ins and entry points)."""
    global _default_host
    if _default_host is None:
        from dspark.host.plugin_manager import PluginHost

        _default_host = PluginHost().load()
    return _default_host


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


@dataclass
class _Req:
    """What the controller knows about one request."""

    rep: float  # prompt repetitiveness: share of its 2-grams seen earlier in it
    hist: list[float]  # per drafter, EMA of per-token acceptance
    conf: list[float]  # per drafter, EMA of draft confidence
    run: list[int] = field(default_factory=list)  # per drafter, tokens accepted since its last rejection
    open_ended: bool = False


@dataclass
class _Pending:
    """A sequence's draft for this step, waiting for verification."""

    handle: Handle
    tokens: list[int]
    q: torch.Tensor | None
    # Features of drafted token j (0-based), as they stood when it was drafted. Only the tokens that
    # verification judged (up to the first rejection) are ever featurised and predicted, at learning
    # time and before their outcome is learned: on a long draft, most tokens never are.
    x_of: Callable[[int], list[float]] | None = None
    # (previous token, drafted token) per drafted token, for drafters whose pairs are learned (lookups).
    pairs: list[tuple[int, int]] | None = None


def _last(seq: Sequence) -> int:
    return int((seq.output_ids or seq.prompt_ids)[-1])


def _pairs(last: int, toks: list[int]) -> list[tuple[int, int]]:
    """(previous token, token) for each drafted token; the first follows the context's last token."""
    return list(zip([last, *toks[:-1]], toks))


def _copy_out(dr: Draft, seq: Sequence) -> float:
    """1 when a draft is a copy of the text generated so far, 0 for a copy of the prompt or no copy."""
    return 1.0 if dr.source is not None and dr.source >= len(seq.prompt_ids) else 0.0


def repetitiveness(ids: list[int]) -> float:
    """Share of positions whose 2-gram occurred earlier: ~0.6+ for code and edits, low for open prose."""
    if len(ids) < 3:
        return 0.0
    seen: set[tuple[int, int]] = set()
    hits = 0
    for g in zip(ids, ids[1:]):
        if g in seen:
            hits += 1
        else:
            seen.add(g)
    return hits / (len(ids) - 1)


def _guarded_create(offer: Any, timeout_s: float) -> Any:
    """A third party's ``create()``, which may load a model: 10x the call deadline, at least 30 s."""
    g = CallGuard(f"{offer.name}.create", max(30.0, 10 * timeout_s))
    try:
        return g(offer.create)
    finally:
        g.close()


class SpecDecoder:
    def __init__(self, engine: LLMEngine, cfg: SpeculativeConfig, host: PluginHost | None = None) -> None:
        self.eng = engine
        self.cfg = cfg
        self.strategy = cfg.strategy
        runner = engine.runner
        mcfg = runner.cfg
        self.vocab = mcfg.vocab_size
        root = engine.model_path
        raw = read_raw_config(root)
        if cfg.draft_model not in ("auto", "none"):
            problem = compatibility_problem(root, cfg.draft_model) if (Path(cfg.draft_model) / "config.json").exists() \
                else f"{cfg.draft_model} is not a checkpoint directory (no config.json)"
            if problem:
                raise ValueError(f"speculative_decoding.draft_model: cannot draft for {root.name}: {problem}")
        if isinstance(cfg.exit_layer, int) and cfg.exit_layer >= mcfg.num_hidden_layers:
            raise ValueError(f"speculative_decoding.exit_layer: {cfg.exit_layer} is not below the target's "
                             f"{mcfg.num_hidden_layers} layers")
        target = TargetModel(
            name=root.name, path=str(root), architecture=mcfg.model_type, vocab_size=mcfg.vocab_size,
            num_layers=mcfg.num_hidden_layers, hidden_size=mcfg.hidden_size,
            tokenizer_fingerprint=tokenizer_fingerprint(root),
            properties={"early_exit_layers": list(raw.get("dspark_early_exit_layers", []) or []),
                        "draft_model": cfg.draft_model, "exit_layer": cfg.exit_layer,
                        "dtype": str(runner.dtype).removeprefix("torch."),
                        "max_total_tokens": engine.cache.allocator.num_pages * engine.cache.page_size
                        + engine.config.max_batch_size * (cfg.max_k + 1),
                        "page_size": engine.cache.page_size},
            runtime=engine)
        from dspark.llm.speculative.offers import collect_drafters

        self.host = host if host is not None else default_host()
        offers = collect_drafters(self.host, target)
        if cfg.drafters is not None:
            want = cfg.drafters
            offers = [o for o in offers if o.name in want or o.kind in want or o.name.split(":")[0] in want]
            offers.sort(key=lambda o: min((want.index(w) for w in (o.name, o.kind, o.name.split(":")[0])
                                           if w in want), default=len(want)))
        self.handles: list[Handle] = []
        self.failures = 0
        for o in offers:
            # Built-in drafters run inline; a third party's run on a guarded thread, with a deadline.
            guard = None if o.plugin in BUILTINS else CallGuard(o.name, cfg.drafter_timeout_s)
            try:
                obj = o.create() if guard is None else _guarded_create(o, cfg.drafter_timeout_s)
                if not callable(getattr(obj, "propose", None)) and not callable(getattr(obj, "propose_batch", None)):
                    raise TypeError(f"create() returned {type(obj).__name__}, which has no propose()")
            except Exception as exc:  # the plugin's fault: report it, go on without this drafter
                self.failures += 1
                log.warning("spec.drafter_failed", drafter=o.name, plugin=o.plugin, stage="create",
                            error=f"{type(exc).__name__}: {exc}")
                continue
            self.handles.append(Handle(len(self.handles), o.name, o.kind, o.plugin, obj,
                                       probe=o.kind == "ngram", guard=guard))
        self.predictor = AcceptancePredictor(len(self.handles))
        self.reqs: dict[str, _Req] = {}
        self.exit_chosen = False
        self.fixed: Handle | None = None
        if self.strategy == "fixed" and self.handles:
            self.fixed = self.handles[0] if cfg.drafters else min(self.handles, key=lambda h: _KIND_ORDER[h.kind])
        self.steps = 0
        self.spec_steps = 0
        self.explore_steps = 0
        self._quiet = 0.0
        self._explore_gap = _EXPLORE_FIRST
        # Tokens per ms the engine sustains (an EMA over decode steps, wall time): what a drafted
        # token's time is priced at (Controller.choose).
        self.rate: float | None = None
        self.controller: Controller | None = None
        self.calibration: dict[str, Any] = {}
        if self.strategy == "deepspec" and self.handles:
            self._calibrate()
            if self.controller is None:
                self._prior_costs(None)
                self.controller = self._make_controller()
        log.info("spec.ready", strategy=self.strategy, drafters=[h.name for h in self.handles],
                 fixed=self.fixed.name if self.fixed else None)

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
                h.cost.update(draft_x(max(r.k for r in reqs), len(reqs)), ms)
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

    def release(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        for h in self.handles:
            self._tell(h, "release", rid)

    # -- calibration --------------------------------------------------------
    def _calibrate(self) -> None:
        """Time the target's verify forwards and every drafter on this machine, before serving."""
        eng = self.eng
        cache, runner = eng.cache, eng.runner
        ctx_len, kmax = 48, self.cfg.max_k
        V = self.vocab
        pattern = [3 + (i * 7919) % max(V - 3, 1) for i in range(12)]
        per = cache.pages_for(ctx_len + kmax + 2)
        nseq = max(0, min(4, cache.allocator.num_free // per))
        if nseq == 0:
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
            for s in ids:
                t0 = time.perf_counter()
                runner.step(cache, [SeqChunk(s, ctx[s][:-1])])
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

            for c in configs:
                fwd(*c)  # warm
            times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
            for _ in range(7):  # interleaved rounds: a busy spell of the machine hits every config alike
                for c in configs:
                    t0 = time.perf_counter()
                    fwd(*c)
                    times[c].append((time.perf_counter() - t0) * 1e3)
            labels = []
            for (B, k, full), ts in times.items():
                rows, head = padded_drafted(runner.padded_rows, B, B * k), head_rows(B, k, full)
                xs.append(verify_x(B, rows, B if k else 0, 0, head))
                ys.append(_low(ts))
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
                        if self._run(h, [DraftRequest(s, ctx[s], k) for s in ids[:S]]) is None:
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

    def _make_controller(self) -> Controller:
        return Controller(self.verify_cost, [h.cost for h in self.handles], head_block=HEAD_BLOCK,  # type: ignore[misc]
                          pad=self.eng.runner.padded_rows)

    def _prior_costs(self, theta: list[float] | None) -> None:
        if theta is None:  # no room to measure: a neutral prior, corrected online
            theta = [10.0, 0.5, 0.5, 0.5, 0.1, 0.2]
        self.verify_cost = VerifyCost(theta, [(0.5 * max(v, 0.02 * theta[0])) ** 2 for v in theta])
        for h in self.handles:
            if h.cost is None:
                h.cost = RLS([0.1, 0.1 * theta[0], 0.0, 0.0], [(0.1 * theta[0]) ** 2] * 4)

    # -- one step -----------------------------------------------------------
    def _req(self, seq: Sequence) -> _Req:
        st = self.reqs.get(seq.request_id)
        if st is None:
            rep = repetitiveness(seq.prompt_ids[-512:])
            n = len(self.handles)
            st = _Req(rep, list(self.predictor.mean), [0.5] * n, [0] * n, open_ended=rep < _OPEN_ENDED)
            self.reqs[seq.request_id] = st
        return st

    def _cap(self, seq: Sequence) -> int:
        """Most tokens worth drafting: room left by max_tokens and max_model_len, the conservative cap."""
        p = seq.params
        n_all = len(seq.prompt_ids) + len(seq.output_ids)
        k = self.cfg.num_speculative_tokens if self.strategy == "fixed" else self.cfg.max_k
        k = min(k, p.max_tokens - len(seq.output_ids) - 1, self.eng.max_model_len - n_all - 1)
        if self.cfg.conservative and self.strategy == "deepspec":
            st = self.reqs.get(seq.request_id)
            if (st is not None and st.open_ended and len(seq.output_ids) >= _LONG_OUTPUT) \
                    or n_all >= 0.75 * self.eng.max_model_len:
                k = min(k, _CONSERVATIVE_K)
        return max(k, 0)

    def step(self, planned: list[ScheduledChunk], t_start: float) -> list[RequestOutput]:
        eng = self.eng
        self.steps += 1
        dec = [p for p in planned if p.num_tokens == 1 and p.completes]
        prefill_tokens = sum(p.num_tokens for p in planned) - len(dec)
        pend: dict[str, _Pending] = {}
        if dec and any(h.disabled is None for h in self.handles):
            pend = self._draft(dec, prefill_tokens)
        clip_to_grammar(dec, pend)
        chunks = []
        n_drafted = 0
        greedy: list[int] = []  # chunks verified greedily: their logits are computed block by block
        for p in planned:
            s = p.seq
            ids = s.all_ids[s.num_computed:s.num_computed + p.num_tokens]
            d = pend.get(s.request_id)
            if d is not None and d.tokens:
                lazy = s.params.greedy and s.plain  # processed rows and logprobs need every row's logits
                if lazy:
                    greedy.append(len(chunks))
                chunks.append(SeqChunk(s.request_id, ids + d.tokens, all_logits=True, hidden_only=lazy))
                n_drafted += len(d.tokens)
            else:
                chunks.append(SeqChunk(s.request_id, ids, all_logits=eng._wants_prompt_lp(s)))
        t0 = time.perf_counter()
        logits = eng.runner.step(eng.cache, chunks)
        verdict: dict[int, tuple[list[int], int, int]] = {}
        n_head = n_drafted
        if greedy:
            got = accept_greedy_blocks([pend[chunks[i].seq_id].tokens for i in greedy], [logits[i] for i in greedy],
                                       eng.runner.head)
            verdict = dict(zip(greedy, got))
            n_head -= sum(len(chunks[i].token_ids) - rows for i, (_, _, rows) in verdict.items())
        fwd_ms = (time.perf_counter() - t0) * 1e3
        if self.controller is not None:
            n_rows = padded_drafted(eng.runner.padded_rows, len(dec) + prefill_tokens, n_drafted)
            x = verify_x(len(dec), n_rows, sum(1 for d in pend.values() if d.tokens), prefill_tokens, n_head)
            if prefill_tokens:
                self.verify_cost.update_prefill(x, fwd_ms)
            else:
                self.verify_cost.update(x, fwd_ms)
        outputs = []
        used: set[int] = set()
        n_before = sum(len(p.seq.output_ids) for p in dec)
        for ci, (p, lg) in enumerate(zip(planned, logits)):
            seq = p.seq
            rid = seq.request_id
            d = pend.get(rid)
            if d is None or not d.tokens:
                if chunks[ci].all_logits:
                    lg = eng._prompt_logprobs(seq, lg)
                completes = p.completes
                seq.num_computed += p.num_tokens
                if not completes:
                    continue
                tok = eng._sample(seq, lg)
                seq.output_ids.append(tok)
                eng._check_stop(seq, tok)
                if d is not None and seq.status is not Status.FINISHED:
                    eng.cache.truncate(rid, 0)  # pages taken for a draft that did not come
            else:
                used.add(d.handle.idx)
                k = len(d.tokens)
                gen = seq.generator or eng._default_gen
                lps = None
                if ci in verdict:
                    toks, n_acc, _ = verdict[ci]
                elif seq.plain:
                    toks, n_acc = accept_sampling(d.tokens, d.q, distribution(lg, seq.params), gen)
                else:
                    toks, n_acc, lps = accept_processed(seq, d.tokens, d.q, lg, eng.eos_ids, gen)
                seq.num_computed += 1 + n_acc
                per_token = bool(seq.params.stop)  # stop strings need the text after every token
                for i, t in enumerate(toks):
                    seq.output_ids.append(t)
                    if lps is not None:
                        seq.logprobs.append(lps[i])
                    eng._check_stop(seq, t, decode=per_token)
                    if seq.status is Status.FINISHED:
                        break
                if not per_token:
                    eng._set_text(seq, seq.finish_reason == "stop")
                if seq.status is not Status.FINISHED:
                    eng.cache.truncate(rid, k - n_acc)
                    self._tell(d.handle, "commit", rid, seq.num_computed)
                self._learn(seq, d, n_acc)
            outputs.append(eng._output(seq))
            if seq.status is Status.FINISHED:
                del eng._seqs[rid]
                self.release(rid)
        for i in used:
            self.handles[i].stats.steps += 1
        if used:
            self.spec_steps += 1
        step_ms = (time.perf_counter() - t_start) * 1e3
        if self.controller is not None and dec and not prefill_tokens:
            r = (sum(len(p.seq.output_ids) for p in dec) - n_before) / max(step_ms, 1e-6)
            self.rate = r if self.rate is None else self.rate + 0.05 * (r - self.rate)
        eng.scheduler.record_step(step_ms)
        return outputs

    def _learn(self, seq: Sequence, d: _Pending, n_acc: int) -> None:
        h = d.handle
        k = len(d.tokens)
        h.stats.drafts += 1
        h.stats.draft_tokens += k
        h.stats.accepted_tokens += n_acc
        seen = min(n_acc + 1, k)  # tokens after the first rejection were never judged
        assert d.x_of is not None
        pred = self.predictor
        for j in range(seen):
            x = d.x_of(j)
            pred.observe(h.idx, x, pred.predict(h.idx, x), j < n_acc, d.pairs[j] if d.pairs else None)
        st = self.reqs.get(seq.request_id)
        if st is not None:
            st.hist[h.idx] += 0.3 * (n_acc / seen - st.hist[h.idx])
            st.run[h.idx] = st.run[h.idx] + n_acc if n_acc == k else 0

    # -- drafting -----------------------------------------------------------
    def _draft(self, dec: list[ScheduledChunk], prefill_tokens: int) -> dict[str, _Pending]:
        eng = self.eng
        cache = eng.cache
        seqs = [p.seq for p in dec]
        caps = [self._cap(s) for s in seqs]
        if not any(caps):
            return {}
        sts = [self._req(s) for s in seqs]
        live = [h for h in self.handles if h.disabled is None]
        if not self.exit_chosen:
            self._choose_exit(seqs)
        ctxs = [s.all_ids for s in seqs]
        gens = [s.generator or eng._default_gen for s in seqs]
        temps = [0.0 if s.params.greedy else s.params.temperature for s in seqs]

        def request(i: int, k: int, keep: Any = None) -> DraftRequest:
            return DraftRequest(seqs[i].request_id, ctxs[i], k, temps[i], gens[i], keep)

        if self.strategy == "fixed":
            h = self.fixed
            if h is None or h.disabled:
                return {}
            chosen: list[tuple[Handle | None, int]] = [(h, c) for c in caps]
            probed: dict[int, list[Draft]] = {}
            terms: dict[tuple[int, int], _PairTerms] = {}
        else:
            # Lookup-style drafters are nearly free: draft with them for everyone, then decide.
            probed = {}
            sunk_ms = 0.0
            t0 = time.perf_counter()
            for h in live:
                if h.probe:
                    got = self._run(h, [request(i, c) for i, c in enumerate(caps)])
                    if got is not None:
                        probed[h.idx] = got
            sunk_ms = (time.perf_counter() - t0) * 1e3
            live = [h for h in live if h.disabled is None]  # a probe may have failed
            # Each probed draft's token pairs and their learned terms, once: the choice and the
            # learning both use them.
            terms = {(hi, i): t for hi, drafts in probed.items() for i, dr in enumerate(drafts)
                     if (t := self._pair_terms(seqs[i], self.handles[hi], dr.tokens[:caps[i]])) is not None}
            chosen = self._decide(seqs, sts, caps, live, probed, terms, prefill_tokens, sunk_ms)
        # KV room for 1 + k tokens, from free pages only.
        ks = []
        for s, (h, k) in zip(seqs, chosen):
            while k > 0 and not cache.can_grow(s.request_id, s.num_computed + 1 + k):
                k -= 1
            if k > 0:
                cache.reserve(s.request_id, s.num_computed + 1 + k)
            ks.append(k)
        pend: dict[str, _Pending] = {}
        groups: dict[int, list[int]] = {}
        for i, ((h, _), k) in enumerate(zip(chosen, ks)):
            if h is None or k <= 0:
                continue
            if h.idx in probed:
                self._pending(pend, i, seqs[i], sts[i], h, probed[h.idx][i], k, terms.get((h.idx, i)))
            else:
                groups.setdefault(h.idx, []).append(i)
        for hi, members in groups.items():
            h = self.handles[hi]
            if h.disabled:
                continue
            keep = self._keep_going if self.strategy == "deepspec" else None
            reqs = [request(i, ks[i], None if keep is None else keep(seqs[i], sts[i], h)) for i in members]
            got = self._run(h, reqs)
            if got is None:
                continue
            for i, dr in zip(members, got):
                self._pending(pend, i, seqs[i], sts[i], h, dr, ks[i])
        for i, k in enumerate(ks):  # reserved pages are given back after verification even if nothing came
            rid = seqs[i].request_id
            h_i = chosen[i][0]
            if k > 0 and rid not in pend and h_i is not None:
                pend[rid] = _Pending(h_i, [], None)
        return pend

    def _pair_terms(self, seq: Sequence, h: Handle, toks: list[int]) -> _PairTerms | None:
        """A draft's token pairs and their learned terms as they stand now (None: pairs are not learned
        for this drafter, whose drafts are not known before the choice)."""
        if not (h.probe and toks):
            return None
        pairs = _pairs(_last(seq), toks)
        return pairs, [self.predictor.pair(h.idx, a, b) for a, b in pairs]

    def _pending(self, pend: dict[str, _Pending], i: int, seq: Sequence, st: _Req, h: Handle, dr: Draft,
                 k: int, terms: _PairTerms | None = None) -> None:
        """``terms``: the draft's pair terms from the choice (``_pair_terms``), if it computed them."""
        toks = list(dr.tokens[:k])
        q = None
        if dr.probs is not None and toks:
            q = torch.as_tensor(np.asarray(dr.probs)[: len(toks)], dtype=torch.float32)
        if q is not None and seq.params.greedy:
            q = None
        conf = list(dr.confidence[: len(toks)]) if dr.confidence is not None else None
        ctx_len = len(seq.prompt_ids) + len(seq.output_ids)
        args = (st.hist[h.idx], st.rep, ctx_len, st.run[h.idx], _copy_out(dr, seq))
        mean_c = st.conf[h.idx]
        # The pairs' terms as they stood when the draft was chosen (the table learns before x_of runs).
        if terms is None:
            terms = self._pair_terms(seq, h, toks)
        pairs, pv = (terms[0][:len(toks)], terms[1][:len(toks)]) if terms is not None else (None, None)

        def x_of(j: int) -> list[float]:
            hist, rep, n_ctx, run, c_out = args
            return features(conf[j] if conf is not None else mean_c, hist, j + 1, rep, n_ctx, run, c_out,
                            pv[j] if pv else 0.0)

        if conf:
            st.conf[h.idx] += 0.2 * (sum(conf) / len(conf) - st.conf[h.idx])
        pend[seq.request_id] = _Pending(h, toks, q, x_of, pairs)

    def _keep_going(self, seq: Sequence, st: _Req, h: Handle) -> Any:
        """Early stop inside a drafter: continue while the next token's expected gain pays its time."""
        ctx_len = len(seq.prompt_ids) + len(seq.output_ids)
        plan = self._plan
        thresh = plan.rate * plan.marginal.get(h.idx, 0.0) if plan is not None else 0.0
        state = [1.0]

        def keep(j: int, conf: float) -> bool:
            a = self.predictor.predict(h.idx, features(conf, st.hist[h.idx], j, st.rep, ctx_len, st.run[h.idx]))
            state[0] *= a
            return state[0] * a >= thresh

        return keep

    _plan: Plan | None = None

    def _decide(self, seqs: list[Sequence], sts: list[_Req], caps: list[int], live: list[Handle],
                probed: dict[int, list[Draft]], terms: dict[tuple[int, int], _PairTerms],
                prefill_tokens: int, sunk_ms: float) -> list[tuple[Handle | None, int]]:
        assert self.controller is not None
        pred = self.predictor
        options: list[list[Option]] = []
        for i, (s, st, cap) in enumerate(zip(seqs, sts, caps)):
            opts = []
            if cap > 0:
                ctx_len = len(s.prompt_ids) + len(s.output_ids)
                for h in live:
                    c_out = 0.0
                    w = pred.models[h.idx].w
                    extra = None
                    if h.idx in probed:
                        dr = probed[h.idx][i]
                        n = min(len(dr.tokens), cap)
                        if n == 0:
                            continue
                        c = dr.confidence[0] if dr.confidence else st.conf[h.idx]
                        c_out = _copy_out(dr, s)
                        t = terms.get((h.idx, i))
                        if t is not None:  # the draft is known token by token: its pairs' terms too
                            wp = w[PAIR]
                            extra = [wp * v for v in t[1][:n]]
                    else:
                        n, c = cap, st.conf[h.idx]
                    x = features(c, st.hist[h.idx], 1, st.rep, ctx_len, st.run[h.idx], c_out)
                    dz, dlog = along(w)  # the position terms change along the draft, and the pairs'
                    opts.append(Option(h.idx, None, sunk=h.idx in probed, n=n,
                                       z0=sum(wi * xi for wi, xi in zip(w, x)), dz=dz, dlog=dlog, extra=extra))
                    # Unused drafters' histories drift back to the overall mean: a bad streak is not forever.
                    st.hist[h.idx] += 0.05 * (pred.mean[h.idx] - st.hist[h.idx])
            options.append(opts)
        plan = self.controller.choose(options, prefill_tokens, sunk_ms, rate=self.rate)
        self._plan = plan
        out = [(None if c.drafter is None else self.handles[c.drafter], c.k) for c in plan.choices]
        if any(options) and not any(k for _, k in out):
            # The cost model only learns what drafting costs from steps that draft: when it has kept
            # speculation off for a while, draft once, short, with the most promising option; soon
            # when that option is predicted to lose little (the estimate may be what is wrong).
            # Each exploration that changes nothing doubles the wait before the next.
            # Before any draft at all the whole cost model is the startup calibration's: check it soon.
            near = plan.best_margin > -0.25 or self.spec_steps == 0
            self._quiet += 1.0 if near else 0.25
            if self._quiet >= self._explore_gap:
                self._quiet = 0
                self._explore_gap = min(2 * self._explore_gap, _EXPLORE_MAX)
                self.explore_steps += 1
                i, o = max(((i, o) for i, opts in enumerate(options) for o in opts), key=lambda io: io[1].acc(0))
                out[i] = (self.handles[o.drafter], min(2, o.n))
        else:
            self._quiet = 0
            if any(k for _, k in out):
                self._explore_gap = _EXPLORE_FIRST
        return out

    def _choose_exit(self, seqs: list[Sequence]) -> None:
        """Self-drafting's exit layer, by measurement on the first real context long enough."""
        from dspark.llm.speculative.drafters import SelfDrafter

        for h in self.handles:
            obj = h.obj
            if not isinstance(obj, SelfDrafter) or h.disabled:
                continue
            if len(obj.candidates) < 2:
                self.exit_chosen = True
                return
            ctx = max((s.all_ids for s in seqs), key=len)
            if len(ctx) < 16:
                return  # wait for a longer context
            old = obj.exit_layer
            try:
                new = obj.choose_exit_layer(ctx)
            except Exception as exc:
                self._disable(h, f"choose_exit_layer raised {type(exc).__name__}: {exc}")
                return
            if h.cost is not None and new != old and old in obj.measured and new in obj.measured:
                f = obj.measured[new]["relative_cost"] / max(obj.measured[old]["relative_cost"], 1e-9)
                h.cost.theta = [t * f for t in h.cost.theta]
            self.calibration["self_exit_layer"] = {"chosen": new, **{str(e): m for e, m in obj.measured.items()}}
            log.info("spec.exit_layer", chosen=new, measured=obj.measured)
        self.exit_chosen = True

    # -- learned state --------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A copy of what DeepSpec has learned online: the acceptance predictor (with its pair tables
        and calibration) and the verify and drafting cost models. For ``restore``: a benchmark that
        times the same requests several times restores it before each pass, so no pass is measured
        on requests DeepSpec has already learned from."""
        snap = copy.deepcopy({"predictor": self.predictor, "verify_cost": getattr(self, "verify_cost", None),
                              "draft_costs": [h.cost for h in self.handles], "rate": self.rate})
        snap["drafters"] = self._drafter_states()
        return snap

    def restore(self, snap: dict[str, Any]) -> None:
        drafters = snap["drafters"]  # their own restore copies what it keeps
        snap = copy.deepcopy({k: v for k, v in snap.items() if k != "drafters"})  # the snapshot stays as it was
        self.predictor = snap["predictor"]
        if snap["verify_cost"] is not None:
            self.verify_cost = snap["verify_cost"]
        for h, c in zip(self.handles, snap["draft_costs"]):
            h.cost = c
        self.rate = snap["rate"]
        self._load_drafter_states(drafters)
        if self.controller is not None:
            self.controller = self._make_controller()

    def _drafter_states(self) -> dict[int, Any]:
        """What built-in drafters learn across requests (suffix-lookup's store), by handle."""
        return {h.idx: h.obj.snapshot() for h in self.handles if _stateful(h)}

    def _load_drafter_states(self, states: dict[int, Any]) -> None:
        for h in self.handles:
            if h.idx in states and _stateful(h):
                h.obj.restore(states[h.idx])

    # -- reporting ----------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        drafts = sum(h.stats.drafts for h in self.handles)
        dt = sum(h.stats.draft_tokens for h in self.handles)
        acc = sum(h.stats.accepted_tokens for h in self.handles)
        return {
            "spec_strategy": self.strategy,
            "spec_drafts": drafts, "spec_draft_tokens": dt, "spec_accepted_tokens": acc,
            "spec_acceptance_rate": acc / dt if dt else 0.0,
            "spec_mean_accepted_length": acc / drafts if drafts else 0.0,
            "spec_drafter_failures": self.failures,
            "spec_explore_steps": self.explore_steps,
            "spec_calibration_error": self.predictor.total.error(),
            "spec_drafters": {h.name: {**h.stats.as_dict(), "kind": h.kind, "plugin": h.plugin,
                                       "disabled": h.disabled,
                                       "calibration_error": self.predictor.calib[h.idx].error()}
                              for h in self.handles},
        }

    def calibration_table(self) -> list[dict[str, float]]:
        return self.predictor.total.table()


def _stateful(h: Handle) -> bool:
    """A built-in drafter whose learned state ``snapshot``/``restore`` cover (a third party's is its own)."""
    return h.plugin in BUILTINS and callable(getattr(h.obj, "snapshot", None)) \
        and callable(getattr(h.obj, "restore", None))


def _low(ts: list[float]) -> float:
    """The lower quartile: what a call costs when the machine is not busy with something else."""
    ts = sorted(ts)
    return ts[(len(ts) - 1) // 4]
