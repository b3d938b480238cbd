"""Drafters as plugins: a failing one is reported and bypassed, the built-in ones come through the
hook, drafters get what runs the target (not the engine), old plugin API versions still load, and the
call guard's worker threads end with their guard."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from spec_testutil import GREEDY_LENS, _greedy, _prompts

import dspark
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.llm import LLM
from dspark.llm.speculative.controller import RLS, draft_x
from dspark.llm.speculative.handles import DrafterCalls, Handle
from dspark.types import Draft, DrafterSpec, DraftRequest, TargetModel


class _Faulty:
    """A drafter plugin whose drafter breaks mid-run, in one of several ways."""

    DSPARK_API_VERSION = "1.1"

    def __init__(self, how: str) -> None:
        self.how = how

    @dspark.hookimpl
    def dspark_drafters(self, target: TargetModel) -> list[DrafterSpec]:
        how = self.how

        class Drafter:
            calls = 0

            def propose(self, tokens: list[int], k: int) -> Draft:
                Drafter.calls += 1
                if Drafter.calls > 3:
                    if how == "raise":
                        raise RuntimeError("drafter exploded")
                    if how == "vocab":
                        return Draft(tokens=[10**6])
                    if how == "too_long":
                        return Draft(tokens=[5] * (k + 1))
                    if how == "hang":
                        threading.Event().wait(60)  # never set: a hung plugin (its thread is abandoned)
                return Draft(tokens=tokens[-k:] if k else [])

        return [DrafterSpec(name=f"faulty-{how}", kind="other", create=Drafter)]


@pytest.mark.parametrize("how", ["raise", "vocab", "too_long", "hang"])
def test_a_failing_drafter_is_reported_and_bypassed(how: str, spec_llm: Callable[..., LLM],
                                                    plain_outputs: list[list[int]],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    host = PluginHost(PluginSettings(autoload=False)).load()
    host.register(_Faulty(how), "faulty")
    llm = spec_llm({"strategy": "fixed", "drafters": [f"faulty-{how}"], "num_speculative_tokens": 2,
                    "drafter_timeout_s": 0.3}, plugin_host=host)
    outs = llm.generate(_prompts(), [_greedy(n) for n in GREEDY_LENS])
    assert [o.token_ids for o in outs] == plain_outputs  # nobody noticed, output-wise
    s = llm.stats()
    info = s.spec_drafters[f"faulty-{how}"]
    assert s.spec_drafter_failures == 1 and info["failures"] == 1 and info["disabled"]
    assert info["plugin"] == "faulty"
    err = capsys.readouterr().err
    assert "spec.drafter_failed" in err
    if how == "hang":
        assert "did not return within 0.3 s" in err and "did not return within 0.3 s" in str(info["disabled"])
        drafter = next(h.obj for h in llm.engine.spec.handles if h.name == "faulty-hang")
        assert type(drafter).calls == 4  # the hung call was the last: a hung drafter costs one timeout


def test_builtin_drafters_come_through_the_hook(target4: Path) -> None:
    host = PluginHost(PluginSettings(autoload=False)).load()
    from dspark.llm.speculative.offers import collect_drafters

    t = TargetModel(name=target4.name, path=str(target4), vocab_size=320, num_layers=4, hidden_size=64)
    offers = {o.name: o for o in collect_drafters(host, t)}
    assert offers["prompt-lookup"].plugin == "ngram"
    assert offers["suffix-lookup"].plugin == "ngram" and offers["suffix-lookup"].kind == "ngram"
    assert offers["draft-model:tiny4-draft"].plugin == "drafters" and offers["draft-model:tiny4-draft"].kind == "model"
    assert "self-draft" not in offers  # only for a target running in this process (target.runtime)


def test_drafters_get_the_targets_runner_and_cache_not_the_engine(spec_llm: Callable[..., LLM]) -> None:
    seen: list[Any] = []

    class Records:
        DSPARK_API_VERSION = "1.1"

        @dspark.hookimpl
        def dspark_drafters(self, target: TargetModel) -> None:
            seen.append(target.runtime)

    host = PluginHost(PluginSettings(autoload=False)).load()
    host.register(Records(), "records")
    llm = spec_llm({"strategy": "fixed", "drafters": ["prompt-lookup"], "num_speculative_tokens": 2},
                   plugin_host=host)
    (rt,) = seen
    engine = llm.engine
    assert rt.runner is engine.runner and rt.cache is engine.cache and callable(rt.place_decoder)
    assert rt is not engine and not hasattr(rt, "scheduler") and not hasattr(rt, "spec")


def test_plugin_api_1_0_drafters_still_load() -> None:
    host = PluginHost(PluginSettings(autoload=False)).load()

    class Old:
        DSPARK_API_VERSION = "1.0"

        @dspark.hookimpl
        def dspark_drafters(self, target: TargetModel) -> list[DrafterSpec]:
            return [DrafterSpec(name="old", kind="other", create=lambda: None)]

    assert host.register(Old(), "old").status.value == "active"
    assert dspark.API_VERSION >= "1.1"  # minor versions only add


def test_call_guard_workers_end_with_their_guard() -> None:
    """Every engine with a third-party drafter makes a guard; its worker thread must not outlive it."""
    import gc

    from dspark.llm.speculative.call_guard import CallGuard, DrafterTimeout

    g = CallGuard("probe", 5.0)
    assert g(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        g(lambda: 1 / 0)
    worker = g._worker
    del g
    gc.collect()
    worker.join(5)
    assert not worker.is_alive()
    hung = CallGuard("hung", 0.05)
    with pytest.raises(DrafterTimeout, match="did not return within 0.05 s"):
        hung(threading.Event().wait, 30)
    with pytest.raises(DrafterTimeout, match="an earlier wait never returned"):
        hung(int)


class _Recorded(RLS):
    """A drafter's cost model that keeps what it was taught."""

    def __init__(self) -> None:
        super().__init__([0.0] * 4, [1.0] * 4)
        self.xs: list[list[float]] = []

    def update(self, x: list[float], y: float) -> None:
        self.xs.append(list(x))
        super().update(x, y)


class _StopsEarly:
    """A model drafter whose keep_going stopped it after two positions, whatever k it was asked."""

    def propose_batch(self, reqs: list[DraftRequest]) -> list[Draft]:
        return [Draft(tokens=[5, 6][: r.k]) for r in reqs]


def test_a_drafters_cost_is_learned_per_position_it_ran_not_per_position_asked() -> None:
    calls = DrafterCalls()
    calls.failures, calls.vocab = 0, 64
    model = Handle(0, "model", "model", "test", _StopsEarly(), cost=_Recorded())
    lookup = Handle(1, "lookup", "ngram", "test", _StopsEarly(), cost=_Recorded(), probe=True, calls=7)
    calls.handles = [model, lookup]
    reqs = [DraftRequest("a", [1, 2, 3], 16), DraftRequest("b", [1, 2], 16)]
    assert calls._run(model, reqs) is not None and calls._run(lookup, reqs) is not None
    assert model.cost.xs == [draft_x(2, 2)]  # two positions ran (asked for 16: each learned 8x too cheap)
    assert lookup.cost.xs == [draft_x(16, 2)]  # a lookup's time is per sequence; what was asked stands
