"""DeepSpec's controller (dspark.llm.speculative.controller): when drafting pays, which drafter and how
long, priced at padded rows, head rows and the rate the engine sustains; and the verification cost
model it prices with."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from dspark.llm.runner.packed_linear import row_bucket
from dspark.llm.speculative.controller import RLS, Controller, Option, VerifyCost, padded_drafted, verify_x
from dspark.llm.speculative.predictor import AcceptancePredictor, along, features
from dspark.llm.speculative.verify import head_rows


def test_the_controllers_view_of_a_draft_matches_the_predictor_at_every_position() -> None:
    """DeepSpec's controller extrapolates the position term along a draft; up to the largest max_k
    that must be what the predictor itself would say (a capped position feature once made the two
    disagree past 16 tokens)."""
    pred = AcceptancePredictor(1)
    rng = random.Random(0)
    for _ in range(400):  # acceptance falling with the position, so the position weights are non-zero
        pos = rng.randint(1, 64)
        x = features(0.8, 0.7, pos, 0.3, 300, run=5)
        pred.observe(0, x, pred.predict(0, x), rng.random() < 0.95 - 0.01 * pos)
    w = pred.models[0].w
    dz, dlog = along(w)
    assert dz != 0 and dlog != 0
    x1 = features(0.8, 0.7, 1, 0.3, 300, run=5)
    o = Option(0, None, n=64, z0=sum(a * b for a, b in zip(w, x1)), dz=dz, dlog=dlog)
    for j in range(64):
        assert o.acc(j) == pytest.approx(pred.predict(0, features(0.8, 0.7, j + 1, 0.3, 300, run=5)), abs=1e-9)


def _controller(step_ms: float, per_token_ms: float, draft_ms_per_pos: float, per_row_ms: float = 0.2) -> Controller:
    verify = RLS([step_ms, per_row_ms, per_token_ms, 0.3, 0.05, 0.0], [1.0] * 6)
    draft = RLS([0.05, draft_ms_per_pos, 0.0, 0.0], [1.0] * 4)
    lookup = RLS([0.0, 0.0, 0.0, 0.01], [1.0] * 4)
    return Controller(verify, [draft, lookup])


def test_controller_turns_speculation_off_when_it_cannot_pay() -> None:
    c = _controller(step_ms=5.0, per_token_ms=0.8, draft_ms_per_pos=1.0)
    low = c.choose([[Option(0, [0.03] * 8)]])
    assert low.choices[0].k == 0 and low.rate == low.plain_rate
    # A drafter as slow as the target itself: no acceptance makes it worth it.
    slow = _controller(step_ms=5.0, per_token_ms=0.8, draft_ms_per_pos=5.0)
    assert slow.choose([[Option(0, [0.75] * 8)]]).choices[0].k == 0


def test_controller_drafts_when_it_pays_and_more_for_more_acceptance() -> None:
    c = _controller(step_ms=5.0, per_token_ms=0.8, draft_ms_per_pos=1.0)
    mid = c.choose([[Option(0, [0.7] * 8)]]).choices[0]
    high = c.choose([[Option(0, [0.95] * 8)]]).choices[0]
    assert 0 < mid.k < high.k and high.drafter == 0
    # A free lookup draft beats the model draft at equal acceptance, and its length bounds k.
    both = c.choose([[Option(0, [0.8] * 8), Option(1, [0.8] * 3, sunk=True)]]).choices[0]
    assert both.drafter == 1 and both.k == 3


def test_controller_speculates_less_in_big_batches() -> None:
    # Per decode row the step costs 0.8 ms: at 32 rows a drafted token costs nearly a row's full price.
    c = _controller(step_ms=5.0, per_token_ms=0.8, draft_ms_per_pos=0.3, per_row_ms=0.8)
    one = c.choose([[Option(0, [0.6] * 8)]])
    many = c.choose([[Option(0, [0.6] * 8)] for _ in range(32)])
    assert one.choices[0].k > 0
    assert sum(ch.k for ch in many.choices) / 32 < one.choices[0].k


def test_verify_cost_tells_a_steps_fixed_cost_from_draftings_when_nearly_every_step_drafts() -> None:
    # Truth: a plain step 5 ms, drafting adds 1.5 ms per verify chunk, 0.25 ms per drafted token, 0.1 ms
    # per head row. One sequence, so every drafted step has B = 1 and M = 1; one step in ten is plain.
    cost = VerifyCost([8.0, 0.3, 0.2, 0.0, 0.1, 0.1], [4.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    rng = random.Random(0)
    for i in range(600):
        k = 0 if i % 10 == 0 else rng.randint(1, 32)
        h = k if k < 16 else rng.choice([7, k])
        truth = 5.0 + (1.5 + 0.25 * k + 0.1 * h if k else 0.0)
        cost.update(verify_x(1, k, 1 if k else 0, 0, h), truth * (1 + 0.02 * rng.uniform(-1, 1)))
    plain = cost.predict(verify_x(1, 0, 0, 0))
    assert plain == pytest.approx(5.0, rel=0.05)
    assert cost.predict(verify_x(1, 1, 1, 0, 1)) - plain == pytest.approx(1.85, abs=0.25)
    assert cost.predict(verify_x(1, 32, 1, 0, 7)) == pytest.approx(5.0 + 1.5 + 8.0 + 0.7, rel=0.05)
    # Prefill's per-token coefficient follows what a prefill step cost beyond the decode part.
    for _ in range(40):
        cost.update_prefill(verify_x(0, 0, 0, 100), 5.0 + 100 * 0.3)
    assert cost.theta[4] == pytest.approx(0.3, rel=0.05)


def test_the_controller_stops_a_draft_before_a_pair_that_breaks() -> None:
    verify = RLS([5.0, 0.3, 0.25, 1.0, 0.05, 0.0], [1.0] * 6)
    lookup = RLS([0.0, 0.0, 0.0, 0.01], [1.0] * 4)
    c = Controller(verify, [lookup])
    plain = c.choose([[Option(0, None, sunk=True, n=16, z0=3.0)]]).choices[0]
    extra = [0.0] * 16
    extra[5] = -8.0  # the sixth token follows a pair that broke every time it was drafted
    stopped = c.choose([[Option(0, None, sunk=True, n=16, z0=3.0, extra=extra)]]).choices[0]
    assert plain.k > 6 and stopped.k == 5


@pytest.mark.parametrize("pad", [None, row_bucket], ids=["exact rows", "row buckets"])
def test_the_controller_finds_the_best_drafter_and_length_for_one_sequence(pad: Any) -> None:
    # Brute force over every (drafter, k): the controller's plan must reach the best predicted rate.
    # Its curves stop at the first token that cannot pay at the lowest rate it prices at, which
    # must never cut off the best choice (long drafts' head rows make the cost non-monotone in k,
    # and so do row buckets: a 33-row verification costs 40 rows, the 34th to 40th come free).
    rng = random.Random(4)
    for _ in range(300):
        verify = RLS([5.0 + 3 * rng.random(), 0.3, 0.2 + 0.2 * rng.random(), 0.5 + rng.random(), 0.05,
                      0.2 * rng.random()], [1.0] * 6)
        lookup = RLS([0.0, 0.0, 0.0, 0.01], [1.0] * 4)
        model = RLS([0.05, 0.3 + 2 * rng.random(), 0.0, 0.0], [1.0] * 4)
        a_look = [min(0.999, max(0.01, rng.gauss(0.8, 0.2))) for _ in range(40)]
        a_model = [min(0.999, max(0.01, rng.gauss(0.5, 0.2))) for _ in range(40)]
        opts = [Option(0, a_look, sunk=True), Option(1, a_model)]
        plan = Controller(verify, [lookup, model], head_block=8, pad=pad).choose([opts])
        best = 1.0 / verify.predict(verify_x(1, 0, 0, 0))
        for o in opts:
            assert o.a is not None
            reach, cum, p = math.prod(o.a[:8]), 0.0, 1.0
            for k in range(1, 41):
                p *= o.a[k - 1]
                cum += p
                rows = k if pad is None else pad(1 + k) - 1
                t = verify.predict(verify_x(1, rows, 1, 0, head_rows(k, reach, 8)))
                t += 0.0 if o.sunk else model.predict([1.0, k, k, 1.0])
                best = max(best, (1 + cum) / t)
        assert plan.rate == pytest.approx(best, rel=1e-5)


def test_alone_a_draft_is_priced_at_the_rows_its_verification_is_padded_to() -> None:
    # Packed projections run a step's rows padded to a bucket: 33 rows cost 40. A 32-token draft
    # (33 rows) then costs 7 rows more than a 31-token one for one more token; priced by tokens
    # the controller takes 32, priced by rows 31.
    verify = RLS([5.0, 0.3, 0.25, 1.0, 0.05, 0.02], [1.0] * 6)
    lookup = RLS([0.0, 0.0, 0.0, 0.01], [1.0] * 4)
    loop = [[Option(0, [0.99] * 32, sunk=True)]]
    assert Controller(verify, [lookup], head_block=8).choose(loop).choices[0].k == 32
    assert Controller(verify, [lookup], head_block=8, pad=row_bucket).choose(loop).choices[0].k == 31
    assert padded_drafted(row_bucket, 1, 32) == 39 and padded_drafted(row_bucket, 1, 31) == 31
    assert padded_drafted(None, 1, 32) == 32 and padded_drafted(row_bucket, 4, 0) == 0


def test_in_a_batch_drafts_are_priced_at_the_rate_the_engine_sustains() -> None:
    # Two sequences in long loops make the step's own predicted rate high; priced at it, nobody
    # else's draft pays. Priced at the engine's sustained rate, the others draft too. Alone, a
    # sequence is priced at its step's own rate whatever the sustained rate.
    verify = RLS([8.0, 0.6, 0.3, 0.1, 0.05, 0.1], [1.0] * 6)
    c = Controller(verify, [RLS([0.0, 0.0, 0.0, 0.01], [1.0] * 4)], head_block=8)
    loops = [[Option(0, [0.99] * 32, sunk=True)] for _ in range(2)]
    others = [[Option(0, [0.75] * 8, sunk=True)] for _ in range(6)]
    own = c.choose(loops + others)
    assert [x.k for x in own.choices] == [32, 32, 0, 0, 0, 0, 0, 0]
    sustained = c.choose(loops + others, rate=1.3 * own.plain_rate)
    assert [x.k for x in sustained.choices[:2]] == [32, 32] and all(x.k > 0 for x in sustained.choices[2:])
    assert sustained.rate > own.plain_rate  # still a step faster than a plain one
    alone = c.choose(others[:1])
    for r in (0.1 * alone.plain_rate, 10 * alone.plain_rate):
        assert c.choose(others[:1], rate=r).choices[0].k == alone.choices[0].k > 0


def test_the_controller_prices_head_rows_only_where_verification_computes_them() -> None:
    # A head row costs as much as a drafted token's layers. Blockwise verification computes a long
    # draft's rows past its first block only if that block held, so long drafts with a shaky start
    # cost less than with the head over every row, and the controller drafts longer for them.
    verify = RLS([5.0, 0.3, 0.25, 1.0, 0.05, 0.25], [1.0] * 6)
    lookup = RLS([0.0, 0.0, 0.0, 0.01], [1.0] * 4)
    shaky = [[Option(0, [0.5] + [0.95] * 31, sunk=True)]]
    whole = Controller(verify, [lookup]).choose(shaky).choices[0]
    blocks = Controller(verify, [lookup], head_block=8).choose(shaky).choices[0]
    assert blocks.k > whole.k > 0
    assert whole.head == whole.k and blocks.head == pytest.approx(head_rows(blocks.k, 0.5 * 0.95 ** 7, 8))


def test_verify_cost_recovers_from_a_plain_estimate_learned_in_a_slow_spell() -> None:
    # The plain part learned 12 ms in a slow spell; from then on every step drafts (plain steps would
    # correct it, but with drafting looking free none come). Drafted steps alone must bring it back.
    cost = VerifyCost([5.0, 0.0, 0.25, 1.5, 0.1, 0.1], [4.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    for _ in range(30):
        cost.update(verify_x(1, 0, 0, 0), 12.0)
    assert cost.predict(verify_x(1, 0, 0, 0)) > 9.0
    rng = random.Random(2)
    for _ in range(300):
        k = rng.randint(1, 32)
        cost.update(verify_x(1, k, 1, 0, k), 5.0 + 1.5 + 0.35 * k)
    assert cost.predict(verify_x(1, 0, 0, 0)) < 6.5
    assert cost.predict(verify_x(1, 8, 1, 0, 8)) == pytest.approx(5.0 + 1.5 + 0.35 * 8, rel=0.1)
