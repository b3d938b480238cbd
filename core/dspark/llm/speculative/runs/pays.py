"""Whether DeepSpec's proposals pay against plain decoding, at the batch's size (``SpecDecoder.run_steps``).

A proposal step drafts for every decoding sequence, verifies the drafts and samples each row in turn; a greedy
run (plugin API 1.13) runs several plain steps in one decoder call and pays the engine's work once. A batch
whose sequences draft a little all the time (a lookup finds a match somewhere in most steps) never goes a
proposal without a draft, so the rule "two proposals in a row that drafted nothing" never lets runs take the
stretch, while the few tokens its drafts add cost more than the per-step work they bring. Here each way's
yield is measured as the engine sustains it, tokens appended per millisecond of engine step (scheduling,
drafting, forward, verification, output), by the batch's size: proposal steps, and greedy runs or, where no
run can go (a request waiting, a decoder without runs), plain steps. While proposals yield less, they back
off: 2, 4, 8, ... 32 plain steps are owed before the next one; one that yields more ends it. Where plain
decoding was not measured at the batch's size, a larger batch's bounds it from below (a step of fewer rows
is no slower); with no bound either, a short run measures it after a few proposals.
"""

from __future__ import annotations

ALPHA = 0.3  # weight of a new measurement in a yield's moving average
EXPLORE_AFTER = 8  # proposal steps at a batch size no run has been measured at before a run of EXPLORE_STEPS
EXPLORE_STEPS = 2
MIN_SEQS = 2  # a lone sequence goes its own way (copy runs, runs.replay); its proposals are not weighed here
MAX_DOUBLINGS = 5  # at most 2 ** 5 plain steps between proposals


class Yields:
    """Tokens per ms of proposal steps and of plain decoding (greedy runs, plain steps), by the number of
    sequences decoding; the plain steps owed before the next proposal."""

    def __init__(self) -> None:
        self.proposed: dict[int, float] = {}
        self.ran: dict[int, float] = {}
        self.backoff = 0  # proposals in a row (plain steps between them) that yielded less than plain decoding
        self.owed = 0  # plain steps to take before the next proposal
        self.since_run = 0  # proposal steps since plain decoding was last measured
        self.batch = 0  # sequences decoding in the last proposal step

    def proposal(self, seqs: int, tokens: int, ms: float) -> None:
        """A decode-only proposal step of ``seqs`` sequences appended ``tokens`` in ``ms`` (the engine's step)."""
        if seqs < MIN_SEQS:
            self.backoff = self.owed = 0
            return
        self.batch = seqs
        self.since_run += 1
        _mix(self.proposed, seqs, tokens / max(ms, 1e-6))
        ran = self.ran.get(seqs)
        if ran is None:  # a larger batch's plain decoding bounds it from below: a step of fewer rows is no slower
            bigger = min((b for b in self.ran if b > seqs), default=None)
            ran = None if bigger is None else self.ran[bigger] * seqs / bigger
        self.backoff = self.backoff + 1 if ran is not None and self.proposed[seqs] < ran else 0
        self.owed = 2 ** min(self.backoff, MAX_DOUBLINGS) if self.backoff else 0

    def run(self, seqs: int, tokens: int, ms: float, steps: int) -> None:
        """A greedy run of ``seqs`` sequences and ``steps`` steps appended ``tokens`` in ``ms`` (its whole engine
        step)."""
        self.since_run = 0
        self.owed = max(0, self.owed - steps)
        _mix(self.ran, seqs, tokens / max(ms, 1e-6))

    def plain_step(self, seqs: int, tokens: int, ms: float) -> None:
        """A plain step of ``seqs`` sequences taken instead of a proposal where no run could go (a request
        waiting, a decoder without runs): one of the steps owed, and with ``tokens`` (a decode-only step) what
        plain decoding yields here, a run of one step."""
        self.owed = max(0, self.owed - 1)
        if tokens:
            self.run(seqs, tokens, ms, 0)

    def explore(self) -> int:
        """A short run (or a plain step) to measure plain decoding at a batch size none was measured at, after
        some proposals there."""
        if self.batch >= MIN_SEQS and self.batch not in self.ran and self.since_run >= EXPLORE_AFTER:
            return EXPLORE_STEPS
        return 0

    def state(self) -> dict[str, dict[int, float]]:
        return {"proposed": dict(self.proposed), "ran": dict(self.ran)}

    def load(self, state: dict[str, dict[int, float]]) -> None:
        self.proposed, self.ran = dict(state["proposed"]), dict(state["ran"])
        self.backoff = self.owed = self.since_run = 0


def _mix(table: dict[int, float], key: int, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else old + ALPHA * (value - old)
