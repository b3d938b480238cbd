"""The dynamic batcher's rules, on their own: which queued requests share an execution, in which order,
and what each caller gets back. The model is a plain function (y = 2x) that records every batch it runs;
its first execution can be held until the test has queued what it wants, so the batches are deterministic.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from dspark.server.oip.batcher import Batcher
from dspark.server.oip.config import DynamicBatching
from dspark.server.oip.errors import OipError
from dspark.server.oip.stats import ModelStats

FOREVER_US = 600_000_000  # a queue delay no test waits out: only a full batch, a preferred size or a flush sends


class Doubler:
    """y = 2x; records each batch's shape. With ``hold``, the first execution waits for ``release()``."""

    def __init__(self, hold: bool = False, fail: bool = False) -> None:
        self.batches: list[tuple[int, ...]] = []
        self.started, self.gate, self.fail = threading.Event(), threading.Event(), fail
        if not hold:
            self.gate.set()

    def __call__(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.started.set()
        assert self.gate.wait(60), "the test never released the held execution"
        self.batches.append(feed["x"].shape)
        if self.fail:
            raise ValueError("the model broke")
        return [feed["x"] * 2]

    def release(self) -> None:
        self.gate.set()


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), 60))


def make(model: Doubler, max_batch_size: int = 4, dynamic: DynamicBatching | None = DynamicBatching(),
         instances: int = 1) -> Batcher:
    b = Batcher(model, name="t", stats=ModelStats("t"), max_batch_size=max_batch_size, dynamic=dynamic,
                instance_count=instances)
    b.start()
    return b


def rows(n: int, value: float, width: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.full((n, width), value, dtype=np.float32)}


async def hold_first(b: Batcher, model: Doubler) -> asyncio.Future[list[np.ndarray]]:
    """Occupy the only instance with a full batch (sent at once, whatever the delay; it runs once released)."""
    first = b.submit(rows(b.max_batch_size, -1), b.max_batch_size)
    assert await asyncio.to_thread(model.started.wait, 30), "the first request never ran"
    return first


def test_queued_requests_are_combined_up_to_max_batch_size_in_order() -> None:
    model = Doubler(hold=True)

    async def scenario() -> None:
        b = make(model, max_batch_size=4)
        first = await hold_first(b, model)
        futures = [b.submit(rows(1, i), 1) for i in range(6)]  # queued while the instance is busy
        model.release()
        outs = await asyncio.gather(first, *futures)
        for i, out in enumerate(outs[1:]):  # each caller gets its own row back
            np.testing.assert_array_equal(out[0], np.full((1, 2), 2 * i, np.float32))
        s = b.stats.snapshot()
        assert (s["execution_count"], s["inference_count"]) == (3, 10)
        assert {x["batch_size"]: x["compute_infer"]["count"] for x in s["batch_stats"]} == {4: 2, 2: 1}
        assert b.stats.pending == 0
        await b.close()

    run(scenario)
    assert [shape[0] for shape in model.batches] == [4, 4, 2]


def test_multi_row_requests_split_back_by_their_rows() -> None:
    model = Doubler(hold=True)

    async def scenario() -> None:
        b = make(model, max_batch_size=8)
        first = await hold_first(b, model)
        sizes = [3, 1, 2, 2]
        futures = [b.submit({"x": np.arange(n * 2, dtype=np.float32).reshape(n, 2) + 10 * i}, n)
                   for i, n in enumerate(sizes)]
        model.release()
        await first
        for i, (n, fut) in enumerate(zip(sizes, futures)):
            np.testing.assert_array_equal((await fut)[0], 2 * (np.arange(n * 2).reshape(n, 2) + 10 * i))
        await b.close()

    run(scenario)
    assert [shape[0] for shape in model.batches] == [8, 8]


def test_a_preferred_size_goes_at_once_the_rest_waits_for_the_delay() -> None:
    model = Doubler(hold=True)

    async def scenario() -> None:
        b = make(model, max_batch_size=8,
                 dynamic=DynamicBatching(preferred_batch_size=[2, 4], max_queue_delay_microseconds=FOREVER_US))
        first = await hold_first(b, model)
        futures = [b.submit(rows(1, i), 1) for i in range(5)]
        model.release()
        await asyncio.gather(first, *futures[:4])  # 4 rows: the largest preferred size that can be formed
        assert not futures[4].done()  # one row is no preferred size: it waits for partners (the delay)
        b.flush()  # what the drain does: nobody can join any more, send it
        await futures[4]
        await b.close()

    run(scenario)
    assert [shape[0] for shape in model.batches] == [8, 4, 1]


def test_requests_whose_other_dims_differ_are_not_combined_and_keep_their_order() -> None:
    model = Doubler(hold=True)

    async def scenario() -> None:
        b = make(model, max_batch_size=8)
        first = await hold_first(b, model)
        widths = [2, 2, 3, 2]
        futures = [b.submit(rows(1, i, width=w), 1) for i, w in enumerate(widths)]
        model.release()
        await first
        for i, (w, fut) in enumerate(zip(widths, futures)):
            np.testing.assert_array_equal((await fut)[0], np.full((1, w), 2 * i, np.float32))
        await b.close()

    run(scenario)
    assert model.batches == [(8, 2), (2, 2), (1, 3), (1, 2)]


def test_without_dynamic_batching_every_request_runs_alone() -> None:
    model = Doubler(hold=True)

    async def scenario() -> None:
        b = make(model, max_batch_size=8, dynamic=None)
        first = await hold_first(b, model)
        futures = [b.submit(rows(2, i), 2) for i in range(3)]
        model.release()
        await asyncio.gather(first, *futures)
        assert b.stats.snapshot()["execution_count"] == 4
        await b.close()

    run(scenario)
    assert [shape[0] for shape in model.batches] == [8, 2, 2, 2]


def test_a_model_failure_fails_every_request_of_its_batch_and_the_batcher_goes_on() -> None:
    model = Doubler(hold=True, fail=True)

    async def scenario() -> None:
        b = make(model, max_batch_size=4)
        first = await hold_first(b, model)
        futures = [b.submit(rows(1, i), 1) for i in range(2)]
        model.release()
        for fut in (first, *futures):
            with pytest.raises(OipError) as e:
                await fut
            assert e.value.status == 500 and "model 't' failed to run" in e.value.message
            assert "the model broke" in e.value.message
        model.fail = False
        out = await b.submit(rows(1, 5), 1)
        np.testing.assert_array_equal(out[0], np.full((1, 2), 10, np.float32))
        await b.close()

    run(scenario)


def test_close_fails_what_is_still_queued() -> None:
    model = Doubler(hold=True)

    async def scenario() -> None:
        b = make(model, max_batch_size=4, dynamic=DynamicBatching(max_queue_delay_microseconds=FOREVER_US))
        first = await hold_first(b, model)
        queued = b.submit(rows(1, 1), 1)
        closing = asyncio.ensure_future(b.close())
        with pytest.raises(OipError) as e:
            await queued
        assert e.value.status == 503
        model.release()
        await closing
        await first  # the batch that was running finished normally

    run(scenario)
