"""Speculative decoding inside the engine's continuous batching (DeepSpec): proposer, verifier, learner.

The engine runs one step loop; with speculation on, a step goes:

1. the scheduler plans the step as usual (decode tokens first, then prefill chunks);
2. the engine hands the plan to :meth:`SpecDecoder.propose` (the proposer, ``proposer.py``):
   drafts for the decode sequences, with KV room for them taken from free pages;
3. :meth:`SpecDecoder.chunk` extends each drafted sequence's chunk with its draft, and ONE
   target forward, run by the engine, verifies every draft and runs the step's prefill chunks;
4. :meth:`SpecDecoder.verify` times the forward for the cost model and judges the greedy drafts
   block by block; per sequence :meth:`SpecDecoder.accept` gives the tokens plain decoding would have
   produced (greedy: matching prefix + the target's token; sampling: the rejection rule);
5. the engine appends those tokens through its stop checks (eos, stop strings, max_tokens), rolls
   the rejected positions back in the target's KV cache and emits the outputs;
6. :meth:`SpecDecoder.settle` rolls the drafter back (``commit``) and trains the acceptance
   predictor (the learner, ``learner.py``), and :meth:`SpecDecoder.end_step` the cost model's rate.

Drafters come from the plugin hook ``dspark_drafters`` of the engine's plugin host; they run in
the engine's thread (``handles.py``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.builtin.prompt_lookup import PromptLookupDrafter
from dspark.builtin.suffix import SuffixDrafter
from dspark.host import progress
from dspark.host.plugin_manager import PluginHost
from dspark.llm.speculative.call_guard import CallGuard
from dspark.llm.config import SpeculativeConfig
from dspark.llm.logits import TokenLogprobs
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.runner.model import ModelRunner
from dspark.llm.runner.types import SeqChunk
from dspark.llm.sampling import distribution
from dspark.llm.scheduler import ScheduledChunk, Sequence
from dspark.llm.speculative.calibrate import Calibration
from dspark.llm.speculative.controller import Controller, padded_drafted, verify_x
from dspark.llm.speculative.drafters import (
    compatibility_problem,
    read_raw_config,
    tokenizer_fingerprint,
)
from dspark.llm.speculative.handles import Handle, guarded_create, log
from dspark.llm.speculative.learner import Learner
from dspark.llm.speculative.offers import TargetRuntime, collect_drafters
from dspark.llm.speculative.predictor import AcceptancePredictor
from dspark.llm.speculative.proposer import (
    _EXPLORE_FIRST,
    _KIND_ORDER,
    Proposal,
    Proposer,
    ReqState,
    repetitiveness,
)
from dspark.llm.speculative.runs.pays import MIN_SEQS, Yields
from dspark.llm.speculative.runs.replay import Replay
from dspark.llm.speculative.verify import (
    accept_greedy_blocks,
    accept_processed,
    accept_sampling,
)
from dspark.types import DraftRequest, TargetModel

__all__ = ["Proposal", "SpecDecoder", "Verdict", "repetitiveness"]


IDLE_STEPS = 2  # proposals in a row without a draft before plain stretches run as greedy runs (run_steps)
# A lone greedy request's stretches (lone_plan): every 8th is a proposal, the gap doubling up to 64 while
# no model drafter's draft holds in them.
PROPOSE_EVERY, PROPOSE_MAX = 8, 64


def _rows_wanted(drafter: Any) -> int:
    """How many of the context's last target rows a drafter reads (its ``target_rows``, API 1.9)."""
    n = getattr(drafter, "target_rows", 0)
    return n if isinstance(n, int) and n > 0 else 0


@dataclass(frozen=True)
class Verdict:
    """A drafted sequence's verification: what plain decoding would have produced this step."""

    tokens: list[int]  # to append, in order (the accepted draft tokens, then the target's own)
    accepted: int  # draft tokens accepted
    rejected: int  # draft tokens rejected: their KV rows are rolled back
    logprobs: list[TokenLogprobs] | None = None  # raw logprobs of ``tokens`` when the request wants them


