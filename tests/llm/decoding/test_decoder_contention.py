"""Decoder timings taken while other processes held the cores are kept only until a quieter start
(llm/decoding/choose.py, timing.BUSY), and the share is measured as other processes' CPU time (hostinfo)."""

from __future__ import annotations

import subprocess
import sys
import time
import weakref
from typing import Any

import psutil
import pytest
from decoder_testutil import MODEL, Counted

from dspark.host import hostinfo
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.llm.decoding import choose, timing
from dspark.llm.engine import LLMEngine

DEADLINE_S = 60.0


def _until(cond: Any, what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"no {what} within {DEADLINE_S} s")
        time.sleep(0.01)


def test_another_process_counts_as_busy_and_this_one_does_not() -> None:
    # A spinning child's CPU time is other processes' (whatever else the machine runs only adds to it); this
    # process's own spinning is in ``own``, which the share leaves out.
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        spin = psutil.Process(child.pid)

        def used() -> float:
            t = spin.cpu_times()
            return t.user + t.system

        before, a = used(), hostinfo.cpu_sample()
        _until(lambda: used() - before >= 0.3, "0.3 s of the child's CPU time")
        b = hostinfo.cpu_sample()
    finally:
        child.kill()
        child.wait()
    others = hostinfo.others_share(a, b) * (b.wall - a.wall) * b.cores
    assert others >= 0.3 - 0.02 * b.cores, (a, b)  # the clock ticks of /proc/stat: 10 ms a core
    a, end = hostinfo.cpu_sample(), time.monotonic() + DEADLINE_S
    while hostinfo.cpu_sample().own - a.own < 0.3:  # this process spins
        sum(range(100_000))
        assert time.monotonic() < end, "no 0.3 s of this process's CPU time"
    b = hostinfo.cpu_sample()
    assert b.busy - a.busy >= b.own - a.own - 0.02 * b.cores, (a, b)  # the machine's count holds this process's


def test_retime_only_busy_timings_at_a_start_quieter_by_half() -> None:
    assert timing.retime(0.6, 0.3) and timing.retime(0.3, 0.0)
    assert not timing.retime(0.6, 0.31)  # not quieter by half: timed again, it would rank on much the same load
    assert not timing.retime(timing.BUSY, 0.0)  # at or below BUSY: kept
    assert not timing.retime(None, 0.0)  # unknown: kept


def test_busy_timings_are_taken_again_at_a_quieter_start(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The target really compiles and runs its timing steps; the machine's contention while it is timed (and
    # when a start looks at it) is set here, as the recorded timings of test_decoder_retiming.py are.
    pytest.importorskip("openvino")
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DSPARK_BUSY_RETIME", "1")  # off for the rest of the suite (tests/conftest.py)
    real_time = choose.time_targets
    timed: list[int] = []
    share = {"now": 0.0}
    looked: list[float] = []

    def recorded(benches: dict[str, Any], shape_list: Any) -> dict[str, dict[str, float]]:
        timed.append(1)
        return real_time(benches, shape_list, reps=1, blocks=1, span_s=0)

    def others(a: Any, b: Any) -> float:
        return share["now"]

    real_now = timing.contention_now

    def now() -> float:
        looked.append(share["now"])
        return real_now(0.0)

    monkeypatch.setattr(choose, "time_targets", recorded)
    monkeypatch.setattr(hostinfo, "others_share", others)
    monkeypatch.setattr(choose, "contention_now", now)

    def start(busy: float) -> Any:
        share["now"] = busy
        host = PluginHost(PluginSettings(blocked={"npu", "cuda", "cpu", "llamacpp"}))
        host.register(Counted("one", weakref.WeakSet(), []), "one")
        host.load()
        e = LLMEngine.from_model(MODEL, dtype="float32", decoder="auto", plugin_host=host, max_batch_size=4)
        c = e.decoder_choice
        assert c is not None
        return {r["label"]: r for r in c.ranked}["one@cpu"]

    assert start(0.6)["busy"] == 0.6 and len(timed) == 1  # timed beside others' work: recorded as busy
    assert start(0.6)["busy"] == 0.6 and len(timed) == 1 and looked == [0.6]  # as busy now: kept
    monkeypatch.setenv("DSPARK_BUSY_RETIME", "0")
    assert start(0.0)["busy"] == 0.6 and len(timed) == 1 and looked == [0.6]  # turned off: kept, not looked at
    monkeypatch.setenv("DSPARK_BUSY_RETIME", "1")
    assert start(0.2)["busy"] == 0.2 and len(timed) == 2 and looked[-1] == 0.2  # quieter by half: timed again
    assert start(0.0)["busy"] == 0.2 and len(timed) == 2 and len(looked) == 2  # not busy: kept, nothing looked at
