"""DeepSpec's copy runs for a lone greedy request (llm/speculative/decoder.py, ``lone_plan`` and ``copy_run``):
several verification steps drafted by one lookup (prompt lookup, suffix lookup) at one width in one engine
step, on OpenVINO (the ``cpu`` plugin, paged) and llama.cpp (its own KV per sequence). They give exactly plain
decoding's tokens, text and finish reasons however a request ends, and are taken where the replay of the
request's text says copy steps cost less a token. Which way is cheaper follows from step times, so the tests
fix them (recorded costs, not this machine's): no test here depends on how fast the machine steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from decoder_testutil import float_engine
from test_greedy_runs import DECODERS, PROMPTS, _drive

from dspark.llm.engine import LLMEngine
from dspark.llm.sampling import SamplingParams

LOOP = "    x = x + 1\n" * 12  # a text the model may copy from, and the README's
FLAT: Callable[[int], float] = lambda rows: 1.0 + 0.02 * rows  # noqa: E731  a wide step costs little more
STEEP: Callable[[int], float] = lambda rows: float(rows) ** 2  # noqa: E731  no copy step can pay
RUN_MS = 8.0  # a run's budget: at the fixed step costs, 7 steps a run (and a greedy run at most 8)


def _engine(decoder: str, costs: Callable[[int], float] | None, monkeypatch: pytest.MonkeyPatch,
            **kw: Any) -> LLMEngine:
    spec = {"speculative_decoding": {"strategy": "deepspec"}} if costs is not None else {}
    e = float_engine(decoder, max_batch_size=1, **spec, **{"decode_run_ms": RUN_MS, **kw})
    if costs is not None:
        assert e.spec is not None
        monkeypatch.setattr(e.spec, "_step_ms", costs)
    return e


def _one_at_a_time(e: LLMEngine,
                   reqs: dict[str, tuple[str, SamplingParams]]) -> dict[str, tuple[list[int], str, str | None]]:
    """Each request run alone to its end (copy runs are for a lone request), tokens, text and finish reason;
    its streamed text checked against its final one."""
    out = {}
    for rid, req in reqs.items():
        done, streamed = _drive(e, {rid: req})
        assert streamed[rid] == done[rid][1]
        out.update(done)
    return out


def _requests(e: LLMEngine) -> dict[str, tuple[str, SamplingParams]]:
    def greedy(n: int, **kw: Any) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=0, **{"ignore_eos": True, **kw})

    plain = _one_at_a_time(e, {"p": (LOOP, greedy(40))})["p"][0]
    text = e.tokenizer.decode(plain[:23])
    stop_str = text[-4:] if text[-4:].strip() else text[-6:]
    return {**{str(i): (p, greedy(n)) for i, (p, n) in enumerate(zip([LOOP, *PROMPTS], [61, 40, 37, 33, 29]))},
            "stop-token": (LOOP, greedy(40, stop_token_ids=[plain[17]])),
            "stop-string": (LOOP, greedy(40, stop=[stop_str])),
            "eos": (PROMPTS[3], greedy(40, ignore_eos=False))}


@pytest.mark.parametrize("decoder", DECODERS)
def test_copy_runs_end_where_plain_decoding_ends(decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e0 = _engine(decoder, None, monkeypatch)
    reqs = _requests(e0)
    ref = _one_at_a_time(e0, reqs)
    e = _engine(decoder, FLAT, monkeypatch)
    got = _one_at_a_time(e, reqs)
    assert got == ref
    assert ref["stop-token"][2] == "stop" and len(ref["stop-token"][0]) < 40
    assert ref["stop-string"][2] == "stop" and len(ref["stop-string"][0]) < 40
    assert e.spec is not None and e.stats().spec_copy_runs == e.spec.copy_runs > 0
    drafters = e.stats().spec_drafters
    assert drafters["prompt-lookup"]["accepted_tokens"] > 0
    # The loop's prompt comes back: suffix lookup holds the first request's text, and copies from it.
    assert drafters["suffix-lookup"]["accepted_tokens"] > 0, str(drafters["suffix-lookup"])
    s = e.stats()
    assert s.steps * 2 < s.forward_steps  # copy and greedy runs: several decoder steps an engine step
    assert e.runner.failovers == []


@pytest.mark.parametrize("decoder", DECODERS)
def test_no_copy_run_where_copy_steps_cost_more(decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e0 = _engine(decoder, None, monkeypatch)
    reqs = {"loop": (LOOP, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))}
    ref = _one_at_a_time(e0, reqs)
    e = _engine(decoder, STEEP, monkeypatch)
    assert _one_at_a_time(e, reqs) == ref
    assert e.spec is not None and e.spec.copy_runs == 0
    s = e.stats()
    assert s.steps * 2 < s.forward_steps  # plain stretches ran as greedy runs


@pytest.mark.parametrize("decoder", DECODERS)
def test_greedy_stretches_grow_to_the_run_budget_while_plain_steps_lead(decoder: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no copy way comes near plain steps (STEEP), a lone request's greedy stretches grow from
    ``stretch_ms`` to the run's budget (``decode_run_ms``) and no further, with plain decoding's tokens."""
    reqs = {"loop": (LOOP, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))}
    ref = _one_at_a_time(_engine(decoder, None, monkeypatch), reqs)
    for run_ms, longest in ((RUN_MS, RUN_MS), (4 * RUN_MS, 4 * RUN_MS)):  # at STEEP's 1 ms a step: steps = ms
        e = _engine(decoder, STEEP, monkeypatch, decode_run_ms=run_ms)
        assert e.spec is not None
        runs: list[int] = []  # the steps of each greedy stretch planned (its way and length are DeepSpec's)
        plan = e.spec.lone_plan

        def record(*a: Any, plan: Any = plan) -> Any:
            way = plan(*a)
            if way is not None and way[1] == 0:
                runs.append(way[2])
            return way

        monkeypatch.setattr(e.spec, "lone_plan", record)
        assert _one_at_a_time(e, reqs) == ref
        assert e.spec.copy_runs == 0
        assert max(runs) == longest and runs[0] == RUN_MS, runs  # the first stretch: stretch_ms (8 ms)


def test_no_copy_run_without_the_prompt_lookup_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    e = float_engine("cpu", decode_run_ms=RUN_MS, max_batch_size=1,
                     speculative_decoding={"strategy": "deepspec", "drafters": ["suffix-lookup"]})
    assert e.spec is not None
    monkeypatch.setattr(e.spec, "_step_ms", FLAT)
    _one_at_a_time(e, {"loop": (LOOP, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))})
    assert e.spec.copy_runs == 0
