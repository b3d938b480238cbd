"""Plugin calls under a timeout, on reusable worker threads.

Every hook call runs on a worker thread so the caller can stop waiting after
its timeout (a hung plugin cannot be killed, only abandoned). Starting a
thread per call cost more than a small bid does, and planning makes hundreds
of calls, so workers are kept: an idle one takes the next call; a call that
finds none starts one; a worker abandoned by a timeout rejoins the idle set
if its call ever returns. A worker is named ``dspark-hook-<plugin.hook>``
while it runs a call and ``dspark-hook-idle`` otherwise, so a process can
tell a hung plugin (``dspark.cli.main`` exits without waiting for it) from
an idle worker.

:func:`retire_idle` ends the idle workers, and with them whatever a runtime kept per thread: OpenMP
keeps a thread team per calling thread, torch and llama.cpp share one libgomp, and while a worker that
had run torch's parallel code (a device probe's benchmark) stayed alive, libgomp counted more threads
than cores, stopped spinning, and llama.cpp's decode step on the engine's thread took twice as long.
The engine retires them once built, and before it times the decoders.
"""

from __future__ import annotations

import _thread
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from dspark.host.hostinfo import cpu_benchmark_lock

IDLE_NAME = "dspark-hook-idle"
MAX_IDLE = 8  # idle workers kept; more exit once their call returns


class CallTimeout(Exception):
    """The call did not return within its timeout (its worker is abandoned)."""


class _Worker:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[..., Any], list[Any], dict[str, Any], _thread.LockType, str]
                                     | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=IDLE_NAME, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:  # retired
                return
            fn, args, box, done, label = job
            self.thread.name = f"dspark-hook-{label}"
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # re-raised in the caller's thread
                box["error"] = exc
            self.thread.name = IDLE_NAME
            with _lock:  # idle again before the caller wakes: its next call finds this worker
                _abandoned.discard(threading.get_ident())
                keep = len(_idle) < MAX_IDLE
                if keep:
                    _idle.append(self)
            done.release()
            if not keep:
                return


_lock = threading.Lock()
_idle: list[_Worker] = []
_abandoned: set[int] = set()  # workers whose call timed out and has not returned


def retire_idle() -> int:
    """End every idle worker (a later call starts a new one); returns how many. Busy workers are left alone."""
    with _lock:
        idle = list(_idle)
        _idle.clear()
    for w in idle:
        w.jobs.put(None)
    return len(idle)


def _excused(ident: int | None, before: float) -> float:
    """Seconds worker ``ident`` has waited on the CPU benchmark lock since its call began (its finished
    waits beyond ``before``, plus the current one unless the lock's holder is itself an abandoned call)."""
    waited, since = cpu_benchmark_lock.waited(ident)
    excused = waited - before
    if since is not None:
        with _lock:
            holder_hung = cpu_benchmark_lock.holder in _abandoned
        if not holder_hung:
            excused += time.perf_counter() - since
    return excused


def call_with_timeout(fn: Callable[..., Any], args: list[Any], timeout: float, label: str) -> Any:
    """``fn(*args)`` on a worker thread; its result, or its exception re-raised here, or
    :class:`CallTimeout` after ``timeout`` seconds, not counting the time the call waited on
    :data:`~dspark.host.hostinfo.cpu_benchmark_lock` behind another call that is still running."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = _Worker()
    box: dict[str, Any] = {}
    done = _thread.allocate_lock()  # a bare lock, released by the worker: a quarter of an Event's hand-off cost
    done.acquire()
    ident = worker.thread.ident
    before, _ = cpu_benchmark_lock.waited(ident)
    start = time.perf_counter()
    worker.jobs.put((fn, args, box, done, label))
    deadline = start + timeout
    while not done.acquire(timeout=max(0.0, deadline - time.perf_counter())):
        # Time the call spent queued for the CPU benchmark lock behind a live call is not its own.
        deadline = start + timeout + _excused(ident, before)
        if time.perf_counter() >= deadline:
            with _lock:
                _abandoned.add(ident or 0)
            raise CallTimeout(f"{label} did not return within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")
