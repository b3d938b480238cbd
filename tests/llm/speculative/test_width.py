"""A lone sequence's step width where a change of the step's shape costs (controller.keep_width): the
controller keeps the previous step's rows with filler when that beats paying the change, pays filler
only up to one change's price, and the engine's tokens stay plain decoding's with the filler verified
like drafted tokens but never counted or learned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spec_testutil import GREEDY_LENS, _greedy, _prompts

from dspark.llm import LLM
from dspark.llm.speculative.controller import RLS, Controller, Option


def _controller(change_ms: float, per_row_ms: float = 0.05) -> Controller:
    # A plain step of 1 ms, each drafted row 0.05 ms, a verify chunk 0.02 ms; a lookup costs nothing.
    verify = RLS([0.8, 0.2, per_row_ms, 0.02, 0.0, 0.0], [1.0] * 6)
    return Controller(verify, [RLS([0.0, 0.0, 0.0, 0.0], [1.0] * 4)], change_ms=change_ms)


def test_a_short_draft_is_padded_to_the_previous_steps_rows_when_a_change_costs_more() -> None:
    look = [[Option(0, [0.9] * 3, sunk=True)]]
    free = _controller(change_ms=0.0).choose(look, prev_rows=8)
    assert free.choices[0].k == 3 and free.width == 0
    kept = _controller(change_ms=0.7).choose(look, prev_rows=8)
    assert kept.choices[0].k == 3 and kept.width == 8  # 4 filler rows (0.2 ms) beat the change (0.7 ms)
    # Already at the draft's own rows: nothing to pad.
    same = _controller(change_ms=0.7).choose(look, prev_rows=4)
    assert same.choices[0].k == 3 and same.width == 0
    # Keeping 32 rows for a 3-token draft costs more than the change: the step changes.
    wide = _controller(change_ms=0.7).choose(look, prev_rows=33)
    assert wide.choices[0].k == 3 and wide.width == 0


def test_a_draft_longer_than_the_previous_width_pays_the_change_only_when_it_earns_it() -> None:
    c = _controller(change_ms=0.7)
    sure = c.choose([[Option(0, [0.99] * 12, sunk=True)]], prev_rows=4)
    assert sure.choices[0].k == 12 and sure.width == 0
    # At 40% acceptance the tokens past the third do not earn the change: three tokens at the old width.
    unsure = c.choose([[Option(0, [0.4] * 12, sunk=True)]], prev_rows=4)
    assert unsure.choices[0].k == 3 and unsure.width == 0


def test_filler_alone_keeps_the_width_only_until_it_has_cost_one_change() -> None:
    c = _controller(change_ms=1.0)  # filler of 5 rows: 0.27 ms a step
    widths, prev = [], 6
    for _ in range(5):
        widths.append(c.choose([[]], prev_rows=prev).width)
        prev = widths[-1] or 1  # a step of no draft and no filler is one row
    assert widths == [6, 6, 6, 0, 0]
    assert c.filler_ms == 0.0
    # A step that drafts again starts a new run of rent.
    assert c.choose([[Option(0, [0.9] * 3, sunk=True)]], prev_rows=6).width == 6
    assert c.choose([[]], prev_rows=6).width == 6
    assert c.choose([[]], prev_rows=1).width == 0  # at one row there is nothing to keep


def test_padded_steps_decode_as_plain_and_filler_is_neither_counted_nor_learned(
        spec_llm: Callable[..., LLM], plain_outputs: list[list[int]]) -> None:
    llm = spec_llm({"drafters": ["prompt-lookup"]}, max_batch_size=1)
    spec = llm.engine.spec
    assert spec is not None and spec.controller is not None
    spec.change_ms = spec.controller.change_ms = 50.0  # a change dearer than any padding here
    verify = spec.verify
    rows = real = filler_only = 0

    def seen(prop: Any, *a: Any) -> None:
        nonlocal rows, real, filler_only
        for d in prop.pend.values():
            rows, real = rows + len(d.tokens), real + d.drafted
            filler_only += d.real == 0
        verify(prop, *a)

    spec.verify = seen  # type: ignore[method-assign]
    for prompt, n, want in zip(_prompts(), GREEDY_LENS, plain_outputs):
        assert llm.generate([prompt], _greedy(n))[0].token_ids == want
    stats = llm.stats()
    assert real > 0 and stats.spec_draft_tokens == real  # drafted tokens counted, filler not
    assert rows > real and filler_only > 0  # steps were padded, some with filler alone
    assert stats.spec_accepted_tokens <= stats.spec_draft_tokens


def test_a_fixed_configuration_verifies_its_k_every_step_where_a_change_costs(
        spec_llm: Callable[..., LLM], plain_outputs: list[list[int]]) -> None:
    k = 4
    llm = spec_llm({"strategy": "fixed", "drafters": ["prompt-lookup"], "num_speculative_tokens": k},
                   max_batch_size=1)
    spec = llm.engine.spec
    assert spec is not None and "shape_change_ms" in spec.calibration  # measured at startup
    spec.change_ms = 50.0
    runner = llm.engine.runner
    step = runner.step
    rows: list[int] = []

    def counted(cache: Any, chunks: Any, exit_layer: int | None = None) -> Any:
        rows.append(sum(len(c.token_ids) for c in chunks))
        return step(cache, chunks, exit_layer)

    runner.step = counted  # type: ignore[method-assign]
    for prompt, n, want in zip(_prompts(), GREEDY_LENS, plain_outputs):
        rows.clear()
        assert llm.generate([prompt], _greedy(n))[0].token_ids == want
        # After the prompt's prefill every step verifies k tokens, drafted or filler, fewer only where
        # max_tokens leaves less room (which only shrinks): without the filler, steps with nothing to
        # copy would take one row between wider ones.
        decode = rows[1:]
        assert decode and decode[0] == 1 + min(k, n - 2), (n, decode)
        assert decode == sorted(decode, reverse=True), (n, decode)
