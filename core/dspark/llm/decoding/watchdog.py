"""Deadlines for steps that run on the engine's own thread (decoders that can cancel a step, API 1.11).

A decoder that offers ``cancel()`` is not handed to a watchdog thread each step (two thread
wake-ups a step, which a small model's step time shows); the engine runs the step itself and
arms this watchdog, whose one monitor thread sleeps until the earliest armed deadline and calls
that step's ``cancel`` if it is still running then. Arming and disarming take a lock and a
dict entry; the monitor is woken only when a deadline earlier than the one it sleeps to is armed.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from dspark.host.log import get_logger

log = get_logger("dspark.llm.decoder")


class Watchdog:
    """Calls an armed step's ``cancel`` once its deadline passes, from a monitor thread of its own."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._armed: dict[int, list[Any]] = {}  # token -> [deadline, cancel, label, fired]
        self._ids = itertools.count()
        self._wake_at = math.inf
        self._thread: threading.Thread | None = None

    def arm(self, timeout_s: float, cancel: Callable[[], Any], label: str) -> int:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            token = next(self._ids)
            self._armed[token] = [deadline, cancel, label, False]
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="dspark-step-watchdog", daemon=True)
                self._thread.start()
            if deadline < self._wake_at:
                self._wake_at = deadline
                self._cv.notify()
        return token

    def disarm(self, token: int) -> bool:
        """Drop the step's deadline; True if it had passed and ``cancel`` was called."""
        with self._cv:
            entry = self._armed.pop(token, None)
        return bool(entry is not None and entry[3])

    def _loop(self) -> None:
        while True:
            due: list[tuple[Callable[[], Any], str]] = []
            with self._cv:
                now = time.monotonic()
                for entry in self._armed.values():
                    if not entry[3] and entry[0] <= now:
                        entry[3] = True
                        due.append((entry[1], entry[2]))
                self._wake_at = min((e[0] for e in self._armed.values() if not e[3]), default=math.inf)
                if not due:
                    self._cv.wait(None if self._wake_at == math.inf else self._wake_at - now)
                    continue
            for cancel, label in due:
                log.error("llm.decoder.step_cancelled", target=label, reason="past its deadline")
                try:
                    cancel()
                except Exception as exc:  # the step is charged as timed out either way
                    log.error("llm.decoder.cancel_failed", target=label, reason=f"{type(exc).__name__}: {exc}")


watchdog = Watchdog()
