"""LLM.generate / generate_stream, AsyncLLMEngine, stats, the default model path."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llm_testutil import random_prompts

import dspark
from dspark.llm import AsyncLLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_lazy_exports() -> None:
    from dspark import llm

    assert dspark.LLM is llm.LLM and dspark.SamplingParams is llm.SamplingParams


def test_generate_outputs_in_order(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    outs = llm.generate(["def hello", "import os", [5, 6, 7]], [GREEDY, GREEDY, GREEDY.model_copy(update={"max_tokens": 3})])
    assert [o.prompt for o in outs] == ["def hello", "import os", None]
    assert outs[2].prompt_token_ids == [5, 6, 7] and len(outs[2].token_ids) == 3
    assert outs[0].prompt_token_ids[0] == 1  # the tokenizer's BOS
    single = llm.generate("def hello", GREEDY)
    assert single[0].token_ids == outs[0].token_ids
    assert all(o.finished and o.finish_reason == "length" for o in outs)


def test_a_step_for_finished_requests_only_gives_the_same_results(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    eng = llm.engine
    params = [GREEDY.model_copy(update={"max_tokens": n}) for n in (3, 9, 6)]
    every: dict[str, Any] = {}
    for i, p in enumerate(params):
        eng.add_request(f"all-{i}", "def hello", p)
    while eng.has_unfinished():
        for out in eng.step():
            every.setdefault(out.request_id, []).append(out)
    only: dict[str, Any] = {}
    for i, p in enumerate(params):
        eng.add_request(f"fin-{i}", "def hello", p)
    while eng.has_unfinished():
        for out in eng.step(finished_only=True):
            assert out.finished and out.request_id not in only
            only[out.request_id] = out
    for i in range(3):
        last, fin = every[f"all-{i}"][-1], only[f"fin-{i}"]
        assert (fin.token_ids, fin.text, fin.finish_reason) == (last.token_ids, last.text, last.finish_reason)
        assert fin.delta == "".join(o.delta for o in every[f"all-{i}"])  # all the text not yet emitted
    assert eng.cache.all_free()


def test_stream_matches_generate_and_break_aborts(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    params = GREEDY.model_copy(update={"max_tokens": 16})
    text = llm.generate("import os", params)[0].text
    assert "".join(llm.generate_stream("import os", params)) == text
    for _ in llm.generate_stream("import os", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)):
        break
    assert llm.engine.cache.all_free() and not llm.engine.has_unfinished()


def test_stats(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(page_size=8, max_total_tokens=256)
    eng = llm.engine
    eng.add_request("a", list(range(3, 23)), GREEDY)  # 20 tokens -> 3 pages of 8
    eng.step()
    s = llm.stats()
    assert (s.kv_total_pages, s.kv_used_pages, s.kv_free_pages, s.num_running, s.num_waiting) == (32, 3, 29, 1, 0)
    assert s.kv_used_bytes == 3 * s.kv_total_bytes // 32
    assert s.kv_fragmentation == pytest.approx((24 - 20) / 24)
    eng.abort("a")
    assert llm.stats().kv_used_pages == 0


def test_default_model_missing_is_clear(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dspark.llm import api

    monkeypatch.setattr(api, "default_model_path", lambda: tmp_path / "stdlib-llama")
    with pytest.raises(FileNotFoundError, match="embedded default model is not at"):
        dspark.LLM()


def test_engine_config_errors_name_the_field(checkpoint: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match="max_batch_size"):
        dspark.LLM(str(checkpoint("llama")), max_batch_size=0)
    with pytest.raises(ValueError, match="preemption_policy"):
        dspark.LLM(str(checkpoint("llama")), preemption_policy="random")


def test_async_many_concurrent_requests(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    prompts = random_prompts(12, seed=9)
    ref = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    eng = AsyncLLMEngine(llm.engine)

    async def one(i: int) -> tuple[list[int], str, int]:
        n, last = 0, None
        async for out in eng.generate(prompts[i], GREEDY, request_id=f"r{i}"):
            n, last = n + 1, out
        assert last is not None
        return last.token_ids, last.finish_reason or "", n

    async def main() -> list[tuple[list[int], str, int]]:
        return await asyncio.gather(*(one(i) for i in range(12)))

    try:
        got = asyncio.run(main())
    finally:
        eng.shutdown()
    assert [g[0] for g in got] == ref
    assert all(g[1] == "length" and g[2] == 10 for g in got)  # one streamed output per token


def test_async_arrivals_during_a_step_do_not_wait_for_it(make_llm: Callable[..., Any]) -> None:
    """A request that arrives while the engine thread is inside a step reaches the inbox at once (the event loop
    never waits on a step), and the requests that arrived during one step are all admitted by the next."""
    llm = make_llm()
    step = llm.engine.step
    entered, release = threading.Event(), threading.Event()
    waiting_at_step: list[int] = []

    held_past_deadline: list[bool] = []

    def held_step(*a: Any, **k: Any) -> Any:
        waiting_at_step.append(len(llm.engine.scheduler.waiting))
        entered.set()
        # The first step is held until the test has sent the others; an event loop that waited on the step
        # could not send them, and the step goes on alone after the deadline.
        held_past_deadline.append(not release.wait(10))
        return step(*a, **k)

    llm.engine.step = held_step
    ended: list[int] = []
    end_run = llm.engine.end_run
    llm.engine.end_run = lambda: (ended.append(1), end_run())  # each arrival ends a greedy run in progress
    eng = AsyncLLMEngine(llm.engine)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def drain(i: int) -> int:
        n = 0
        async for out in eng.generate([5 + i, 6, 7], params, request_id=f"a{i}"):
            n = len(out.token_ids)
        return n

    async def main() -> tuple[list[int], bool]:
        first = asyncio.create_task(drain(0))
        assert await asyncio.to_thread(entered.wait, 30), "the engine never stepped"
        others = [asyncio.create_task(drain(i)) for i in range(1, 4)]
        deadline = time.monotonic() + 30
        while eng._inbox.qsize() < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        queued_while_held = eng._inbox.qsize() == 3 and not release.is_set()
        release.set()
        return await asyncio.gather(first, *others), queued_while_held

    try:
        lengths, queued_while_held = asyncio.run(main())
    finally:
        release.set()
        eng.shutdown()
    assert queued_while_held and not any(held_past_deadline)
    assert lengths == [4, 4, 4, 4] and len(ended) == 4
    assert waiting_at_step[0] == 1 and waiting_at_step[1] == 3  # the three were admitted together


def test_async_abort_returns_pages(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    step = llm.engine.step
    steps = [0]

    def slow_step() -> Any:  # 400 tokens take seconds: the stream cannot finish before the consumer aborts it
        time.sleep(0.005)
        steps[0] += 1
        return step()

    llm.engine.step = slow_step
    eng = AsyncLLMEngine(llm.engine)
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main() -> tuple[str | None, str | None]:
        reasons = []
        async for out in eng.generate([5, 6, 7], long, request_id="x"):
            if len(out.token_ids) == 3 and not out.finished:
                assert eng.stats().kv_used_pages > 0
                await eng.abort("x")
            reasons.append(out.finish_reason)
        # A consumer that walks away mid-stream is aborted too.
        agen = eng.generate([5, 6], long, request_id="y")
        async for _ in agen:
            break
        await agen.aclose()
        deadline = time.monotonic() + 30
        while eng.stats().kv_used_pages and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return reasons[-1], None

    try:
        reason, _ = asyncio.run(main())
        assert reason == "abort"
        assert eng.stats().kv_used_pages == 0 and eng.stats().num_running == 0
        # Freed by the aborts, not by the two requests running out their 400 tokens each.
        assert steps[0] < 400, steps[0]
    finally:
        eng.shutdown()


def test_async_duplicate_id_and_bad_input_raise_in_caller(make_llm: Callable[..., Any]) -> None:
    eng = AsyncLLMEngine(make_llm(max_model_len=16).engine)

    async def main() -> None:
        with pytest.raises(ValueError, match="max_model_len=16"):
            async for _ in eng.generate(list(range(3, 40)), GREEDY):
                pass

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_async_id_clash_with_sync_api_reaches_the_caller(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    llm.engine.add_request("taken", [5], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng = AsyncLLMEngine(llm.engine)

    async def main() -> None:
        with pytest.raises(ValueError, match="already in use"):
            async for _ in eng.generate([6], GREEDY, request_id="taken"):
                pass

    try:
        asyncio.run(main())
    finally:
        eng.shutdown()


def test_sliding_window_leaves_max_model_len_alone(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    # The runner honours sliding windows (tests/llm/runner/test_families.py), so a window no longer caps the length.
    import json
    import shutil

    d = tmp_path / "m"
    shutil.copytree(checkpoint("mistral"), d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "sliding_window": 32}))
    assert dspark.LLM(str(d)).engine.max_model_len == 512  # max_position_embeddings
    assert dspark.LLM(str(d), max_model_len=64).engine.max_model_len == 64


def test_bf16_end_to_end(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(dtype="bf16")
    (out,) = llm.generate("def hello", GREEDY)
    assert len(out.token_ids) == 10 and llm.engine.cache.k[0].dtype.itemsize == 2
