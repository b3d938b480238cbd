"""A compiled decoder that fails, hangs or is cancelled while serving, and the thread its steps run on.

The engine moves to its next target and loses no request; a decoder that can cancel a step (API 1.11)
steps on the engine's own thread, the watchdog cancelling a hung one; the async engine is built and
stepped on one thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from decoder_testutil import MODEL, PROMPTS, Faulty, Renamed, float_engine, greedy, run_prompts

from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.llm.engine import LLMEngine
from dspark.llm.sampling import SamplingParams
from dspark.server.metrics import ServerMetrics

openvino = pytest.importorskip("openvino")

_run, _engine, _greedy = run_prompts, float_engine, greedy


@pytest.mark.parametrize("hang", [False, True], ids=["raises", "hangs"])
def test_a_failing_decoder_moves_to_the_next_target_and_loses_no_request(hang: bool) -> None:
    ref = _run(_engine("torch", max_batch_size=8), _greedy(20))
    host = PluginHost(PluginSettings(blocked={"npu", "cuda"}))
    faulty = Faulty(fail_at=16, hang_s=3.0 if hang else 0.0)  # the probe scenario takes 6 steps: mid-serving
    host.register(faulty, "faulty")
    host.load()
    e = LLMEngine.from_model(MODEL, dtype="float32", decoder="faulty", max_batch_size=8, plugin_host=host)
    e.runner.step_timeout_s = 1.0
    assert e.stats().decoder == "faulty@cpu"
    got = _run(e, _greedy(20))
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in ref.items()}
    assert all(o.finish_reason == "length" for o in got.values())
    s = e.stats()
    assert s.decoder == "torch" and s.decoder_failovers == 1
    fault = host.last_fault("faulty")
    assert fault is not None and fault.hook == "decoder.step"
    assert ("did not return within" if hang else "device lost") in fault.reason
    # What a server's /metrics says of it (the series an operator's alert watches).
    registry = ServerMetrics(e, model_name="m", devices=[]).registry
    assert registry.get_sample_value("dspark_decoder_failovers_total", {"model_name": "m"}) == 1
    assert registry.get_sample_value("dspark_decoder_info", {"model_name": "m", "decoder": "torch"}) == 1
    assert registry.get_sample_value("dspark_decoder_info", {"model_name": "m", "decoder": "faulty@cpu"}) is None


class _Cancellable(Renamed):
    """OpenVINO's decoder offering ``cancel`` (API 1.11); its ``fail_at``-th step hangs until cancelled. Records
    the thread of every step."""

    DSPARK_API_VERSION = "1.11"
    RUNTIME = "cancellable/CPU"
    CANCELS = True

    def __init__(self, fail_at: int) -> None:
        self.fail_at, self.steps = fail_at, 0
        self.cancelled = threading.Event()
        self.threads: set[int] = set()

    def _step(self, inner: Any, kv: Any, batch: Any) -> Any:
        self.threads.add(threading.get_ident())
        self.steps += 1
        if self.steps == self.fail_at and self.cancelled.wait(60.0):
            raise RuntimeError("step cancelled")
        return inner.step(kv, batch)

    def _cancel(self, inner: Any) -> None:
        self.cancelled.set()


def test_a_decoder_that_can_cancel_steps_on_the_engines_thread_and_a_hung_step_is_cancelled() -> None:
    ref = _run(_engine("torch", max_batch_size=8), _greedy(20))
    host = PluginHost(PluginSettings(blocked={"npu", "cuda"}))
    plugin = _Cancellable(fail_at=16)  # the probe scenario takes 6 steps: mid-serving
    host.register(plugin, "cancellable")
    host.load()
    e = LLMEngine.from_model(MODEL, dtype="float32", decoder="cancellable", max_batch_size=8, plugin_host=host)
    e.runner.step_timeout_s = 1.0
    got = _run(e, _greedy(20))
    assert {k: o.token_ids for k, o in got.items()} == {k: o.token_ids for k, o in ref.items()}
    assert plugin.cancelled.is_set()
    assert plugin.threads == {threading.get_ident()}  # every step on this thread: no watchdog thread
    s = e.stats()
    assert s.decoder == "torch" and s.decoder_failovers == 1
    fault = host.last_fault("cancellable")
    assert fault is not None and fault.hook == "decoder.step" and "(cancelled)" in fault.reason, fault


def test_openvinos_cancel_stops_a_running_step_and_the_engine_recovers() -> None:
    # The real runtime's cancel (InferRequest.cancel), called from another thread while the engine steps (a
    # 512-token prompt in one chunk, then decode steps): a step raises, and the engine moves on to the torch
    # runner with the request's tokens unchanged.
    prompt = list(range(5, 517))
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    kw = dict(max_batch_size=1, max_num_batched_tokens=512)

    def run(engine: LLMEngine) -> list[int]:
        engine.add_request("long", prompt, params)
        done: list[Any] = []
        while engine.has_unfinished():
            done += [o for o in engine.step() if o.finished]
        return list(done[0].token_ids)

    ref = run(_engine("torch", **kw))
    e = _engine("cpu", **kw)
    compiled = e.runner.current.compiled
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append(run(e)))
    t.start()
    deadline = time.monotonic() + 120
    while t.is_alive() and not e.runner.failovers:  # until a cancel reaches a running step
        assert time.monotonic() < deadline
        compiled.cancel()
    t.join(120)
    assert e.runner.failovers and "cancel" in e.runner.failovers[0]["reason"].lower(), e.runner.failovers
    assert e.stats().decoder == "torch"
    assert got == [ref]


class _ThreadNames(Renamed):
    """OpenVINO's decoder recording the name of the thread of every call into it."""

    DSPARK_API_VERSION = "1.11"
    RUNTIME = "threads/CPU"
    CANCELS = True

    def __init__(self) -> None:
        self.names: set[str] = set()

    def _allocate(self, inner: Any, n: int) -> Any:
        self.names.add(threading.current_thread().name)
        return inner.allocate(n)

    def _step(self, inner: Any, kv: Any, batch: Any) -> Any:
        self.names.add(threading.current_thread().name)
        return inner.step(kv, batch)