class SpecDecoder(Proposer, Learner, Calibration):
    """An engine's speculative decoder. It never appends tokens, checks stops or emits outputs: the
    engine does, with what :meth:`accept` returns."""

    def __init__(self, cfg: SpeculativeConfig, *, runner: ModelRunner, cache: PagedKVCache, model_path: Path,
                 max_model_len: int, max_batch_size: int, eos_ids: set[int], default_gen: torch.Generator,
                 host: PluginHost, place_decoder: Callable[[Any, Path, int], tuple[Any, Any]] | None = None
                 ) -> None:
        """``host``: the engine's plugin host, whose ``dspark_drafters`` offers are used; ``place_decoder``:
        how the engine places another model's decoder (a draft model's), handed to drafters with the
        runner and cache as ``TargetModel.runtime`` (:class:`.offers.TargetRuntime`)."""
        self.cfg = cfg
        self.strategy = cfg.strategy
        self.runner, self.cache = runner, cache
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.default_gen = default_gen
        mcfg = runner.cfg
        self.vocab = mcfg.vocab_size
        root = model_path
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
                        "draft_model": cfg.draft_model, "draft_head": cfg.draft_head, "exit_layer": cfg.exit_layer,
                        "dtype": str(runner.dtype).removeprefix("torch."),
                        "max_total_tokens": cache.allocator.num_pages * cache.page_size
                        + max_batch_size * (cfg.max_k + 1),
                        "page_size": cache.page_size,
                        # a compiled decoder that runs no early exit (a whole-model runtime) gets no self-draft
                        "runs_early_exit": getattr(getattr(runner, "current", None), "exit_layers", True)},
            runtime=TargetRuntime(runner, cache, place_decoder))

        self.host = host
        progress.step("preparing the drafters")
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
            guard = None if self.host.is_builtin(o.plugin) else CallGuard(o.name, cfg.drafter_timeout_s)
            try:
                obj = o.create() if guard is None else guarded_create(o, cfg.drafter_timeout_s)
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
        # Per request, the target's rows at its context's last positions, as many as a drafter reads
        # (DraftRequest.target_rows, API 1.9): references to the steps' outputs, no copies.
        self.rows_wanted = max([_rows_wanted(h.obj) for h in self.handles] or [0])
        self.rows: dict[str, deque[torch.Tensor]] = {}
        self.reqs: dict[str, ReqState] = {}
        self.exit_chosen = False
        self.fixed: Handle | None = None
        if self.strategy == "fixed" and self.handles:
            self.fixed = self.handles[0] if cfg.drafters else min(self.handles, key=lambda h: _KIND_ORDER[h.kind])
        self.prev_rows: int | None = None
        self.steps = 0
        self.spec_steps = 0
        self.explore_steps = 0
        self._quiet = 0.0
        self._explore_gap = _EXPLORE_FIRST
        self.idle = 0  # decode-only proposals in a row that drafted nothing (Learner.end_step)
        self._ran = False  # the last engine step was a greedy run: the next one proposes
        self.yields = Yields()  # tokens per ms of proposal steps and of greedy runs, by batch size (run_steps)
        # Copy runs (lone_plan, copy_run). The built-in lookups a replay follows: prompt lookup first (no
        # copy runs without it), then suffix lookup; each lone request's replay and its lookups by index;
        # a lone sequence's step time by its rows, measured; stretches decided; whether a model
        # drafter's last draft held.
        prompt = [h for h in self.handles if isinstance(h.obj, PromptLookupDrafter)][:1]
        self._lookups = prompt + [h for h in self.handles if isinstance(h.obj, SuffixDrafter)] if prompt else []
        self._replays: dict[str, Replay] = {}
        self._replay_lookups: dict[str, list[Handle]] = {}
        self._step_times: dict[int, float] = {}
        self._stretches = 0
        self._propose_gap = PROPOSE_EVERY
        self._proposed = False
        self._model_held = False
        self.copy_runs = 0
        # Tokens per ms the engine sustains (an EMA over decode steps, wall time): what a drafted
        # token's time is priced at (Controller.choose).
        self.rate: float | None = None
        self.controller: Controller | None = None
        self.calibration: dict[str, Any] = {}
        if self.strategy == "fixed" and self.fixed is not None:
            progress.step("timing a change of the step's shape")
            self._calibrate(costs=False)
        if self.strategy == "deepspec" and self.handles:
            progress.step("timing verification and drafters (DeepSpec's cost models)")
            self._calibrate()
            if self.controller is None:
                self._prior_costs(None)
                self.controller = self._make_controller()
        log.info("spec.ready", strategy=self.strategy, drafters=[h.name for h in self.handles],
                 fixed=self.fixed.name if self.fixed else None)

    def release(self, rid: str, ids: list[int] | None = None) -> None:
        """Forget a finished or aborted request, here and in every drafter; ``ids``, its prompt and outputs, are
        shown to the lookups a replay follows first (suffix lookup stores the text it was last asked about,
        and runs of steps do not ask it)."""
        if ids is not None and rid in self._replays:
            for h in self._replay_lookups.get(rid, [])[1:]:
                self._tell(h, "propose_batch", [DraftRequest(rid, ids, 0)])  # not a draft: no stats, no cost
        self.reqs.pop(rid, None)
        self.rows.pop(rid, None)
        self._replays.pop(rid, None)
        self._replay_lookups.pop(rid, None)
        for h in self.handles:
            self._tell(h, "release", rid)

    def run_steps(self, seqs: int = 0) -> int:
        """Plain decode steps the engine takes now instead of a speculative step, in greedy runs where it can (0:
        propose). Once ``IDLE_STEPS`` proposals in a row drafted nothing, DeepSpec lets plain stretches run
        as greedy runs (docs/decoders.md) of 2, 4, 8, ... steps, proposing once between runs: a stretch
        with nothing to draft pays the proposal's host time once per run, not once per token, and a
        draft taken ends the runs. So too while its proposals yield fewer tokens per ms than runs at the
        batch's size (``runs.pays``). Where no run can go (a request waiting, a decoder without runs), the
        engine takes those steps one at a time. Not before DeepSpec has drafted, or proposed as many times as
        its first exploration waits for (that exploration checks the startup calibration's cost model), nor
        while a drafter reads the target's rows (a run produces none)."""
        if self.strategy != "deepspec" or self.rows_wanted or (not self.spec_steps and self.steps <= _EXPLORE_FIRST):
            return 0
        if self.owes_plain(seqs):
            return self.yields.owed
        if self._ran:
            return 0
        if self.idle >= IDLE_STEPS:
            return 2 ** min(self.idle - IDLE_STEPS + 1, 5)
        return self.yields.explore()

    def owes_plain(self, seqs: int) -> bool:
        """Whether a step of ``seqs`` decoding sequences owes plain steps to proposals that yielded less than
        plain decoding (``runs.pays``; a lone sequence goes its own way): they run as long as the engine's runs
        go, not a stretch's length."""
        return self.yields.owed > 0 and seqs >= MIN_SEQS

    def stepped_plain(self, seqs: int, tokens: int, step_ms: float) -> None:
        """The engine took a plain step where ``run_steps`` asked for plain steps and no run could go: one of
        those owed, what it yielded (``tokens`` of a decode-only step of ``seqs`` sequences in ``step_ms``), and
        the next step may propose."""
        self._ran = True
        self.yields.plain_step(seqs, tokens, step_ms)

    def lone_plan(self, planned: list[ScheduledChunk], budget_ms: float,
                  run_ms: float | None = None) -> tuple[int, int, int] | None:
        """How a lone plain greedy decode goes on now (docs/decoders.md, "Copy runs"): (lookup, k, n), a copy run
        of n steps of k tokens drafted by that lookup (``copy_run``; k 0: a greedy run of n steps); None, a
        proposal as usual. The request's text is replayed (``runs.replay``) and the way that would have cost
        least over it is taken, at the steps' measured times; n steps fit in ``budget_ms`` (a stretch:
        ``stretch_ms``, at most ``EngineConfig.decode_run_ms``; 0: no runs; the engine caps n). A greedy
        stretch chosen while every copy way trails plain steps clearly runs longer, up to ``Replay.grow``
        stretches and at most ``run_ms`` (a greedy run's own budget). A proposal lets DeepSpec's other
        drafters show every ``PROPOSE_EVERY``th stretch, the gap doubling (to ``PROPOSE_MAX``) after each
        in which no model drafter's draft held, and again right after one that held."""
        lookups = [h for h in self._lookups if h.disabled is None]
        if self.strategy != "deepspec" or not lookups or lookups[0] is not self._lookups[0] or len(planned) != 1 \
                or self.rows_wanted or budget_ms <= 0:
            return None
        p = planned[0]
        s = p.seq
        if not (p.num_tokens == 1 and p.completes and s.plain and s.params.greedy
                and s.params.prompt_logprobs is None):
            return None
        rep = self._replays.get(s.request_id)
        if rep is None:
            first = lookups[0].obj
            rep = self._replays[s.request_id] = Replay(
                s.prompt_ids, first.min_ngram, first.max_ngram,
                [lambda ids, k, d=h.obj: list(d.propose(ids, k).tokens) for h in lookups[1:]])
            self._replay_lookups[s.request_id] = lookups
        rep.catch_up(s.all_ids)
        if self._model_held:  # a model drafter's draft held: propose again, and soon after
            self._model_held, self._proposed, self._propose_gap = False, False, PROPOSE_EVERY
            return None
        if self._proposed:  # the last proposal's model drafts did not hold (or none came): wait longer
            self._proposed = False
            self._propose_gap = min(2 * self._propose_gap, PROPOSE_MAX)
        self._stretches += 1
        if self._stretches >= self._propose_gap:
            self._stretches, self._proposed = 0, True
            return None
        way = rep.choose(self._step_ms, self.change_ms)
        src, k = (0, 0) if way is None else way  # too little replayed: plain steps are the cheapest way to more
        if k == 0 and way is not None:
            budget_ms = min(budget_ms * rep.grow, max(budget_ms, run_ms or 0.0))
        return src, k, max(1, int(budget_ms / self._step_ms(1 + k)))

    def _step_ms(self, rows: int) -> float:
        """A step of one sequence of ``rows`` rows: as measured (copy runs; greedy runs for one row), else the
        verify cost model's (calibrated at startup) ratio to a one-row step, times a measured one-row step."""
        got = self._step_times.get(rows)
        if got is not None:
            return got
        one = self.verify_cost.predict(verify_x(1, 0, 0, 0))
        if rows == 1 or one <= 0:
            return max(one, 1e-3)
        model = self.verify_cost.predict(verify_x(1, rows - 1, 1, 0))
        return self._step_times.get(1, one) * model / one

    def copy_run(self, seq: Sequence, src: int, k: int, steps: int, left: int,
                 stops: frozenset[int]) -> tuple[list[int], int]:
        """Up to ``steps`` verification steps of ``seq``, each drafted by lookup ``src`` of its replay alone
        and padded to ``k`` drafted tokens (one shape all through), judged greedily, the rejected rows rolled
        back. Ends early at a token of ``stops``, or where fewer than ``k`` tokens are left to draft before
        ``left`` are out (the shape would change). Returns the tokens plain greedy decoding would have
        produced, in order (the engine appends them through its stop checks), and the steps run."""
        rid, cache = seq.request_id, self.cache
        h = self._replay_lookups[rid][src]
        ctx = list(seq.all_ids)
        n = seq.num_computed
        k = min(k, self._cap(seq))
        out: list[int] = []
        done = 0
        t_second = time.perf_counter()
        while done < steps and k > 0:
            if left - len(out) - 1 < k or not cache.can_grow(rid, n + 1 + k):
                break
            got = self._run(h, [DraftRequest(rid, ctx, k, 0.0, self.default_gen)])
            if got is None:
                break
            real = list(got[0].tokens[:k])
            toks = real + [real[-1] if real else ctx[-1]] * (k - len(real))  # filler: verified, never learned
            cache.reserve(rid, n + 1 + k)
            rows = self.runner.step(cache, [SeqChunk(rid, [ctx[-1], *toks], all_logits=True, hidden_only=True)])
            new, acc, _ = accept_greedy_blocks([toks], rows, self.runner.head)[0]
            cache.truncate(rid, k - acc)
            done += 1
            if done == 1:  # the first step pays for the change of shape: the rest time a step of this width
                t_second = time.perf_counter()
            n += 1 + acc
            ctx += new
            out += new
            self._tell(h, "commit", rid, n)
            used = min(acc, len(real))
            if real:
                h.stats.drafts, h.stats.steps = h.stats.drafts + 1, h.stats.steps + 1
                h.stats.draft_tokens += len(real)
                h.stats.accepted_tokens += used
            if stops.intersection(new):
                break
        if done > 1:
            self._learn_ms(1 + k, (time.perf_counter() - t_second) * 1e3 / (done - 1))
        if done:
            self.copy_runs += 1
            self.prev_rows = 1 + k
        return out, done

    def ran(self, batch_rows: int, forward_ms: float = 0.0, steps: int = 0, tokens: int = 0,
            run_ms: float = 0.0) -> None:
        """The engine ran a greedy run (one row per sequence a step, ``steps`` in ``forward_ms``; ``tokens``
        appended in ``run_ms``, its whole engine step): the next step proposes."""
        self._ran = True
        if tokens and run_ms > 0:
            self.yields.run(batch_rows, tokens, run_ms, steps)
        if batch_rows == 1 and steps > 1:  # a step's time at a steady shape: a change of shape is priced apart
            changed = self.change_ms if self.prev_rows != 1 else 0.0
            self._learn_ms(1, max(forward_ms - changed, 0.5 * forward_ms) / steps)
        self.prev_rows = batch_rows

    def _learn_ms(self, rows: int, ms: float) -> None:
        """A step of ``rows`` rows (one sequence) measured at ``ms``: smoothed, a spell of the machine's
        (more than twice the estimate) counted as twice."""
        old = self._step_times.get(rows)
        self._step_times[rows] = ms if old is None else old + 0.2 * (min(ms, 2.0 * old) - old)

    def note_rows(self, rid: str, rows: torch.Tensor) -> None:
        """The target's output rows (hidden states or raw logits) [n, ...] of request ``rid``'s tokens
        just appended: the last one chose its last token."""
        if self.rows_wanted:
            q = self.rows.get(rid)
            if q is None:
                q = self.rows[rid] = deque(maxlen=self.rows_wanted)
            q.extend(rows.unbind(0))

    # -- verification ---------------------------------------------------------
    def chunk(self, prop: Proposal, p: ScheduledChunk, base: SeqChunk) -> SeqChunk:
        """The step's chunk for ``p``: ``base`` (the engine's) with the sequence's draft appended."""
        toks = prop.draft(p.seq)
        if not toks:
            return base
        s = p.seq
        lazy = s.params.greedy and s.plain  # processed rows and logprobs need every row's logits
        return SeqChunk(s.request_id, list(base.token_ids) + toks, all_logits=True, hidden_only=lazy,
                        prompt_len=base.prompt_len)

    def verify(self, prop: Proposal, chunks: list[SeqChunk], logits: list[torch.Tensor], fwd_start: float) -> None:
        """After the target's forward over ``chunks`` (started at ``fwd_start``, perf_counter): greedy
        drafts judged block by block, computing only the logits they need; the forward's time taught
        to the verify cost model."""
        greedy = [i for i, c in enumerate(chunks) if c.hidden_only]
        n_drafted = sum(len(d.tokens) for d in prop.pend.values())
        n_head = n_drafted
        if greedy:
            got = accept_greedy_blocks([prop.pend[chunks[i].seq_id].tokens for i in greedy],
                                       [logits[i] for i in greedy], self.runner.head)
            prop.verdict = dict(zip(greedy, got))
            n_head -= sum(len(chunks[i].token_ids) - rows for i, (_, _, rows) in prop.verdict.items())
        fwd_ms = (time.perf_counter() - fwd_start) * 1e3
        rows = sum(len(c.token_ids) for c in chunks)
        changed, self.prev_rows = rows != self.prev_rows, rows
        if self.controller is not None:
            if changed:  # the cost models learn a step's cost at a steady shape; a change is priced apart
                fwd_ms = max(fwd_ms - self.controller.change_ms, 0.5 * fwd_ms)
            n_dec, pre = len(prop.dec), prop.prefill_tokens
            n_rows = padded_drafted(self.runner.padded_rows, n_dec + pre, n_drafted)
            x = verify_x(n_dec, n_rows, sum(1 for d in prop.pend.values() if d.tokens), pre, n_head)
            if pre:
                self.verify_cost.update_prefill(x, fwd_ms)
            else:
                self.verify_cost.update(x, fwd_ms)

    def accept(self, prop: Proposal, ci: int, seq: Sequence, rows: torch.Tensor) -> Verdict:
        """What plain decoding would have produced for drafted sequence ``seq`` (chunk ``ci``, target
        logits ``rows``). Sampling draws from the sequence's generator; a grammar is advanced."""
        d = prop.pend[seq.request_id]
        if d.drafted:
            prop.used.add(d.handle.idx)
        gen = seq.generator or self.default_gen
        lps = None
        if ci in prop.verdict:
            toks, n_acc, _ = prop.verdict[ci]
        elif seq.plain:
            toks, n_acc = accept_sampling(d.tokens, d.q, distribution(rows, seq.params), gen)
        else:
            toks, n_acc, lps = accept_processed(seq, d.tokens, d.q, rows, self.eos_ids, gen)
        return Verdict(toks, n_acc, len(d.tokens) - n_acc, lps)

    def settle(self, prop: Proposal, seq: Sequence, verdict: Verdict, finished: bool) -> None:
        """After the engine appended ``verdict``'s tokens: the drafter rolled back to what was kept
        (unless the request finished), and the outcome learned."""
        d = prop.pend[seq.request_id]
        if not finished and d.drafted:
            self._tell(d.handle, "commit", seq.request_id, seq.num_computed)
        self._learn(seq, d, verdict.accepted)
        if not d.handle.probe and d.drafted and 2 * verdict.accepted >= d.drafted and len(prop.dec) == 1:
            self._model_held = True
