"""The replay of a lone greedy request's text (dspark.llm.speculative.runs.replay): what prompt lookup at a
fixed width would have made of it, and the way of decoding the next stretch it picks from that."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from dspark.builtin.prompt_lookup import PromptLookupDrafter
from dspark.llm.speculative.runs.replay import DECAY, GROW_MAX, KS, LEAD, MIN_TOKENS, STRETCH_TOKENS, Replay


def _steps(prompt: list[int], out: list[int], k: int) -> list[int]:
    """Tokens each copy step of k tokens drafted by prompt lookup makes over ``out``, from the drafter itself
    (its scan of the whole context, not the replay's index)."""
    drafter = PromptLookupDrafter()
    return _steps_of(lambda ids: list(drafter.propose(ids, k).tokens), prompt, out)


def _steps_of(draft: Callable[[list[int]], list[int]], prompt: list[int], out: list[int]) -> list[int]:
    """Tokens each copy step makes over ``out``: ``draft`` from the text so far, accepted up to its first
    token unlike the text, then the target's token; a step whose target token is not out yet is left."""
    ctx, made, p = list(prompt), [], 0
    while True:
        d = draft(ctx + out[:p])
        j = 0
        while j < len(d) and p + j < len(out) and d[j] == out[p + j]:
            j += 1
        if p + j >= len(out):
            return made
        made.append(j + 1)
        p += j + 1


def _decayed(made: list[int]) -> tuple[float, float]:
    tokens = steps = 0.0
    for m in made:
        tokens, steps = tokens * DECAY ** m + m, steps * DECAY ** m + 1.0
    return tokens, steps


def _texts() -> list[tuple[list[int], list[int]]]:
    rng = random.Random(7)
    loop = [5, 6, 7, 8, 9, 10]
    noisy = [rng.choice(loop) if rng.random() < 0.3 else t for t in loop * 30]
    return [(list(range(20)), [rng.randrange(40) for _ in range(150)]),  # little to copy
            (loop * 3, loop * 20 + [1, 2]),  # a loop the prompt already holds
            (list(range(30, 60)), list(range(30, 60)) * 3),  # the prompt typed again
            (loop * 2, noisy)]


@pytest.mark.parametrize("text", range(len(_texts())))
def test_the_replay_counts_what_copy_steps_would_have_made(text: int) -> None:
    prompt, out = _texts()[text]
    whole = Replay(prompt)
    whole.catch_up(prompt + out)
    pieces = Replay(prompt)  # the same text as it comes out, a few tokens at a time
    for end in range(0, len(out) + 1, 7):
        pieces.catch_up(prompt + out[:end])
    pieces.catch_up(prompt + out)
    for w, v in zip(whole.ways, pieces.ways):
        tokens, steps = _decayed(_steps(prompt, out, w.k))
        assert (w.tokens, w.steps) == pytest.approx((tokens, steps)), w.k
        assert (v.tokens, v.steps, v.pos) == (w.tokens, w.steps, w.pos)
    assert len(whole.drafts) <= max(KS) + 1  # drafts behind every way are dropped


def test_another_lookup_is_replayed_beside_prompt_lookup() -> None:
    """A store holding the text to come (suffix lookup after an earlier request said the same): its ways
    make all their drafted tokens a step, prompt lookup's do not, and the store's widest way is chosen."""
    prompt, out = list(range(20)), [random.Random(3).randrange(100, 140) for _ in range(80)]
    store = prompt + out

    def lookup(ids: list[int], k: int) -> list[int]:
        return store[len(ids):len(ids) + k]

    rep = Replay(prompt, others=[lookup])
    rep.catch_up(prompt + out)
    by = {(w.src, w.k): w for w in rep.ways}
    for k in KS:
        tokens, steps = _decayed(_steps_of(lambda ids, k=k: lookup(ids, k), prompt, out))
        assert (by[1, k].tokens, by[1, k].steps) == pytest.approx((tokens, steps))
        assert by[1, k].tokens / by[1, k].steps > by[0, k].tokens / by[0, k].steps
    assert rep.choose(lambda rows: 1.0 + 0.05 * rows) == (1, max(KS))


def test_it_chooses_copy_steps_where_they_cost_less_a_token() -> None:
    prompt, out = _texts()[1]
    rep = Replay(prompt)
    rep.catch_up(prompt + out[:4])
    assert rep.tokens < MIN_TOKENS and rep.choose(lambda rows: 1.0) is None  # too little replayed yet
    rep.catch_up(prompt + out)
    # A wider step costing little more, a looping text: the widest way makes the most tokens a step.
    assert rep.choose(lambda rows: 1.0 + 0.05 * rows) == (0, max(KS))
    # A step costing as much a row as a step of one row: no copy step makes that many tokens a step.
    assert rep.choose(lambda rows: float(rows) ** 2) == (0, 0)
    assert rep.choose(lambda rows: float(rows)) == (0, 0)  # at best as dear a token: plain, the way it is on


def test_text_with_little_to_copy_stays_plain() -> None:
    prompt, out = _texts()[0]
    rep = Replay(prompt)
    rep.catch_up(prompt + out)
    assert rep.choose(lambda rows: 1.0 + 0.2 * (rows - 1)) == (0, 0)


def test_a_change_of_way_pays_for_the_change_of_shape() -> None:
    prompt, out = _texts()[3]
    rep = Replay(prompt)
    rep.catch_up(prompt + out)
    cost = lambda rows: 1.0 + 0.1 * (rows - 1)  # noqa: E731
    best = rep.choose(cost)
    assert best is not None and best[1] > 0
    per_token = {(w.src, w.k): cost(1 + w.k) * w.steps / w.tokens for w in rep.ways}
    gain = cost(1) - per_token[best]
    # Back on plain steps, a change costing more than the gain over a stretch keeps them plain...
    rep.way = (0, 0)
    assert rep.choose(cost, change_ms=1.01 * gain * STRETCH_TOKENS) == (0, 0)
    # ... and one costing less does not.
    rep.way = (0, 0)
    assert rep.choose(cost, change_ms=0.99 * gain * STRETCH_TOKENS) == best


def test_greedy_stretches_grow_while_every_copy_way_trails() -> None:
    """Plain steps chosen while every copy way would have cost at least LEAD x theirs a token: each such choice
    doubles the next greedy stretch, up to GROW_MAX; a copy way within reach, or chosen, starts it over."""
    prompt, out = _texts()[0]  # little to copy: every copy way far behind
    rep = Replay(prompt)
    rep.catch_up(prompt + out)
    steep = lambda rows: float(rows) ** 2  # noqa: E731
    grows = []
    for _ in range(GROW_MAX.bit_length() + 1):
        assert rep.choose(steep) == (0, 0)
        grows.append(rep.grow)
    assert grows[0] == 2 and grows == [min(2 ** (i + 1), GROW_MAX) for i in range(len(grows))]
    assert grows[-1] == GROW_MAX > 2
    loop_prompt, loop = _texts()[1]
    near = Replay(loop_prompt)
    near.catch_up(loop_prompt + loop)
    near.grow = GROW_MAX
    # As dear a token as plain steps at best: plain is chosen, but a copy way is within LEAD of it.
    assert near.choose(lambda rows: float(rows)) == (0, 0)
    assert near.grow == 1
    per_token = min(float(1 + w.k) * w.steps / w.tokens for w in near.ways)
    assert per_token < LEAD
    near.grow = GROW_MAX
    assert near.choose(lambda rows: 1.0 + 0.05 * rows) == (0, max(KS)) and near.grow == 1  # a copy: over
