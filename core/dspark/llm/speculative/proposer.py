"""The proposer: drafts for the step's decode sequences.

For each decode sequence the controller (``strategy: deepspec``) picks a drafter and a length k
from predicted acceptance and measured costs, or the fixed drafter and k (``strategy: fixed``);
cheap lookup drafters run for everyone first so their real drafts inform the choice. KV room for
the 1 + k tokens is taken from free pages only (k shrinks, nothing is preempted for a draft).
Drafters run batched (one draft-model forward per draft position for all its sequences; the
self-drafter's forwards stop at its exit layer).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dspark.llm.config import SpeculativeConfig
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.scheduler import ScheduledChunk, Sequence
from dspark.llm.speculative.controller import Controller, Option, Plan
from dspark.llm.speculative.handles import DrafterCalls, Handle, log
from dspark.llm.speculative.predictor import PAIR, AcceptancePredictor, along, features
from dspark.llm.speculative.verify import clip_to_grammar
from dspark.types import Draft, DraftRequest

_KIND_ORDER = {"model": 0, "self": 1, "ngram": 2, "other": 3}
_CONSERVATIVE_K = 2  # cap of conservative mode for long open-ended text
_LONG_OUTPUT = 64  # output tokens after which open-ended text counts as long
_OPEN_ENDED = 0.35  # prompt repetitiveness below which text is open-ended
# A probed draft's token pairs and their learned terms (SpecDecoder._pair_terms).
_PairTerms = tuple[list[tuple[int, int]], list[float]]
# Quiet steps (drafts on offer, none taken; a step counts 1/4 unless the best draft was near break-even)
# before one exploratory draft; the wait doubles after each, up to the maximum.
_EXPLORE_FIRST, _EXPLORE_MAX = 8, 512


@dataclass
class ReqState:
    """What the controller knows about one request."""

    rep: float  # prompt repetitiveness: share of its 2-grams seen earlier in it
    hist: list[float]  # per drafter, EMA of per-token acceptance
    conf: list[float]  # per drafter, EMA of draft confidence
    run: list[int] = field(default_factory=list)  # per drafter, tokens accepted since its last rejection
    open_ended: bool = False


@dataclass
class Pending:
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
    # Drafted tokens before the filler that pads the step to the previous step's rows (None: no filler;
    # 0: filler only, nothing drafted). Filler is verified like a draft but neither learned nor counted.
    real: int | None = None

    @property
    def drafted(self) -> int:
        return len(self.tokens) if self.real is None else self.real


def _last(seq: Sequence) -> int:
    return int((seq.output_ids or seq.prompt_ids)[-1])


def _pairs(last: int, toks: list[int]) -> list[tuple[int, int]]:
    """(previous token, token) for each drafted token; the first follows the context's last token."""
    return list(zip([last, *toks[:-1]], toks))


def _copy_out(dr: Draft, seq: Sequence) -> float:
    """1 when a draft is a copy of the text generated so far, 0 for a copy of the prompt or no copy."""
    return 1.0 if dr.source is not None and dr.source >= len(seq.prompt_ids) else 0.0


def repetitiveness(ids: list[int]) -> float:
    """Share of positions whose 2-gram occurred earlier: high for code and edits, low for open prose."""
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


@dataclass
class Proposal:
    """One step's drafts, from :meth:`Proposer.propose` to the verifier and the learner."""

    dec: list[ScheduledChunk]  # the step's decode sequences (one token, completing)
    prefill_tokens: int  # the step's other (prefill) tokens
    pend: dict[str, Pending]  # per request id: its draft (empty when KV room was taken but nothing came)
    n_before: int  # output tokens of ``dec`` before the step: the step's yield is measured against it
    # Filled by the verifier: chunk index -> (tokens to emit, accepted, computed rows) for the drafts
    # verified greedily block by block.
    verdict: dict[int, tuple[list[int], int, int]] = field(default_factory=dict)
    used: set[int] = field(default_factory=set)  # handles whose drafts were verified this step

    def draft(self, seq: Sequence) -> list[int]:
        """``seq``'s drafted tokens this step (empty: none)."""
        d = self.pend.get(seq.request_id)
        return [] if d is None else d.tokens

    def reserved(self, seq: Sequence) -> bool:
        """Whether KV pages were taken for a draft of ``seq`` (given back when none came)."""
        return seq.request_id in self.pend


