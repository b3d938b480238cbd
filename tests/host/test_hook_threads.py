"""Plugin calls under a deadline (dspark.host.hook_threads): queueing for the CPU benchmark lock is excused."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from dspark.host.hook_threads import IDLE_NAME, CallTimeout, call_with_timeout, retire_idle
from dspark.host.hostinfo import cpu_benchmark_lock


def _wait_for(cond: Any, deadline_s: float, what: str) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


def _queued_s(label: str) -> float:
    """How long the worker running ``label`` has been waiting on the lock (0 when it is not)."""
    worker = next((t for t in threading.enumerate() if t.name == f"dspark-hook-{label}"), None)
    since = None if worker is None else cpu_benchmark_lock.waited(worker.ident)[1]
    return 0.0 if since is None else time.perf_counter() - since


def _benchmark() -> int:
    with cpu_benchmark_lock:
        return 42


def test_time_queued_behind_another_benchmark_is_not_the_calls_own() -> None:
    got: dict[str, Any] = {}
    with cpu_benchmark_lock:  # another plugin's benchmark, running
        caller = threading.Thread(target=lambda: got.update(v=call_with_timeout(_benchmark, [], 0.2, "q.bid")))
        caller.start()
        # Queued three deadlines' worth: without the excuse the call would have failed after the first.
        _wait_for(lambda: _queued_s("q.bid") > 0.6, 30, "the call to queue for the lock")
    caller.join(30)
    assert got == {"v": 42}


def test_a_call_queued_behind_a_hung_call_still_times_out() -> None:
    hang = threading.Event()

    def hangs_holding_the_lock() -> None:
        with cpu_benchmark_lock:
            hang.wait(30)

    try:
        with pytest.raises(CallTimeout, match="h.bid did not return within 0.2 s"):
            call_with_timeout(hangs_holding_the_lock, [], 0.2, "h.bid")  # abandoned, the lock still held
        with pytest.raises(CallTimeout, match="w.bid did not return within 0.2 s"):
            call_with_timeout(_benchmark, [], 0.2, "w.bid")  # no excuse for waiting on an abandoned call
    finally:
        hang.set()
    _wait_for(lambda: not cpu_benchmark_lock.locked(), 30, "the hung call to let go of the lock")


def test_retired_idle_workers_end_and_take_their_thread_local_state_with_them() -> None:
    # What a worker's thread holds (an OpenMP team, here a thread-local value) ends with it; calls go on.
    local = threading.local()
    ended = threading.Event()

    class Held:
        def __del__(self) -> None:
            ended.set()

    def hold() -> threading.Thread:
        local.held = Held()
        return threading.current_thread()

    worker = call_with_timeout(hold, [], 30, "t.hold")
    assert worker is not threading.current_thread() and worker.name == IDLE_NAME  # back in the idle set
    assert retire_idle() >= 1
    assert ended.wait(30), "the retired worker's thread-local state outlived it"
    worker.join(30)
    assert not worker.is_alive(), "the retired worker did not end"
    assert call_with_timeout(lambda: 7, [], 30, "t.after") == 7  # a new worker