def test_the_async_engine_is_built_and_stepped_on_one_thread() -> None:
    # Runtimes keep state per calling thread (OpenMP teams): the probe that checks the decoder while the
    # engine is built and the steps that serve run on the same thread, the engine's.
    import asyncio

    from dspark.llm.api import AsyncLLMEngine

    host = PluginHost(PluginSettings(blocked={"npu", "cuda"}))
    plugin = _ThreadNames()
    host.register(plugin, "threads")
    host.load()
    engine = AsyncLLMEngine.from_pretrained(MODEL, dtype="float32", decoder="threads", plugin_host=host)
    try:
        async def one() -> list[int]:
            out: list[int] = []
            async for o in engine.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0)):
                out = o.token_ids
            return out

        assert len(asyncio.run(one())) == 4
        assert engine.stats().decoder == "threads@cpu"
    finally:
        engine.shutdown()
    assert plugin.names == {"dspark-llm-engine"}, plugin.names


def test_no_idle_plugin_worker_outlives_the_engines_build() -> None:
    # A worker thread that ran a plugin's torch code keeps an OpenMP team alive, which slows the steps of every
    # OpenMP runtime after it (dspark.host.hook_threads): the build retires them.
    from dspark.host.hook_threads import IDLE_NAME, call_with_timeout

    call_with_timeout(lambda: None, [], 30, "t.before")  # an idle worker exists now
    idle = [t for t in threading.enumerate() if t.name == IDLE_NAME]
    assert idle
    _engine("cpu")
    for t in idle:  # these workers (a call abandoned by an earlier test may rejoin the idle set later)
        t.join(30)
        assert not t.is_alive(), "an idle plugin worker outlived the build"