class Proposer(DrafterCalls):
    """Drafting (a part of :class:`~dspark.llm.speculative.decoder.SpecDecoder`)."""

    cfg: SpeculativeConfig
    strategy: str
    cache: PagedKVCache
    max_model_len: int
    default_gen: torch.Generator
    predictor: AcceptancePredictor
    reqs: dict[str, ReqState]
    rows: dict[str, deque[torch.Tensor]]
    controller: Controller | None
    fixed: Handle | None
    exit_chosen: bool
    calibration: dict[str, Any]
    rate: float | None
    steps: int
    spec_steps: int
    explore_steps: int
    _quiet: float
    _explore_gap: int
    prev_rows: int | None  # the previous step's rows (SpecDecoder.verify), for the controller's width
    change_ms: float  # what a change of the step's row count costs (Calibration._change_cost)

    def propose(self, planned: list[ScheduledChunk]) -> Proposal:
        """Drafts for the decode sequences of a scheduled step, cut where a grammar refuses them."""
        self.steps += 1
        dec = [p for p in planned if p.num_tokens == 1 and p.completes]
        prefill_tokens = sum(p.num_tokens for p in planned) - len(dec)
        pend: dict[str, Pending] = {}
        if dec and any(h.disabled is None for h in self.handles):
            pend = self._draft(dec, prefill_tokens)
        clip_to_grammar(dec, pend)
        return Proposal(dec, prefill_tokens, pend, sum(len(p.seq.output_ids) for p in dec))

    def _req(self, seq: Sequence) -> ReqState:
        st = self.reqs.get(seq.request_id)
        if st is None:
            rep = repetitiveness(seq.prompt_ids[-512:])
            n = len(self.handles)
            st = ReqState(rep, list(self.predictor.mean), [0.5] * n, [0] * n, open_ended=rep < _OPEN_ENDED)
            self.reqs[seq.request_id] = st
        return st

    def _cap(self, seq: Sequence) -> int:
        """Most tokens worth drafting: room left by max_tokens and max_model_len, the conservative cap."""
        p = seq.params
        n_all = len(seq.prompt_ids) + len(seq.output_ids)
        k = self.cfg.num_speculative_tokens if self.strategy == "fixed" else self.cfg.max_k
        k = min(k, p.max_tokens - len(seq.output_ids) - 1, self.max_model_len - n_all - 1)
        if self.cfg.conservative and self.strategy == "deepspec":
            st = self.reqs.get(seq.request_id)
            if (st is not None and st.open_ended and len(seq.output_ids) >= _LONG_OUTPUT) \
                    or n_all >= 0.75 * self.max_model_len:
                k = min(k, _CONSERVATIVE_K)
        return max(k, 0)


    # -- drafting -----------------------------------------------------------
    def _draft(self, dec: list[ScheduledChunk], prefill_tokens: int) -> dict[str, Pending]:
        cache = self.cache
        seqs = [p.seq for p in dec]
        caps = [self._cap(s) for s in seqs]
        if not any(caps):
            return {}
        sts = [self._req(s) for s in seqs]
        live = [h for h in self.handles if h.disabled is None]
        if not self.exit_chosen:
            self._choose_exit(seqs)
        ctxs = [s.all_ids for s in seqs]
        gens = [s.generator or self.default_gen for s in seqs]
        temps = [0.0 if s.params.greedy else s.params.temperature for s in seqs]

        def request(i: int, k: int, keep: Any = None) -> DraftRequest:
            rid = seqs[i].request_id
            rows = self.rows.get(rid)
            return DraftRequest(rid, ctxs[i], k, temps[i], gens[i], keep, list(rows) if rows else None)

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
        pend: dict[str, Pending] = {}
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
                pend[rid] = Pending(h_i, [], None)
        if self.strategy == "fixed":  # a fixed configuration verifies its k every step, drafts or not
            width = 1 + caps[0] if self.change_ms > 0 else 0
        else:
            width = self._plan.width if self._plan is not None else 0
        if width and len(seqs) == 1 and not prefill_tokens:
            self._pad(pend, seqs[0], width)
        return pend

    def _pad(self, pend: dict[str, Pending], seq: Sequence, width: int) -> None:
        """Pad ``seq``'s draft with filler tokens to ``width`` rows (Plan.width), where KV room allows: greedy
        verification judges filler as any drafted token, so the tokens kept are plain decoding's."""
        if not (seq.params.greedy and seq.plain) or width - 1 > self._cap(seq) \
                or not self.cache.can_grow(seq.request_id, seq.num_computed + width):
            return
        d = pend.get(seq.request_id)
        toks = list(d.tokens) if d is not None else []
        if len(toks) >= width - 1:
            return
        self.cache.reserve(seq.request_id, seq.num_computed + width)
        fill = [toks[-1] if toks else _last(seq)] * (width - 1 - len(toks))
        if d is None:
            pend[seq.request_id] = Pending(self.handles[0], fill, None, real=0)
        else:
            d.tokens, d.real = toks + fill, len(toks)

    def _pair_terms(self, seq: Sequence, h: Handle, toks: list[int]) -> _PairTerms | None:
        """A draft's token pairs and their learned terms as they stand now (None: pairs are not learned
        for this drafter, whose drafts are not known before the choice)."""
        if not (h.probe and toks):
            return None
        pairs = _pairs(_last(seq), toks)
        return pairs, [self.predictor.pair(h.idx, a, b) for a, b in pairs]

    def _pending(self, pend: dict[str, Pending], i: int, seq: Sequence, st: ReqState, h: Handle, dr: Draft,
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
        pend[seq.request_id] = Pending(h, toks, q, x_of, pairs)

    def _keep_going(self, seq: Sequence, st: ReqState, h: Handle) -> Any:
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

    def _decide(self, seqs: list[Sequence], sts: list[ReqState], caps: list[int], live: list[Handle],
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
        plan = self.controller.choose(options, prefill_tokens, sunk_ms, rate=self.rate, prev_rows=self.prev_rows)
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
