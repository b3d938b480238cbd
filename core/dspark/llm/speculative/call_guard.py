"""Calls into a third-party drafter with a deadline, from the engine's own thread.

A plugin's drafter runs inside every engine step, so a hung one would stall every request.
Its calls go to one persistent daemon worker thread per drafter (a thread per call would
cost more than a cheap lookup drafter does), and the engine waits at most ``timeout_s``.
On a timeout the worker is abandoned (a Python thread cannot be killed; being a daemon it
cannot keep the process alive) and every later call fails at once.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any


class DrafterTimeout(RuntimeError):
    """A guarded call did not return in time; the drafter is to be disabled."""


_Job = tuple[Callable[..., Any], tuple[Any, ...], list[Any], threading.Event]


def _serve(jobs: queue.SimpleQueue[_Job | None]) -> None:
    # A plain function, not a method: the worker must not keep its guard alive, so that a
    # dropped guard's finalizer can stop it.
    while (job := jobs.get()) is not None:
        fn, args, box, done = job
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller's thread
            box.append((False, exc))
        done.set()
        # Hold nothing of the finished call while waiting for the next: its result or traceback
        # would keep the guard (and what it guards) alive.
        del job, fn, args, box, done


class CallGuard:
    def __init__(self, name: str, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.hung: str | None = None  # what timed out, once something did
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=_serve, args=(self._jobs,), name=f"dspark-drafter-{name}",
                                        daemon=True)
        self._worker.start()
        self._close = weakref.finalize(self, self._jobs.put, None)  # the worker ends with its guard

    def close(self) -> None:
        """Let the worker end once it is idle (at once, unless a call hung)."""
        self._close()

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        label = getattr(fn, "__name__", "call")
        if self.hung is not None:
            raise DrafterTimeout(f"{self.name}: an earlier {self.hung} never returned")
        box: list[Any] = []
        done = threading.Event()
        self._jobs.put((fn, args, box, done))
        if not done.wait(self.timeout_s):
            self.hung = label
            raise DrafterTimeout(f"{label} did not return within {self.timeout_s:g} s")
        ok, value = box[0]
        if ok:
            return value
        raise value
