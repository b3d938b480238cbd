"""The acceptance predictor of DeepSpec: online logistic regression, one per drafter.

It predicts the probability that the next drafted token is accepted given
that the ones before it were (the per-token acceptance ``a`` of the
geometric model), from:

- the drafter's confidence in the token (its probability for model drafters,
  the matched n-gram length for lookup), or the request's running mean
  confidence for this drafter before anything is drafted;
- the request's recent acceptance history with this drafter (an EMA), and
  its current run: tokens accepted since the drafter's last rejection (a
  copy or a loop that has held for a whole draft or more tends to go on);
- the position in the draft;
- the prompt kind: how repetitive the prompt is (share of its 2-grams seen
  before in it; code and edits are high, open prose is low);
- for a copy (``Draft.source``): whether it is copied from the prompt or from
  the text generated so far (copies of the model's own output hold better
  than copies of the prompt, at every match length);
- the context length;
- for a draft known before the choice (a lookup): how often this drafter's
  token has held after this previous token, for this exact pair, learned
  online across requests (``PairTable``): copies break at the same kinds of
  places (after ``=``, at a new line's indentation, at a name that changes
  between copies), and a pair seen to break before breaks again.

It learns from every verified token (those after the first rejection are
never seen, so they teach nothing) and keeps prequential calibration: each
prediction is bucketed *before* its outcome is learned, so the calibration
error reported is the error of the decisions actually taken.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

NUM_FEATURES = 11
NUM_BUCKETS = 10
MAX_POS = 64  # the largest max_k


def features(conf: float, hist: float, pos: int, rep: float, ctx_len: int, run: int = 0,
             copy_out: float = 0.0, pair: float = 0.0) -> list[float]:
    """conf, hist, rep in [0, 1]; pos >= 1 is the token's place in the draft; ``run``: tokens
    this drafter has had accepted since its last rejection for this request; ``copy_out``: 1 when
    the draft is copied from the text generated so far, 0 from the prompt or not a copy; ``pair``:
    the token pair's learned log-odds over the drafter's mean (``PairTable.value``), 0 if unknown."""
    # The position enters linearly and as a log: a copied continuation's hazard falls along the draft
    # (measured on lookup drafts here: 0.74 acceptance at the first token, 0.83 at the next three,
    # 0.95 up to 16, 0.98 beyond), which a linear term alone cannot follow. Neither is capped below
    # MAX_POS: the controller extrapolates both terms along a draft (``along``), and a cap would make
    # its view and the predictor's differ.
    p = min(pos, MAX_POS)
    return [1.0, conf, conf * conf, hist, p / 8.0, rep, min(1.0, math.log2(max(ctx_len, 1)) / 10.0),
            min(run, 64) / 64.0, math.log2(p) / 6.0, copy_out, pair]


PAIR = 10  # the index of the pair feature: it varies along a draft, token by token


class PairTable:
    """Acceptance of drafted token ``tok`` after token ``prev``, counted per pair.

    ``value`` is the pair's smoothed log-odds over the drafter's mean: 0 for a
    pair never seen, moving away as it is seen (a pseudo-count of ``prior``
    observations at the mean keeps one outcome from saying much). Bounded:
    once ``max_pairs`` pairs are known, new pairs are not added (known ones
    still learn).
    """

    def __init__(self, prior: float = 4.0, max_pairs: int = 1 << 17) -> None:
        self.prior = prior
        self.max_pairs = max_pairs
        self.counts: dict[tuple[int, int], list[float]] = {}

    def value(self, prev: int, tok: int, mean: float) -> float:
        c = self.counts.get((prev, tok))
        if c is None:
            return 0.0
        m = min(max(mean, 0.02), 0.98)
        p = (c[0] + self.prior * m) / (c[1] + self.prior)
        return math.log(p / (1.0 - p)) - math.log(m / (1.0 - m))

    def add(self, prev: int, tok: int, accepted: bool) -> None:
        c = self.counts.get((prev, tok))
        if c is None:
            if len(self.counts) >= self.max_pairs:
                return
            c = self.counts[(prev, tok)] = [0.0, 0.0]
        c[0] += 1.0 if accepted else 0.0
        c[1] += 1.0


def along(w: list[float]) -> tuple[float, float]:
    """How the logit moves along a draft: per token (linear term) and per doubling of the position."""
    return w[4] / 8.0, w[8] / 6.0


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


class OnlineLogistic:
    """Logistic regression trained by AdaGrad, one sample at a time."""

    def __init__(self, prior: float = 0.5, lr: float = 0.3, l2: float = 1e-4) -> None:
        self.w = [0.0] * NUM_FEATURES
        # Prior: ``prior`` at confidence 0.5, and a drafter's confidence means something
        # (a = sigmoid(logit(prior) + 2 (conf - 0.5))); the data take over from there.
        self.w[1] = 2.0
        self.w[0] = math.log(prior / (1.0 - prior)) - 1.0
        self.g2 = [1e-2] * NUM_FEATURES
        self.lr, self.l2 = lr, l2
        self.n = 0

    def predict(self, x: list[float]) -> float:
        return _sigmoid(sum(w * v for w, v in zip(self.w, x)))

    def update(self, x: list[float], y: float, predicted: float | None = None) -> None:
        """``predicted``: this model's prediction for ``x`` now, when the caller has it already."""
        err = (self.predict(x) if predicted is None else predicted) - y
        w, g2, lr, l2 = self.w, self.g2, self.lr, self.l2
        for i, v in enumerate(x):
            if v == 0.0 and not w[i]:
                continue  # no gradient
            g = err * v + l2 * w[i]
            g2[i] += g * g
            w[i] -= lr * g / math.sqrt(g2[i])
        self.n += 1


