"""Targets timed one after the other whose scores come close are timed again in the other order
(llm/decoding/choose.py, timing.CLOSE); the GGUF path's twin is in test_llamacpp_decoder.py."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
from decoder_testutil import MODEL, Counted

from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.llm.decoding import choose
from dspark.llm.decoding.runner import REFERENCE
from dspark.llm.engine import LLMEngine

pytest.importorskip("openvino")


def test_close_targets_are_compiled_and_timed_again_in_the_other_order(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Both really compile and run their timing steps beside the torch runner; what each timing reports is set
    # here: "one" first measures 0.50 of the torch runner, "two" 0.52 (within timing.CLOSE), and "two"'s second
    # timing, now first, 0.30. Each takes the mean of its times: "two" runs. Every compile still happens while
    # no other decoder's copy is alive.
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    real_time = choose.time_targets
    order: list[str] = []
    times = {"one@cpu": [0.5, 0.5], "two@cpu": [0.52, 0.3]}

    def recorded(benches: dict[str, Any], shape_list: Any) -> dict[str, dict[str, float]]:
        out = real_time(benches, shape_list, reps=1, blocks=1, span_s=0)
        (label,) = [k for k in out if k != REFERENCE]
        order.append(label)
        v = times[label][order.count(label) - 1]
        return {k: {n: 1.0 if k == REFERENCE else v for n in ms} for k, ms in out.items()}

    monkeypatch.setattr(choose, "time_targets", recorded)
    alive: weakref.WeakSet[Any] = weakref.WeakSet()
    seen: list[int] = []
    host = PluginHost(PluginSettings(blocked={"npu", "cuda", "cpu", "llamacpp"}))
    host.register(Counted("one", alive, seen), "one")
    host.register(Counted("two", alive, seen), "two")
    host.load()
    e = LLMEngine.from_model(MODEL, dtype="float32", decoder="auto", plugin_host=host, max_batch_size=4)
    c = e.decoder_choice
    assert c is not None and c.chosen == "two@cpu", c
    assert order[2:] == order[1::-1] and sorted(order[:2]) == ["one@cpu", "two@cpu"], order
    by = {r["label"]: r["step_ms"] for r in c.ranked}
    assert set(by["two@cpu"].values()) == {0.41} and set(by["one@cpu"].values()) == {0.5}
    assert set(seen) == {0}  # each compile (4 timings, then the winner) with no other copy alive
