"""Whether DeepSpec's proposals pay against plain decoding at the batch's size (dspark.llm.speculative.runs.pays):
the yields are recorded figures here, so no test depends on how fast this machine steps."""

from __future__ import annotations

from dspark.llm.speculative.runs.pays import EXPLORE_AFTER, EXPLORE_STEPS, MAX_DOUBLINGS, Yields


def test_proposals_that_yield_less_than_runs_back_off_doubling_and_one_that_pays_ends_it() -> None:
    y = Yields()
    y.run(4, tokens=40, ms=10.0, steps=10)  # runs at 4 sequences: 4 tokens a ms
    owed = []
    for _ in range(MAX_DOUBLINGS + 2):
        y.proposal(4, tokens=6, ms=3.0)  # 2 a ms
        owed.append(y.owed)
        y.run(4, tokens=4 * owed[-1], ms=float(owed[-1]), steps=owed[-1])
        assert y.owed == 0  # the run took what was owed: the next step proposes
    assert owed == [2, 4, 8, 16, 32, 32, 32]
    for _ in range(12):  # drafts that hold: the moving average climbs past the runs' yield
        y.proposal(4, tokens=40, ms=4.0)
    assert y.backoff == 0 and y.owed == 0


def test_plain_steps_where_no_run_can_go_pay_what_is_owed_one_at_a_time_and_are_measured() -> None:
    y = Yields()
    y.plain_step(8, tokens=8, ms=4.0)  # plain decoding at 8 sequences: 2 tokens a ms
    y.proposal(8, tokens=9, ms=6.0)  # 1.5 a ms
    assert y.owed == 2
    y.plain_step(8, tokens=8, ms=4.0)
    assert y.owed == 1
    y.plain_step(8, tokens=8, ms=4.0)
    assert y.owed == 0
    y.plain_step(8, tokens=0, ms=9.0)  # a step with a prefill in it: owed nothing more, measures nothing
    assert y.ran[8] == 2.0


def test_a_batch_size_without_a_measured_run_is_explored_after_some_proposals() -> None:
    y = Yields()
    y.run(3, tokens=30, ms=10.0, steps=10)
    for i in range(EXPLORE_AFTER):
        assert y.explore() == 0, i
        y.proposal(5, tokens=6, ms=3.0)
    assert y.explore() == EXPLORE_STEPS and y.owed == 0  # nothing measured at 5 sequences yet
    y.run(5, tokens=10, ms=2.0, steps=2)
    assert y.explore() == 0 and y.ran[5] == 5.0


def test_a_larger_batchs_plain_decoding_bounds_a_smaller_ones_from_below() -> None:
    y = Yields()
    y.run(8, tokens=80, ms=20.0, steps=10)  # 4 tokens a ms at 8 sequences: at least 2 a ms at 4
    y.proposal(4, tokens=5, ms=5.0)  # 1 a ms: less than plain decoding can yield at 4, without measuring it there
    assert y.owed == 2
    y.run(4, tokens=8, ms=2.0, steps=2)
    y.proposal(6, tokens=20, ms=5.0)  # 4 a ms: above the bound (3 a ms) from 8 sequences; 4 says nothing of 6
    assert y.owed == 0 and 6 not in y.ran


def test_a_lone_sequence_is_not_weighed_here() -> None:
    y = Yields()
    y.run(1, tokens=10, ms=1.0, steps=10)
    for _ in range(EXPLORE_AFTER + 4):
        y.proposal(1, tokens=1, ms=5.0)  # far below its runs, yet its way is the replay's (copy runs)
        assert y.owed == 0 and y.explore() == 0
    assert 1 not in y.proposed


def test_state_round_trips_and_a_loaded_one_owes_nothing() -> None:
    y = Yields()
    y.run(4, tokens=40, ms=10.0, steps=10)
    y.proposal(4, tokens=6, ms=3.0)
    assert y.owed == 2
    z = Yields()
    z.load(y.state())
    assert z.state() == y.state() and z.owed == 0
    z.proposal(4, tokens=6, ms=3.0)
    assert z.owed == 2
