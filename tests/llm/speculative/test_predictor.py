"""DeepSpec's acceptance predictor (dspark.llm.speculative.predictor): it learns, its calibration
improves, it tells copies of the output from copies of the prompt, and it learns from token pairs."""

from __future__ import annotations

import math
import random

import pytest

from dspark.llm.speculative.predictor import PAIR, AcceptancePredictor, PairTable, features


def test_predictor_learns_and_its_calibration_improves() -> None:
    rng = random.Random(0)
    pred = AcceptancePredictor(1, priors=[0.5])
    early, late = [], []
    for i in range(4000):
        conf, hist, rep = rng.random(), rng.random(), rng.random()
        true = 1 / (1 + math.exp(-(5 * conf + 2 * rep - 4)))  # what acceptance really depends on
        x = features(conf, hist, rng.randint(1, 8), rep, 200)
        a = pred.predict(0, x)
        y = rng.random() < true
        (early if i < 500 else late if i >= 3500 else []).append((a, y, true))
        pred.observe(0, x, a, y)

    def mean_abs(rows: list[tuple[float, bool, float]]) -> float:
        return sum(abs(a - t) for a, _, t in rows) / len(rows)

    assert mean_abs(late) < 0.5 * mean_abs(early)
    assert mean_abs(late) < 0.06
    table = pred.total.table()
    assert sum(r["n"] for r in table) == 4000 and pred.total.error() is not None
    lo = next(r for r in table if r["bucket"] == 0.0)
    hi = next(r for r in table if r["bucket"] == 0.9)
    assert lo["observed"] < 0.15 and hi["observed"] > 0.8


def test_the_predictor_learns_that_copies_of_the_output_hold_better_than_copies_of_the_prompt() -> None:
    pred = AcceptancePredictor(1)
    rng = random.Random(1)
    for _ in range(3000):
        out = float(rng.random() < 0.5)
        x = features(0.6, 0.6, rng.randint(1, 16), 0.5, 300, 0, out)
        pred.observe(0, x, pred.predict(0, x), rng.random() < (0.95 if out else 0.4))
    from_out = pred.predict(0, features(0.6, 0.6, 4, 0.5, 300, 0, 1.0))
    from_prompt = pred.predict(0, features(0.6, 0.6, 4, 0.5, 300, 0, 0.0))
    assert from_out > 0.85 and from_prompt < 0.55


def test_the_pair_table_says_nothing_of_an_unseen_pair_and_learns_a_seen_one() -> None:
    t = PairTable(prior=4.0, max_pairs=3)
    assert t.value(1, 2, 0.9) == 0.0
    for _ in range(6):
        t.add(1, 2, False)  # broke every time
        t.add(3, 4, True)
    t.add(5, 6, True)
    assert t.value(1, 2, 0.9) < -2.0 < 0.0 < t.value(3, 4, 0.9)
    assert t.value(5, 6, 0.9) == pytest.approx(math.log(0.92 / 0.08) - math.log(0.9 / 0.1))  # one sighting: a nudge
    t.add(7, 8, False)  # full: a new pair is not kept, known ones still learn
    assert (7, 8) not in t.counts and len(t.counts) == 3
    t.add(5, 6, False)
    assert t.counts[(5, 6)] == [1.0, 2.0]


def test_the_predictor_learns_where_copies_break_from_token_pairs() -> None:
    # Copies break after token 9 (a name that changes between copies, say), and hold elsewhere; the
    # other features cannot tell the two apart, the pair can.
    pred = AcceptancePredictor(1, priors=[0.8])
    rng = random.Random(2)
    for _ in range(3000):
        prev = rng.choice([9, 10, 11, 12])
        tok = rng.randrange(20, 24)
        x = features(0.6, 0.7, rng.randint(1, 16), 0.5, 300, pair=pred.pair(0, prev, tok))
        pred.observe(0, x, pred.predict(0, x), rng.random() < (0.3 if prev == 9 else 0.95), pair=(prev, tok))
    assert pred.models[0].w[PAIR] > 0.5

    def a(prev: int) -> float:
        return pred.predict(0, features(0.6, 0.7, 4, 0.5, 300, pair=pred.pair(0, prev, 21)))

    assert a(9) < 0.45 and a(10) > 0.9
    assert pred.predict(0, features(0.6, 0.7, 4, 0.5, 300, pair=pred.pair(0, 99, 21))) > a(9)  # unseen: no verdict
