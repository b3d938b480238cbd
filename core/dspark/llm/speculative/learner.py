"""The learner: what verified drafts teach the acceptance predictor, the per-request histories and
the engine's yield rate; the counters reported in the engine's stats; snapshots of what was learned."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from dspark.llm.scheduler import Sequence
from dspark.llm.speculative.controller import Controller, VerifyCost
from dspark.llm.speculative.handles import DrafterCalls
from dspark.llm.speculative.predictor import AcceptancePredictor
from dspark.llm.speculative.proposer import Pending, Proposal, ReqState
from dspark.llm.speculative.runs.pays import Yields


class Learner(DrafterCalls):
    """Learning and reporting (a part of :class:`~dspark.llm.speculative.decoder.SpecDecoder`)."""

    strategy: str
    idle: int
    _ran: bool
    predictor: AcceptancePredictor
    reqs: dict[str, ReqState]
    controller: Controller | None
    rate: float | None
    spec_steps: int
    explore_steps: int
    copy_runs: int
    yields: Yields

    verify_cost: VerifyCost
    _make_controller: Callable[[], Controller]  # Calibration's

    def end_step(self, prop: Proposal, step_ms: float) -> None:
        """After the engine appended the step's tokens: per-drafter step counts, the yield rate, tokens
        per ms over decode-only steps, that a drafted token's time is priced at (and what the step yielded
        against greedy runs, ``runs.pays``), and how many decode-only proposals in a row drafted nothing
        (``SpecDecoder.run_steps``)."""
        self._ran = False
        dec = prop.dec
        if dec:
            drafted = any(d.drafted for d in prop.pend.values())
            self.idle = 0 if drafted or prop.prefill_tokens else self.idle + 1
        for i in prop.used:
            self.handles[i].stats.steps += 1
        if prop.used:
            self.spec_steps += 1
        if dec and not prop.prefill_tokens:
            tokens = sum(len(p.seq.output_ids) for p in dec) - prop.n_before
            self.yields.proposal(len(dec), tokens, step_ms)
            if self.controller is not None:
                r = tokens / max(step_ms, 1e-6)
                self.rate = r if self.rate is None else self.rate + 0.05 * (r - self.rate)

    def _learn(self, seq: Sequence, d: Pending, n_acc: int) -> None:
        h = d.handle
        k = d.drafted  # the filler padding a step to its width is neither learned nor counted
        n_acc = min(n_acc, k)
        if k == 0:
            return
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

    # -- learned state --------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A copy of what DeepSpec has learned online: the acceptance predictor (with its pair tables
        and calibration) and the verify and drafting cost models. For ``restore``: a benchmark that
        times the same requests several times restores it before each pass, so no pass is measured
        on requests DeepSpec has already learned from."""
        snap = copy.deepcopy({"predictor": self.predictor, "verify_cost": getattr(self, "verify_cost", None),
                              "draft_costs": [h.cost for h in self.handles], "rate": self.rate,
                              "yields": self.yields.state()})
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
        self.yields.load(snap["yields"])
        self._load_drafter_states(drafters)
        if self.controller is not None:
            self.controller = self._make_controller()

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
            "spec_copy_runs": self.copy_runs,
            "spec_calibration_error": self.predictor.total.error(),
            "spec_drafters": {h.name: {**h.stats.as_dict(), "kind": h.kind, "plugin": h.plugin,
                                       "disabled": h.disabled,
                                       "calibration_error": self.predictor.calib[h.idx].error()}
                              for h in self.handles},
        }

    def calibration_table(self) -> list[dict[str, float]]:
        return self.predictor.total.table()

