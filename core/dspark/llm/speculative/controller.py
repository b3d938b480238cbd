"""DeepSpec's controller: which drafter and how many tokens, per sequence and step.

For every decode sequence of a step the controller knows, per drafter, the
predicted acceptance of each next drafted token (the predictor), and it
knows what the step will cost (measured, never assumed):

- verify: the target's forward time as a linear function of
  ``[1, decode rows B, drafted tokens K, verify chunks M, prefill tokens,
  head rows Hd]``, fitted by recursive least squares on every step in two
  parts, a plain step and what drafting adds (``VerifyCost``), with the prior
  from a startup calibration of the real model on this machine. Greedy
  verification computes the LM head over a long draft's first block of rows
  (spec_verify.HEAD_BLOCK) and over the rest only if the first block held,
  so Hd, the drafted rows that got logits, is below K when drafts break
  early: a drafted token costs its layers for sure and, past the first
  block, its head row only if that block held;
  K counts the rows the forward computes for the drafted tokens: the dense
  layers of a step of several rows run padded to a bucket of rows
  (packed_linear.row_bucket: a 33-row verification costs 40 rows), so K is
  ``pad(rows + drafted) - pad(rows)``, and one sequence's choice of k sees
  that a k just past a bucket's end buys padding with it;
- draft: each drafter's call time as a function of
  ``[1, positions P, P x sequences S, S]`` (a batched draft model pays per
  position, a lookup per sequence), fitted the same way.

It then maximises expected throughput, tokens / time, with
E_i(k) = 1 + sum_{j<=k} prod_{l<=j} a_l per sequence (which is
(1 - a^(k+1)) / (1 - a) for a constant a): each sequence takes the
(drafter, k) maximising E_i(k) - R x (its marginal time), k = 0 included,
where R is, for one sequence, the step's own predicted rate (Dinkelbach's
iteration for the fractional program: R becomes the resulting plan's rate
until it stops rising), and in a batch the rate the engine sustains (tokens
per ms of wall time, an EMA; see ``choose``). Drafting costs shared by
sequences are settled by the same iterations. The plan is only taken when
its predicted rate beats plain decoding's, so when drafting cannot pay (low
acceptance, costly drafter, big batch whose verify tokens cost nearly full
price) every k is 0 and the step is a plain decode step.

Some targets also pay for a change of the step's shape (a compiled graph with
dynamic shapes prepares every node again when the row count changes): the
startup calibration measures that cost (``change_ms``). For a lone sequence the
plan then also weighs keeping the previous step's row count, a draft padded
with filler tokens up to it, against the change (``keep_width``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dspark.llm.speculative.verify import head_rows


class RLS:
    """Recursive least squares with forgetting and a bounded covariance (no wind-up).

    Plain Python on purpose: with 4-5 parameters, numpy's per-call overhead
    would cost more than the arithmetic, and this runs on every engine step.
    """

    def __init__(self, theta: list[float], var: list[float], lam: float = 0.99) -> None:
        n = len(theta)
        self.theta = [float(t) for t in theta]
        self.P = [[float(var[i]) if i == j else 0.0 for j in range(n)] for i in range(n)]
        self.trace0 = float(sum(var))
        self.lam = lam
        self.n = 0

    def predict(self, x: list[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def update(self, x: list[float], y: float) -> None:
        th, P, lam = self.theta, self.P, self.lam
        pred = sum(t * v for t, v in zip(th, x))
        if pred > 0 and y > 3.0 * pred + 1.0:  # a scheduling hiccup of the OS, not the model's cost
            y = 3.0 * pred + 1.0
        Px = [sum(pij * xj for pij, xj in zip(row, x)) for row in P]
        denom = lam + sum(xi * pxi for xi, pxi in zip(x, Px))
        g = [v / denom for v in Px]
        err = y - pred
        self.theta = [max(0.0, t + gi * err) for t, gi in zip(th, g)]  # costs are never negative
        n = len(th)
        for i in range(n):
            row, gi = P[i], g[i]
            for j in range(n):
                row[j] = (row[j] - gi * Px[j]) / lam
        tr = sum(P[i][i] for i in range(n))
        if tr > self.trace0:
            f = self.trace0 / tr
            for row in P:
                for j in range(n):
                    row[j] *= f
        self.n += 1


class VerifyCost:
    """The target forward's time over ``verify_x`` features, learned in two parts.

    One least-squares fit of every feature cannot tell a step's fixed cost
    from drafting's once nearly every step drafts (one sequence: every
    drafted step has the same decode rows and one verify chunk), and it
    drifted to "plain steps are dear, drafting's fixed cost is nil", which
    made drafts with little chance look free. So plain decode steps teach
    the plain part ``[1, B]``, and drafted steps teach only what drafting
    adds, ``[K, M, Hd]``, over the plain part's prediction. Prefill's
    per-token cost is followed separately (``prefill``).
    """

    def __init__(self, theta: list[float], var: list[float]) -> None:
        self.plain = RLS(theta[:2], var[:2])
        self.drafting = RLS([theta[2], theta[3], theta[5]], [var[2], var[3], var[5]])
        self.prefill = float(theta[4])
        # The least drafting can plausibly add: 80% of what the startup calibration measured (at a short
        # context; drafted rows cost more, not less, at longer ones).
        self.floor = [0.8 * theta[2], 0.8 * theta[3], 0.8 * theta[5]]

    @property
    def theta(self) -> list[float]:
        (b0, b1), (k, m, h) = self.plain.theta, self.drafting.theta
        return [b0, b1, k, m, self.prefill, h]

    def predict(self, x: list[float]) -> float:
        return self.plain.predict(x[:2]) + self.drafting.predict([x[2], x[3], x[5]]) + self.prefill * x[4]

    def update(self, x: list[float], y: float) -> None:
        """One timed forward without prefill."""
        if x[2] == 0:
            self.plain.update(x[:2], y)
            return
        xd = [x[2], x[3], x[5]]
        plain = self.plain.predict(x[:2])
        rest = y - plain
        floor = sum(f * v for f, v in zip(self.floor, xd))
        # Only a clear violation (beyond 15% of a plain step: drafted steps' costs scatter with the
        # context length) moves the plain part, or the scatter alone would pull it down step by step.
        if rest >= floor - 0.15 * plain:
            self.drafting.update(xd, max(rest, 0.0))
        else:
            # A drafted step too cheap for the plain part's estimate: that estimate is what is wrong (a
            # slow spell it learned from), and once it is too high drafting always looks free, so plain
            # steps, the only ones that would correct it, stop coming. The drafted step corrects it.
            self.plain.update(x[:2], y - max(self.drafting.predict(xd), floor))

    def update_prefill(self, x: list[float], y: float, rate: float = 0.2) -> None:
        """A forward with prefill tokens: only the per-token coefficient follows what it cost beyond
        the decode part (prefill's cost is not linear enough to share the decode model's fit)."""
        rest = y - self.predict(x[:4] + [0.0] + x[5:])
        self.prefill += rate * (max(rest, 0.0) / x[4] - self.prefill)


def fit(xs: list[list[float]], ys: list[float], prior: list[float], ridge: float = 1e-3) -> list[float]:
    """Least squares pulled towards ``prior`` where the data say nothing; non-negative."""
    X, y, p = np.asarray(xs, float), np.asarray(ys, float), np.asarray(prior, float)
    scale = max(float(np.mean(y)), 1e-6)
    A = X.T @ X + ridge * scale * np.eye(len(p))
    b = X.T @ y + ridge * scale * p
    return [max(0.0, float(v)) for v in np.linalg.solve(A, b)]


def verify_x(rows: int, drafted: int, chunks: int, prefill: int, head: float | None = None) -> list[float]:
    """``head``: drafted rows whose logits were computed (default: all of them, ``drafted``)."""
    return [1.0, float(rows), float(drafted), float(chunks), float(prefill), float(drafted if head is None else head)]


def padded_drafted(pad: Callable[[int], int] | None, rows: int, drafted: int) -> int:
    """The rows ``drafted`` tokens add to a step of ``rows`` others, padding included (``pad``: the rows a
    step of n rows is computed as; None: no padding)."""
    if pad is None or drafted <= 0:
        return drafted
    return pad(rows + drafted) - pad(rows)


def draft_x(positions: int, seqs: int) -> list[float]:
    return [1.0, float(positions), float(positions * seqs), float(seqs)]


@dataclass
class Option:
    """One drafter for one sequence: predicted acceptance of each next drafted token, for up to n tokens.

    Either ``a`` lists them, or the logit of token j (0-based) is
    ``z0 + dz * j + dlog * log2(j + 1) + extra[j]`` for j < n (the
    predictor's form, spec_predictor.along; ``extra``: the terms of a draft
    already known token by token, such as its token pairs), evaluated only as
    far as the choice looks.
    """

    drafter: int
    a: list[float] | None
    sunk: bool = False  # already drafted (a cheap lookup ran for everyone): no drafting time left to pay
    z0: float = 0.0
    dz: float = 0.0
    dlog: float = 0.0
    n: int = 0
    extra: list[float] | None = None

    def __post_init__(self) -> None:
        if self.a is not None:
            self.n = len(self.a)

    def acc(self, j: int) -> float:
        if self.a is not None:
            return self.a[j]
        z = self.z0 + self.dz * j + (self.dlog * math.log2(j + 1) if self.dlog else 0.0)
        if self.extra is not None:
            z += self.extra[j]
        return 1.0 / (1.0 + math.exp(-z)) if z > -30.0 else 0.0


@dataclass
class SeqChoice:
    drafter: int | None = None
    k: int = 0
    gain: float = 0.0  # expected extra tokens over plain decoding
    head: float = 0.0  # expected drafted rows whose logits get computed


@dataclass
class Plan:
    choices: list[SeqChoice]
    rate: float  # predicted tokens per ms of the chosen plan
    plain_rate: float
    marginal: dict[int, float] = field(default_factory=dict)  # drafter -> time of one more drafted token
    # The best single draft's predicted net gain over plain decoding, in tokens (negative: a loss).
    best_margin: float = float("-inf")
    # Rows to pad the step to with filler tokens, to keep the previous step's shape (0: none).
    width: int = 0


class Controller:
    def __init__(self, verify: VerifyCost | RLS, draft: list[RLS], head_block: int | None = None,
                 pad: Callable[[int], int] | None = None, change_ms: float = 0.0) -> None:
        self.verify = verify
        self.draft = draft
        # Rows of logits per verification block; None: the head runs over every drafted row.
        self.head_block = head_block
        # The rows a forward of n rows is computed as (ModelRunner.padded_rows); None: n.
        self.pad = pad
        # What a step costs beyond its rows when its row count differs from the previous step's (measured
        # at startup; 0: the target does not pay for it), and the filler paid since the last change
        # (keep_width: a step of filler alone, rather than a change, is rent against that cost).
        self.change_ms = change_ms
        self.filler_ms = 0.0
        self._pad_rows: list[int] = [0]  # [k]: the rows one sequence's k drafted tokens cost, alone

    def _alone_rows(self, n: int) -> list[int]:
        """Rows computed for k = 0..n drafted tokens of a lone sequence (a table: this runs every step)."""
        t = self._pad_rows
        if len(t) <= n:
            assert self.pad is not None
            t.extend(padded_drafted(self.pad, 1, k) for k in range(len(t), n + 1))
        return t

    def draft_time(self, d: int, positions: int, seqs: int) -> float:
        if positions <= 0 or seqs <= 0:
            return 0.0
        return self.draft[d].predict(draft_x(positions, seqs))

    def choose(self, options: list[list[Option]], prefill_tokens: int = 0, sunk_ms: float = 0.0,
               iterations: int = 4, rate: float | None = None, prev_rows: int | None = None) -> Plan:
        """``options[i]``: the drafters open to decode sequence i. Returns one choice per sequence.

        ``sunk_ms``: time already spent that no choice changes (lookups run for everyone).
        ``rate``: the tokens per ms the engine sustains. In a batch (more than one sequence) every
        sequence's drafted tokens are priced at it: a token is worth drafting when its chance of
        being accepted beats what its time earns at that rate, not at this step's own predicted
        rate, which mixes the sequences: two in long loops (up to max_k tokens each, however long
        the step) made the step's rate high and every other sequence's draft look unprofitable
        beside them. Alone, a sequence is priced at its step's own rate: its state (a loop, a
        copy, free text) persists from step to step, and what its own steps earn now is what a
        drafted token's time would otherwise earn (each rule measured best where it is used:
        docs/benchmarks.md). A plan is only taken when its step is predicted faster than
        a plain one. ``prev_rows``: the previous step's rows (with ``change_ms``, a lone sequence's plan
        may keep them: ``Plan.width``)."""
        B = len(options)
        th = self.verify.theta
        c_tok, c_chunk, c_head = float(th[2]), float(th[3]), float(th[5])
        blk = self.head_block or 0
        base = self.verify.predict(verify_x(B, 0, 0, prefill_tokens)) + sunk_ms
        plain_rate = B / max(base, 1e-9)
        best = Plan([SeqChoice() for _ in range(B)], plain_rate, plain_rate)
        R = plain_rate
        # drafter -> sequences sharing its per-position cost; first guess: all that may use it
        users: dict[int, int] = {}
        for opts in options:
            for o in opts:
                users[o.drafter] = users.get(o.drafter, 0) + 1
        # Per option, the expected tokens and head rows of each k: they do not depend on the rate, so
        # they are computed once, not per iteration (this runs every engine step).
        # A drafted token whose chance of being reached is below what it costs at the lowest rate the
        # iterations price at (plain decoding's, or the given one) can never pay, nor can any after it:
        # the chance only falls and each further token costs at least as much. The curve stops there.
        # (Past a long draft's first block of head rows, drafting one more token can save head rows:
        # between one block and two the curve goes on to the split, so the cut never changes a choice.)
        per_pos = {d: rls.theta[1] / max(B, 1) + rls.theta[2] for d, rls in enumerate(self.draft)}
        price = rate if rate is not None and B > 1 else None  # None: the step's own rate (Dinkelbach)
        r_min = plain_rate if price is None else price
        # Alone, a sequence's k decides the step's padding: its drafted tokens cost the rows they are
        # computed as. In a batch the padding depends on everyone's k together; it is left to the plan's
        # time below (a bucket's padding spread over many sequences is small beside their tokens).
        n_max = max((o.n for opts in options for o in opts), default=0)
        prow: Sequence[int] = (self._alone_rows(n_max) if self.pad is not None and B == 1 and not prefill_tokens
                               else range(n_max + 1))
        # Per option and k: expected tokens, head rows, and rows computed (prow[k]: k's rows).
        curves: list[list[tuple[list[float], list[float], list[int]]]] = []
        for opts in options:
            cs = []
            for o in opts:
                cut = r_min * (c_tok + (0.0 if o.sunk else per_pos[o.drafter]))
                cums, heads, rows = [], [], []
                cum, P, reach = 0.0, 1.0, 1.0
                for k in range(1, o.n + 1):
                    P *= o.acc(k - 1)
                    if k > 1 and (P < 1e-4 or (P < cut and (not blk or k <= blk or k > 2 * blk))):
                        # Tokens up to the end of the current row bucket cost no more rows than the one
                        # that opened it, so the curve runs on to that end (a choice there may pay) and
                        # stops at the token that opens the next bucket.
                        if P < 1e-4 or prow[k] != prow[k - 1]:
                            break
                    cum += P
                    if k == blk:
                        reach = P  # a long draft's rows past its first block: computed if that block held
                    cums.append(cum)
                    heads.append(head_rows(k, reach, blk) if blk else float(k))
                    rows.append(prow[k])
                cs.append((cums, heads, rows))
            curves.append(cs)
        margin = float("-inf")
        for it in range(iterations):
            marginal: dict[int, float] = {}
            fixed: dict[int, float] = {}
            for d, rls in enumerate(self.draft):
                s = max(users.get(d, 1), 1)
                t1, tP, tPS, tS = (float(v) for v in rls.theta)
                marginal[d] = c_tok + tP / s + tPS
                fixed[d] = c_chunk + (t1 + tS) / s
            choices = []
            Rp = R if price is None else price  # what a drafted token's time is priced at
            for opts, cs in zip(options, curves):
                pick, best_v = SeqChoice(), 0.0
                for o, (cums, heads, rows) in zip(opts, cs):
                    per_tok = 0.0 if o.sunk else marginal[o.drafter] - c_tok  # drafting, per position
                    start = c_chunk if o.sunk else fixed[o.drafter]
                    r_row, r_tok, r_start, r_head = Rp * c_tok, Rp * per_tok, Rp * start, Rp * c_head
                    best_k, bv = 0, float("-inf")
                    for k, (cum, head, n_rows) in enumerate(zip(cums, heads, rows), 1):
                        v = cum - r_row * n_rows - r_tok * k - r_head * head
                        if v > bv:
                            best_k, bv = k, v
                    if not best_k:
                        continue
                    bv -= r_start
                    if it == 0 and bv > margin:
                        margin = bv
                    if bv > best_v:
                        pick, best_v = SeqChoice(o.drafter, best_k, cums[best_k - 1], heads[best_k - 1]), bv
                choices.append(pick)
            # The plan's real predicted time: shared drafting cost by positions and users, not shares.
            per_d: dict[int, list[int]] = {}
            K = M = 0
            Hd = 0.0
            for c, opts in zip(choices, options):
                if c.drafter is None or c.k == 0:
                    continue
                K += c.k
                M += 1
                Hd += c.head
                if not next(o for o in opts if o.drafter == c.drafter).sunk:
                    per_d.setdefault(c.drafter, []).append(c.k)
            t = self.verify.predict(verify_x(B, padded_drafted(self.pad, B + prefill_tokens, K), M, prefill_tokens,
                                             Hd)) + sunk_ms
            t += sum(self.draft_time(d, max(ks), len(ks)) for d, ks in per_d.items())
            plan_rate = (B + sum(c.gain for c in choices)) / max(t, 1e-9)
            users = {d: len(ks) for d, ks in per_d.items()}
            if plan_rate <= best.rate * (1 + 1e-6):
                break
            best = Plan(choices, plan_rate, plain_rate, marginal)
            R = plan_rate
        best.best_margin = margin
        if self.change_ms > 0 and B == 1 and not prefill_tokens and prev_rows:
            best = keep_width(self, best, options[0], curves[0], prev_rows, sunk_ms)
        return best


# -- a lone sequence's width ---------------------------------------------------
Curve = tuple[list[float], list[float], list[int]]  # per k: expected tokens, head rows, rows computed


def keep_width(ctrl: Controller, plan: Plan, opts: list[Option], curves: list[Curve], prev: int,
               sunk_ms: float) -> Plan:
    """``plan`` for one decode sequence re-chosen with the change of the step's shape priced (``change_ms``;
    ``prev``: the previous step's rows). Per drafter and k it weighs the step as drafted (1 + k rows, paying
    the change unless that is the previous count) against the draft padded with filler tokens to the
    previous rows (no change; filler is verified like drafted tokens, so the output stays plain
    decoding's), and a one-row plain step against filler alone at the previous width. Filler alone is rent
    against the change's price: taken only while the filler paid since the last change stays within one
    change (ski rental), so a run with nothing to draft goes back to one row after a bounded loss. The
    returned plan's ``width`` is the rows to pad the step to (0: as drafted)."""
    th = ctrl.verify.theta
    c_tok, c_chunk, c_head = float(th[2]), float(th[3]), float(th[5])
    base = ctrl.verify.predict(verify_x(1, 0, 0, 0)) + sunk_ms
    change = ctrl.change_ms
    # (rate, drafter, k, expected tokens gained, head rows, width, filler cost)
    best = (1.0 / (base + (change if prev != 1 else 0.0)), None, 0, 0.0, 0.0, 0, 0.0)
    for o, (cums, heads, rows) in zip(opts, curves):
        for k, (cum, head, r) in enumerate(zip(cums, heads, rows), 1):
            t = base + c_tok * r + c_chunk + c_head * head + (0.0 if o.sunk else ctrl.draft_time(o.drafter, k, 1))
            exact = (1.0 + cum) / (t + (change if 1 + r != prev else 0.0))
            if exact > best[0]:
                best = (exact, o.drafter, k, cum, head, 0, 0.0)
            fill = prev - 1 - r
            if fill > 0:
                padded = (1.0 + cum) / (t + (c_tok + c_head) * fill)
                if padded > best[0]:
                    best = (padded, o.drafter, k, cum, head + fill, prev, 0.0)
    if prev > 1:
        rent = (c_tok + c_head) * (prev - 1) + c_chunk
        if ctrl.filler_ms + rent <= change and 1.0 / (base + rent) > best[0]:
            best = (1.0 / (base + rent), None, 0, 0.0, float(prev - 1), prev, rent)
    rate, drafter, k, gain, head, width, rent_paid = best
    ctrl.filler_ms = ctrl.filler_ms + rent_paid if rent_paid else 0.0
    choice = replace(plan.choices[0], drafter=drafter, k=k, gain=gain, head=head)
    return replace(plan, choices=[choice], rate=rate, width=width)
