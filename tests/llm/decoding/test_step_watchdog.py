"""The watchdog of steps run on the engine's own thread (decoders that offer ``cancel``, API 1.11)."""

from __future__ import annotations

import threading

from dspark.llm.decoding.watchdog import Watchdog


def test_a_step_past_its_deadline_is_cancelled_once_and_one_disarmed_in_time_is_not() -> None:
    dog = Watchdog()
    fired = threading.Event()
    calls: list[str] = []

    def cancel(name: str) -> None:
        calls.append(name)
        fired.set()

    on_time = dog.arm(30.0, lambda: cancel("on time"), "on-time@cpu")
    late = dog.arm(0.2, lambda: cancel("late"), "late@cpu")  # earlier than the deadline the monitor sleeps to
    assert fired.wait(30.0), "the late step was never cancelled"
    assert dog.disarm(late) is True
    assert dog.disarm(on_time) is False
    assert calls == ["late"]


def test_a_cancel_that_raises_still_counts_as_fired() -> None:
    dog = Watchdog()
    called = threading.Event()

    def broken() -> None:
        called.set()
        raise RuntimeError("cannot cancel")

    token = dog.arm(0.05, broken, "broken@cpu")
    assert called.wait(30.0)
    assert dog.disarm(token) is True  # marked fired before cancel ran: the step is charged as timed out
