"""The engine sequences behind one HTTP request (prompts x n), merged into one event stream.

Each sequence streams from the engine in a task of its own, and a watcher
task waits for the client to go away. ``close()`` -- on normal completion, an
error, a disconnect or a cancelled handler -- cancels those tasks; the engine's
async generator then aborts every unfinished sequence, which frees its KV pages.

Each sequence's :class:`~dspark.server.metrics.SequenceTimer` is also kept in
the request's ASGI state (``scope["state"]["sequence_timers"]``): the
observability middleware turns them into the request's trace spans once the
response has ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request

from dspark.llm import RequestOutput, SamplingParams
from dspark.llm.api import EngineClient
from dspark.server.metrics import ServerMetrics, SequenceTimer

TIMERS_KEY = "sequence_timers"  # in the ASGI scope's "state": every SequenceTimer of the request


@dataclass(frozen=True)
class SeqSpec:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class ClientGone(Exception):
    """The HTTP client disconnected; its sequences were aborted."""


class EngineUnavailable(RuntimeError):
    """The engine behind a sequence went away (a cluster replica died after the sequence had started)."""


class ShuttingDown(Exception):
    """The server is stopping and its drain time ran out before these sequences finished."""


_SHUTDOWN = object()  # queue sentinel: end the group's event stream with ShuttingDown


class SequenceGroup:
    def __init__(self, engine: EngineClient, metrics: ServerMetrics, request: Request, specs: list[SeqSpec],
                 arrival: float | None = None) -> None:
        # Validate every sequence before starting any (raises ValueError), so a bad one leaves nothing running.
        for s in specs:
            engine.inputs.make_sequence(s.request_id, s.prompt_ids, s.params)
        self.engine, self.metrics, self.request, self.specs = engine, metrics, request, specs
        self.arrival = time.perf_counter() if arrival is None else arrival
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException] | object | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.disconnected = False
        self.on_close: list[Callable[[SequenceGroup], None]] = []  # run once, when the group closes
        self._closed = False
        self.timers: list[SequenceTimer] = []

    def start(self) -> SequenceGroup:
        self.timers = [self.metrics.sequence(len(s.prompt_ids), self.arrival) for s in self.specs]
        scope = getattr(self.request, "scope", None)
        if isinstance(scope, dict):  # for the observability middleware (trace spans)
            scope.setdefault("state", {}).setdefault(TIMERS_KEY, []).extend(self.timers)
        self._tasks = [asyncio.create_task(self._run(i, s)) for i, s in enumerate(self.specs)]
        self._tasks.append(asyncio.create_task(self._watch()))
        return self

    async def _run(self, i: int, spec: SeqSpec) -> None:
        timer = self.timers[i]
        try:
            async for out in self.engine.generate(spec.prompt_ids, spec.params, request_id=spec.request_id):
                timer.update(out)
                self._queue.put_nowait((i, out))
        except Exception as e:  # an engine fault: the consumer decides how to report it
            self._queue.put_nowait((i, e))
        finally:
            timer.finish("abort")  # no-op when it finished normally

    async def _watch(self) -> None:
        # The body has been read, so the next ASGI message is the disconnect (or the end of the response).
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.disconnected = True
        for t in self._tasks[:-1]:
            t.cancel()
        self._queue.put_nowait(None)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(sequence index, output) as they come, until every sequence finished; closes the group."""
        left = len(self.specs)
        try:
            while left:
                item = await self._queue.get()
                if item is None:
                    raise ClientGone()
                if item is _SHUTDOWN:
                    raise ShuttingDown()
                i, out = item  # type: ignore[misc]
                if isinstance(out, BaseException):
                    raise out
                left -= out.finished
                yield i, out
        finally:
            self.close()

    async def finals(self) -> list[RequestOutput]:
        """The final output of every sequence, in order."""
        last: dict[int, RequestOutput] = {}
        async for i, out in self.events():
            last[i] = out
        return [last[i] for i in range(len(self.specs))]

    def shutdown(self) -> None:
        """End the event stream now with :class:`ShuttingDown` (the server's drain time is over)."""
        self._queue.put_nowait(_SHUTDOWN)

    def close(self) -> None:
        # Synchronous on purpose: it may run inside a cancelled task, where awaiting is not possible.
        for t in self._tasks:
            t.cancel()
        if not self._closed:
            self._closed = True
            for cb in self.on_close:
                cb(self)
