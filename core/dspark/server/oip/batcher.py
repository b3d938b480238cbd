"""One model's scheduler: a queue, Triton's dynamic batching, and the instances that run the batches.

Semantics (Triton's docs/user_guide/batcher.md is the anchor):

- When an instance is idle, a batch is formed from the queue in arrival order.
  Requests are combined along dim 0 up to ``max_batch_size`` rows, and only
  while their other dims and dtypes agree: the first request that differs
  ends the batch (it heads the next one), so order is kept.
- If a prefix of the queue adds up to a ``preferred_batch_size``, the largest
  such batch is sent at once; a batch of ``max_batch_size`` rows (or one that
  cannot grow) is sent at once too.
- Otherwise the batch waits while its oldest request has waited less than
  ``max_queue_delay_microseconds`` (0: no wait), then goes as it is.
- Without ``dynamic_batching``, every request runs on its own.
- Each instance is one worker thread (``instance_count``); the model runs off
  the event loop, and the outputs are split back by each request's rows.
- Draining (:meth:`Batcher.flush`): no request can join a batch any more, so
  what is queued is sent without waiting out the delay.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark.host.log import get_logger
from dspark.server.oip.config import DynamicBatching
from dspark.server.oip.errors import OipError
from dspark.server.oip.stats import Execution, ModelStats

log = get_logger("dspark.server.oip")

# Runs the model on a feed (input name -> array): every output, in the model's order.
Runner = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


@dataclass(eq=False)
class Job:
    inputs: dict[str, np.ndarray]
    rows: int  # dim-0 size (1 for a model that is not batched)
    key: tuple[Any, ...]  # what must agree for requests to share a batch: dtypes and non-batch dims
    future: asyncio.Future[list[np.ndarray]]
    enqueued_ns: int = field(default_factory=time.monotonic_ns)


def batch_key(inputs: dict[str, np.ndarray]) -> tuple[Any, ...]:
    return tuple((n, a.dtype.str, a.shape[1:]) for n, a in sorted(inputs.items()))


class Batcher:
    def __init__(self, run: Runner, *, name: str, stats: ModelStats, max_batch_size: int = 0,
                 dynamic: DynamicBatching | None = None, instance_count: int = 1) -> None:
        self.run, self.name, self.stats = run, name, stats
        self.max_batch_size, self.dynamic, self.instance_count = max_batch_size, dynamic, instance_count
        self._delay_ns = dynamic.max_queue_delay_microseconds * 1000 if dynamic is not None else 0
        self._preferred = sorted(dynamic.preferred_batch_size, reverse=True) if dynamic is not None else []
        self._queue: deque[Job] = deque()
        self._flushing = self._closed = False
        self._wake: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._task: asyncio.Task[None] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        """Start scheduling; call from the event loop that will serve the requests."""
        self._wake, self._slots = asyncio.Event(), asyncio.Semaphore(self.instance_count)
        self._pool = ThreadPoolExecutor(max_workers=self.instance_count, thread_name_prefix=f"oip-{self.name}")
        self._task = asyncio.get_running_loop().create_task(self._schedule(), name=f"oip-batcher-{self.name}")

    def submit(self, inputs: dict[str, np.ndarray], rows: int) -> asyncio.Future[list[np.ndarray]]:
        """Queue one request (already validated); the future gets its outputs, in the model's order.

        Setting the future's result or exception from outside (a drain ending it, a cancelled caller) takes
        the request out: a queued one is dropped, a running one's outputs are discarded."""
        if self._closed or self._wake is None:
            raise OipError(503, f"model '{self.name}' is not accepting requests")
        job = Job(inputs, rows, batch_key(inputs), asyncio.get_running_loop().create_future())
        self._queue.append(job)
        self.stats.enqueued()
        self._wake.set()
        return job.future

    def flush(self) -> None:
        """Send what is queued without waiting for batch partners (the server is draining)."""
        self._flushing = True
        if self._wake is not None:
            self._wake.set()

    async def close(self) -> None:
        """Fail what is still queued, let running batches end, stop the instances."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        left = list(self._queue)
        self._queue.clear()
        self.stats.dequeued([time.monotonic_ns() - j.enqueued_ns for j in left])
        self._fail(left, OipError(503, "the server shut down before the request ran"))
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown, True)

    # -- scheduling (event loop) -------------------------------------------------

    async def _schedule(self) -> None:
        assert self._slots is not None
        while True:
            await self._slots.acquire()  # an idle instance: only then is a batch formed (it may grow meanwhile)
            try:
                batch = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            self._dispatch(batch)

    async def _next_batch(self) -> list[Job]:
        assert self._wake is not None
        while True:
            self._prune()
            if not self._queue:
                await self._wait(None)
                continue
            if self.dynamic is None:
                return self._pop(1)
            count, full = self._candidates()
            preferred = self._preferred_cut(count)
            if preferred:
                return self._pop(preferred)
            if full or self._flushing or self._delay_ns == 0:
                return self._pop(count)
            left_ns = self._queue[0].enqueued_ns + self._delay_ns - time.monotonic_ns()
            if left_ns <= 0:
                return self._pop(count)
            await self._wait(left_ns / 1e9)

    async def _wait(self, timeout: float | None) -> None:
        assert self._wake is not None
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _prune(self) -> None:
        """Drop requests whose caller is gone (a cancelled RPC) or that were ended by the drain."""
        if any(j.future.done() for j in self._queue):
            gone = [j for j in self._queue if j.future.done()]
            self._queue = deque(j for j in self._queue if not j.future.done())
            self.stats.dequeued([time.monotonic_ns() - j.enqueued_ns for j in gone])

    def _candidates(self) -> tuple[int, bool]:
        """How many queued requests (from the head, which always goes) can share a batch; whether it is full."""
        head = self._queue[0]
        count, rows = 1, head.rows
        for job in itertools.islice(self._queue, 1, None):
            if job.key != head.key or rows + job.rows > self.max_batch_size:
                return count, True  # the next request cannot join: this batch cannot grow
            count, rows = count + 1, rows + job.rows
        return count, rows >= self.max_batch_size

    def _preferred_cut(self, count: int) -> int:
        """The number of requests forming the largest preferred batch size, 0 if none can be formed."""
        if not self._preferred:
            return 0
        sums, total = {}, 0
        for i in range(count):
            total += self._queue[i].rows
            sums[total] = i + 1
        return next((sums[p] for p in self._preferred if p in sums), 0)

    def _pop(self, n: int) -> list[Job]:
        return [self._queue.popleft() for _ in range(n)]

    def _dispatch(self, batch: list[Job]) -> None:
        assert self._pool is not None and self._slots is not None
        now = time.monotonic_ns()
        self.stats.dequeued([now - j.enqueued_ns for j in batch])
        done = asyncio.get_running_loop().run_in_executor(self._pool, self._execute, batch)
        slots = self._slots

        def finish(f: asyncio.Future[list[list[np.ndarray]]]) -> None:
            slots.release()
            exc = OipError(503, "the server shut down while the request ran") if f.cancelled() else f.exception()
            if exc is not None:
                self._fail(batch, exc)
                return
            for job, outs in zip(batch, f.result()):
                if not job.future.done():
                    job.future.set_result(outs)

        done.add_done_callback(finish)

    @staticmethod
    def _fail(jobs: list[Job], exc: BaseException) -> None:
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(exc)

    # -- execution (an instance's thread) -----------------------------------------

    def _execute(self, batch: list[Job]) -> list[list[np.ndarray]]:
        t0 = time.perf_counter_ns()
        if len(batch) == 1:
            feed = batch[0].inputs
        else:
            feed = {n: np.concatenate([j.inputs[n] for j in batch]) for n in batch[0].inputs}
        t1 = time.perf_counter_ns()
        try:
            outs = self.run(feed)
        except OipError:
            raise
        except Exception as e:  # noqa: BLE001  (a model failure fails its batch's requests, not the server)
            log.warning("inference failed", model=self.name, requests=len(batch), error=f"{type(e).__name__}: {e}")
            raise OipError(500, f"model '{self.name}' failed to run: {type(e).__name__}: {e}") from None
        t2 = time.perf_counter_ns()
        per_job = [outs] if len(batch) == 1 else self._split(batch, outs)
        t3 = time.perf_counter_ns()
        rows = sum(j.rows for j in batch)
        self.stats.executed(Execution(len(batch), rows, t1 - t0, t2 - t1, t3 - t2))
        return per_job

    def _split(self, batch: list[Job], outs: list[np.ndarray]) -> list[list[np.ndarray]]:
        total = sum(j.rows for j in batch)
        for i, o in enumerate(outs):
            if o.ndim == 0 or o.shape[0] != total:
                raise OipError(500, f"model '{self.name}': output {i} has shape {list(o.shape)}, not {total} rows "
                                    "along dim 0: its outputs are not batched; serve it with max_batch_size: 0")
        per_job, start = [], 0
        for j in batch:
            per_job.append([o[start:start + j.rows] for o in outs])
            start += j.rows
        return per_job
