"""Continuous batching, chunked prefill, priorities, preemption and adaptive batch size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from llm_testutil import random_prompts

from dspark.llm import EngineConfig, SamplingParams
from dspark.llm.runner.kv_cache import PagedKVCache
from dspark.llm.scheduler import Scheduler, Sequence

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_requests_join_next_step_and_leave_when_done(make_llm: Callable[..., Any]) -> None:
    eng = make_llm().engine
    eng.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert [o.request_id for o in eng.step()] == ["a"]
    eng.add_request("b", [8, 9], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert sorted(o.request_id for o in eng.step()) == ["a", "b"]  # b joined the running batch
    outs = eng.step()
    assert {o.request_id: o.finished for o in outs} == {"a": True, "b": False}
    assert "a" not in eng.cache.block_tables  # pages went back the moment it finished
    while eng.has_unfinished():
        eng.step()
    assert eng.cache.all_free()


def test_chunked_prefill_keeps_decodes_moving(make_llm: Callable[..., Any]) -> None:
    eng = make_llm(max_num_batched_tokens=16).engine
    eng.add_request("short", [5, 6], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    eng.step()
    eng.add_request("long", random_prompts(1, seed=2, lo=100, hi=101)[0], GREEDY)
    steps_until_first = 0
    while True:
        outs = {o.request_id for o in eng.step()}
        steps_until_first += 1
        assert "short" in outs, "a running decode stalled behind a long prefill"
        if "long" in outs:
            break
    assert steps_until_first == 7  # 100 prompt tokens at 15 per step (1 of 16 goes to the decode)
    eng.abort_all()


def test_max_batch_size_is_respected(make_llm: Callable[..., Any]) -> None:
    eng = make_llm(max_batch_size=2).engine
    for i, p in enumerate(random_prompts(5, seed=4)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
        assert len(eng.scheduler.running) <= 2


def test_priority_then_arrival(make_llm: Callable[..., Any]) -> None:
    eng = make_llm(max_batch_size=1).engine
    p = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for rid, prio in [("batch1", 5), ("batch2", 5), ("urgent", 0)]:
        eng.add_request(rid, [5, 6, 7], p, priority=prio)
    order = []
    while eng.has_unfinished():
        order += [o.request_id for o in eng.step() if o.finished]
    assert order == ["urgent", "batch1", "batch2"]


def test_fcfs_policy_ignores_priority(make_llm: Callable[..., Any]) -> None:
    eng = make_llm(max_batch_size=1, scheduler_policy="fcfs").engine
    p = SamplingParams(max_tokens=1, temperature=0)
    eng.add_request("first", [5], p, priority=9)
    eng.add_request("second", [5], p, priority=0)
    assert eng.step()[0].request_id == "first"
    eng.abort_all()


@pytest.mark.parametrize("policy", ["newest_first", "oldest_first", "lowest_priority_first"])
def test_preemption_by_recompute_gives_identical_output(make_llm: Callable[..., Any], policy: str) -> None:
    prompts = random_prompts(6, seed=5, lo=10, hi=30)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = make_llm().generate(prompts, params)
    # 12 pages of 4 tokens: each request needs up to 12 alone, so six at once must preempt.
    tight = make_llm(page_size=4, max_total_tokens=48, preemption_policy=policy)
    outs = tight.generate(prompts, params, priority=[3, 1, 2, 0, 5, 4])
    assert tight.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


@pytest.mark.parametrize(("policy", "victim"), [("newest_first", "s2"), ("oldest_first", "s0"),
                                                 ("lowest_priority_first", "s1")])
def test_victim_per_policy(policy: str, victim: str) -> None:
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, kv_heads=1, head_dim=2)
    sched = Scheduler(EngineConfig(preemption_policy=policy), cache)  # type: ignore[arg-type]
    seqs = [Sequence(f"s{i}", None, [1, 2, 3, 4], GREEDY, priority=prio, arrival=i)
            for i, prio in enumerate([1, 2, 0])]
    for s in seqs:
        sched.add(s)
    assert len(sched.schedule()) == 3  # three full pages, one free
    for s in seqs:  # pretend the prefill ran and sampled a token: each now needs a second page
        s.num_computed = 4
        cache.set_len(s.request_id, 4)
        s.output_ids.append(9)
    planned = sched.schedule()
    preempted = [s.request_id for s in seqs if s.num_preemptions]
    assert preempted == [victim]
    assert {p.seq.request_id for p in planned} == {"s0", "s1", "s2"} - {victim}
    for s in seqs:
        cache.free(s.request_id)
    assert cache.all_free()


def test_adaptive_batch_shrinks_when_slow_and_grows_back() -> None:
    cache = PagedKVCache(num_layers=1, num_pages=4, page_size=4, kv_heads=1, head_dim=2)
    sched = Scheduler(EngineConfig(max_batch_size=16, target_step_ms=10.0), cache)
    for _ in range(5):
        sched.record_step(40.0)
    low = sched.effective_max_batch
    assert low < 8
    for _ in range(40):
        sched.record_step(2.0)
    assert sched.effective_max_batch == 16  # bounded by max_batch_size
    fixed = Scheduler(EngineConfig(max_batch_size=16), cache)
    fixed.record_step(1e6)
    assert fixed.effective_max_batch == 16  # no target: adaptation off


def test_adaptive_limit_gates_admission(make_llm: Callable[..., Any]) -> None:
    eng = make_llm(max_batch_size=8, target_step_ms=1e-6).engine  # every step is "too slow"
    for i, p in enumerate(random_prompts(8, seed=6)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert eng.stats().effective_max_batch == 1


def test_generation_capped_at_max_model_len(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(max_model_len=14)
    (out,) = llm.generate([list(range(3, 13))], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_priority_preemption_lets_urgent_requests_in(make_llm: Callable[..., Any]) -> None:
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    ref = make_llm().generate([[5, 6, 7], [8, 9]], params)
    eng = make_llm(max_batch_size=1, priority_preemption=True).engine
    eng.add_request("batch", [5, 6, 7], params, priority=5)
    for _ in range(4):
        eng.step()
    eng.add_request("urgent", [8, 9], params, priority=0)
    assert [o.request_id for o in eng.step()] == ["urgent"]  # took the only slot at once
    done: dict[str, list[int]] = {}
    while eng.has_unfinished():
        done |= {o.request_id: o.token_ids for o in eng.step() if o.finished}
    assert list(done) == ["urgent", "batch"]
    assert [done["batch"], done["urgent"]] == [o.token_ids for o in ref]  # recompute changed nothing
    assert eng.stats().num_preemptions == 1
    plain = make_llm(max_batch_size=1).engine  # off by default: the urgent request waits its turn
    plain.add_request("batch", [5, 6, 7], params, priority=5)
    plain.step()
    plain.add_request("urgent", [8, 9], params, priority=0)
    assert [o.request_id for o in plain.step()] == ["batch"]
    plain.abort_all()