@dataclass
class Calibration:
    """Predicted vs observed acceptance in ten buckets of predicted probability."""

    count: list[int] = field(default_factory=lambda: [0] * NUM_BUCKETS)
    pred: list[float] = field(default_factory=lambda: [0.0] * NUM_BUCKETS)
    obs: list[float] = field(default_factory=lambda: [0.0] * NUM_BUCKETS)

    def add(self, p: float, y: float) -> None:
        b = min(NUM_BUCKETS - 1, int(p * NUM_BUCKETS))
        self.count[b] += 1
        self.pred[b] += p
        self.obs[b] += y

    @property
    def n(self) -> int:
        return sum(self.count)

    def error(self) -> float | None:
        """Expected calibration error: sum over buckets of share x |mean predicted - mean observed|."""
        n = self.n
        if not n:
            return None
        return sum(abs(p - o) for p, o in zip(self.pred, self.obs)) / n

    def table(self) -> list[dict[str, float]]:
        return [{"bucket": b / NUM_BUCKETS, "n": c, "predicted": p / c, "observed": o / c}
                for b, (c, p, o) in enumerate(zip(self.count, self.pred, self.obs)) if c]


class AcceptancePredictor:
    """One online model per drafter, and calibration per drafter and overall."""

    def __init__(self, num_drafters: int, priors: list[float] | None = None) -> None:
        priors = priors or [0.5] * num_drafters
        self.models = [OnlineLogistic(prior=p) for p in priors]
        self.pairs = [PairTable() for _ in priors]
        self.calib = [Calibration() for _ in range(num_drafters)]
        self.total = Calibration()
        # Mean acceptance per drafter over everything seen: where a new request's history starts.
        self.mean = list(priors)

    def predict(self, d: int, x: list[float]) -> float:
        return self.models[d].predict(x)

    def pair(self, d: int, prev: int, tok: int) -> float:
        return self.pairs[d].value(prev, tok, self.mean[d])

    def observe(self, d: int, x: list[float], predicted: float, accepted: bool,
                pair: tuple[int, int] | None = None) -> None:
        """Learn one verified token; ``pair``: (previous token, drafted token) when the pair feature is used."""
        y = 1.0 if accepted else 0.0
        if pair is not None:
            self.pairs[d].add(pair[0], pair[1], accepted)
        self.calib[d].add(predicted, y)
        self.total.add(predicted, y)
        self.models[d].update(x, y, predicted)
        self.mean[d] += 0.01 * (y - self.mean[d])
