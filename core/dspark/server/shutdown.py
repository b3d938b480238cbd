"""Graceful shutdown: uvicorn's server, told to drain before it stops.

At the first SIGTERM/SIGINT the server stops accepting connections, refuses
new generation requests on open ones (503), and gives the requests in flight
the drain time to finish. Whatever still runs then is ended in-band: a stream
gets an error event and ``[DONE]``, a plain request a 503. Only then does
uvicorn's own shutdown run (connections closed, the app's lifespan shutdown,
which stops the engine and frees the KV cache), so nothing is cut mid-write
and no task is cancelled from outside. A second signal skips the rest of the
drain.

The state it drains is any object with a ``draining`` flag and a ``groups``
collection of open requests, each with a ``shutdown()`` that ends it in-band;
``on_drain`` (optional) is called once as the drain starts, in the event loop,
for whatever else a server has to stop accepting (the OIP server's gRPC port).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from dspark.host.log import get_logger

log = get_logger("dspark.server")

FLUSH_S = 2.0  # after ending the remaining streams, how long their last events get to go out


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, drain_s: float,
                 on_drain: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self.state, self.drain_s, self.on_drain = state, drain_s, on_drain
        self._signals = 0
        self._drain: asyncio.Task[None] | None = None
        self._skip = asyncio.Event()  # set by a second signal: end the drain now

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between the loop's callbacks; the drain itself starts on the next tick.
        self._signals += 1
        if self._signals > 1:
            self._skip.set()
        if self._signals > 2:  # a third: uvicorn's own immediate exit
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._signals and self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        state = self.state
        state.draining = True
        if self.on_drain is not None:
            self.on_drain()
        for srv in getattr(self, "servers", []):
            srv.close()  # stop accepting; open connections are left to finish
        open_ = len(state.groups)
        log.info("Shutdown requested: draining open requests", open_requests=open_, drain_s=self.drain_s)
        deadline = time.monotonic() + self.drain_s
        while state.groups and time.monotonic() < deadline and not self._skip.is_set():
            try:
                await asyncio.wait_for(self._skip.wait(), timeout=0.05)
            except asyncio.TimeoutError:
                pass
        left = list(state.groups)
        if left:
            log.warning("drain time over: ending the requests still open", open_requests=len(left))
            for g in left:
                g.shutdown()
            flush_end = time.monotonic() + FLUSH_S
            while state.groups and time.monotonic() < flush_end:
                await asyncio.sleep(0.02)
        else:
            log.info("Drained: every open request finished", finished=open_)
        self.should_exit = True
