"""Runs of greedy decode steps in one decoder call (plugin API 1.13, ``greedy_steps``; llm/decoding/runs.py).

On OpenVINO (the ``cpu`` plugin, paged) and llama.cpp (plugins/dspark-llamacpp, its own KV per sequence), a
run gives exactly the tokens, text and finish reasons of one step per call, however the run ends
(max_tokens, a stop token, a stop string, EOS, the model's length); it is only taken while every running
request is plain greedy decoding and none waits; a decoder whose run fails or answers wrongly is declined at
admission or failed over like a failing step, and no request is lost.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import numpy as np
import pytest
from decoder_testutil import MODEL, LlamacppWrapped, float_engine

import dspark
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.llm.decoding.runs import CLOSED_RUN_MS, MAX_RUN, RunLength, run_limits
from dspark.llm.engine import LLMEngine
from dspark.llm.sampling import SamplingParams
from dspark.llm.speculative.proposer import _EXPLORE_FIRST
from dspark.llm.speculative.runs.pays import EXPLORE_AFTER
from dspark.types import Draft, DrafterSpec, TargetModel

HAVE_LLAMACPP = all(importlib.util.find_spec(m) is not None for m in ("dspark_llamacpp", "llama_cpp"))
needs_llamacpp = pytest.mark.skipif(not HAVE_LLAMACPP, reason="the llamacpp plugin or llama-cpp-python is not "
                                    "installed (scripts/setup.sh)")
DECODERS = ["cpu", pytest.param("llamacpp", marks=needs_llamacpp)]

PROMPTS = ["def main():\n    args = parse()\n", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):\n",
           "for i in range(10):\n    print(i)\nfor j in range("]
RUN_MS = 1e6  # every run as long as MAX_RUN: the test does not depend on how fast this machine steps


def _engine(run_ms: float, decoder: str, **kw: Any) -> LLMEngine:
    e = float_engine(decoder, decode_run_ms=run_ms, **{"max_batch_size": 4, **kw})
    assert e.stats().decoder == (f"{decoder}@cpu" if decoder != "torch" else "torch"), e.decoder_choice
    return e


def _drive(e: LLMEngine, reqs: dict[str, tuple[str, SamplingParams]], late: dict[str, tuple[str, SamplingParams]] | None = None,
           late_after: int = 3) -> tuple[dict[str, tuple[list[int], str, str | None]], dict[str, str]]:
    """Run ``reqs`` (and ``late``, added after ``late_after`` steps) to the end: each request's tokens, text and
    finish reason, and its text as the concatenation of its streamed deltas."""
    for rid, (p, sp) in reqs.items():
        e.add_request(rid, p, sp)
    done: dict[str, tuple[list[int], str, str | None]] = {}
    streamed: dict[str, str] = {}
    steps = 0
    while e.has_unfinished():
        for o in e.step():
            streamed[o.request_id] = streamed.get(o.request_id, "") + o.delta
            if o.finished:
                done[o.request_id] = (list(o.token_ids), o.text, o.finish_reason)
        steps += 1
        if late and steps == late_after:
            for rid, (p, sp) in late.items():
                e.add_request(rid, p, sp)
    assert e.cache.all_free()
    return done, streamed


def _first_tokens(decoder: str, n: int = 40) -> dict[str, list[int]]:
    e = _engine(0.0, decoder)
    done, _ = _drive(e, {str(i): (p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                         for i, p in enumerate(PROMPTS)})
    return {k: v[0] for k, v in done.items()}


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_run_ends_where_one_step_at_a_time_ends(decoder: str) -> None:
    plain = _first_tokens(decoder)
    tok = plain["0"][9]  # a token request 0 gives mid-run: its stop token
    e0 = _engine(0.0, decoder)
    text0 = e0.tokenizer.decode(plain["2"][:14])
    stop_str = text0[-4:] if text0[-4:].strip() else text0[-6:]
    reqs = {"len": (PROMPTS[0], SamplingParams(max_tokens=37, temperature=0, ignore_eos=True)),
            "stop-token": (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[tok])),
            "stop-string": (PROMPTS[2], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop_str])),
            "eos": (PROMPTS[3], SamplingParams(max_tokens=40, temperature=0))}
    late = {"late": (PROMPTS[1], SamplingParams(max_tokens=29, temperature=0, ignore_eos=True))}
    ref, ref_stream = _drive(e0, reqs, late)
    e = _engine(RUN_MS, decoder)
    e._run.observe(1.0)  # a step's time known from the start: the first decode step is already a run
    got, stream = _drive(e, reqs, late)
    assert got == ref
    assert stream == {k: v[1] for k, v in got.items()} == ref_stream
    assert ref["stop-token"][2] == "stop" and ref["stop-token"][0][-1] == tok and len(ref["stop-token"][0]) < 40
    assert ref["stop-string"][2] == "stop" and len(ref["stop-string"][0]) < 40
    # Runs happened: far fewer engine steps than one per token, the decoder's steps counted apart.
    assert e.stats().steps * 3 < e0.stats().steps, (e.stats().steps, e0.stats().steps)
    assert e0.stats().forward_steps == e0.stats().steps <= e.stats().forward_steps  # runs may pass a stop string
    assert e.runner.failovers == []


@pytest.mark.parametrize("decoder", DECODERS)
def test_end_run_ends_a_run_after_the_step_in_flight(decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A request arriving during a run (AsyncLLMEngine calls LLMEngine.end_run from the event loop's thread) ends
    # the run after its step in flight; the request goes on in the next run, with the tokens of plain decoding.
    plain = _first_tokens(decoder)["0"]
    e = _engine(RUN_MS, decoder)
    e._run.observe(1.0)
    e.end_run()  # no run in progress: nothing happens, and the next run is not ended by it
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    e.add_request("a", PROMPTS[0], sp)
    got = list(e.step()[0].token_ids)  # the prefill and the first token
    decodes = [0]
    end_at = [3]  # during the run's third decode, from the step itself: where another thread's call may land

    def counted(real: Any) -> Any:
        def step(*a: Any, **k: Any) -> Any:
            out = real(*a, **k)
            decodes[0] += 1
            if decodes[0] == end_at[0]:
                e.end_run()
            return out
        return step

    if decoder == "cpu":
        compiled = e.runner.current.compiled
        monkeypatch.setattr(compiled, "_infer", counted(compiled._infer))  # what each step of its runs calls
    else:
        from dspark_llamacpp import runtime

        monkeypatch.setattr(runtime.Context, "_decode_checked",
                            lambda self, m, real=runtime.Context._decode_checked: counted(real)(self, m))
    lengths = []
    while e.has_unfinished():
        out = e.step()[0]
        lengths.append(len(out.token_ids) - len(got))
        got = list(out.token_ids)
    assert lengths[0] == 3  # the run ended after the step in which end_run was called
    assert lengths[1] == min(MAX_RUN, 40 - 1 - 3)  # the next run is whole: the flag went with the run it ended
    assert got == plain


def test_observers_see_each_step_of_a_run() -> None:
    # The server's step histogram (dspark_partition_latency_seconds) is told each step, a run's steps their share.
    e = _engine(RUN_MS, "cpu")
    seen: list[tuple[str, float]] = []
    e.observe(lambda work, seconds: seen.append((work, seconds)))
    e._run.observe(1.0)
    _drive(e, {"a": (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))})
    s = e.stats()
    assert s.steps < s.forward_steps == len(seen) and {w for w, _ in seen} == {"forward"}


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_run_stops_at_the_models_length(decoder: str) -> None:
    sp = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    outs = []
    for run_ms in (0.0, RUN_MS):
        e = _engine(run_ms, decoder, max_model_len=48)
        e._run.observe(1.0)
        done, _ = _drive(e, {"a": (PROMPTS[0], sp)})
        outs.append(done["a"])
    assert outs[0] == outs[1] and outs[0][2] == "length"
    assert e.stats().steps < e.stats().forward_steps  # the second engine ran runs up to the length


def test_requests_that_sample_or_want_logprobs_step_one_token_at_a_time() -> None:
    reqs = {"t": (PROMPTS[0], SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)),
            "lp": (PROMPTS[1], SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True))}
    runs: list[Any] = []
    for run_ms in (0.0, RUN_MS):
        e = _engine(run_ms, "cpu")
        e._run.observe(1.0)
        done, _ = _drive(e, reqs)
        runs.append((done, e.stats().steps))
    assert runs[0] == runs[1]  # same tokens, and as many steps: no run was taken


def test_run_limits_take_only_plain_greedy_decodes_with_room() -> None:
    e = _engine(RUN_MS, "cpu", max_model_len=64)
    e.add_request("a", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    planned = e.scheduler.schedule()
    assert run_limits(planned, 8, e.max_model_len) is None  # a prefill chunk
    e.abort("a")
    e.add_request("b", PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    e.step()  # the prefill, and the first token
    planned = e.scheduler.schedule()
    assert run_limits(planned, 8, e.max_model_len) == [4]  # max_tokens leaves 4
    assert run_limits(planned, 1, e.max_model_len) is None
    e.abort("b")


def test_run_length_fits_the_budget() -> None:
    r = RunLength(4.0)
    assert r.steps() == 1  # no step timed yet
    r.observe(0.5)
    assert r.steps() == 8
    r.observe(100.0, steps=10)  # a run of 10 steps of 10 ms each pulls the estimate up
    assert r.steps() < 8
    big = RunLength(1e9)
    big.observe(0.001)
    assert big.steps() == MAX_RUN
    assert RunLength(0.0).steps() == 1
    assert RunLength(0.0).steps(CLOSED_RUN_MS) == 1  # runs off stay off in a closed batch
    slow = RunLength(1e-6)
    slow.observe(CLOSED_RUN_MS / 4)  # a large model's step: a closed batch's run stays within CLOSED_RUN_MS
    assert slow.steps() == 1 and slow.steps(CLOSED_RUN_MS) == 4


def test_a_closed_batch_runs_max_run_steps_whatever_the_budget() -> None:
    # LLM.generate adds nothing until its requests finish (step(closed=True)): no arrival waits on a run, so a run
    # takes what fits in CLOSED_RUN_MS even under a budget that fits no second step; step() as a server calls it
    # keeps to the budget.
    llm = dspark.LLM(MODEL, dtype="float32", decoder="cpu", decode_run_ms=1e-6, max_batch_size=4)
    e = llm.engine
    assert e.stats().decoder == "cpu@cpu", e.decoder_choice
    sp = SamplingParams(max_tokens=2 * MAX_RUN, temperature=0, ignore_eos=True)
    before = e.stats().steps
    closed = [o.token_ids for o in llm.generate(PROMPTS, [sp] * len(PROMPTS))]
    closed_steps = e.stats().steps - before
    before = e.stats().steps
    done, _ = _drive(e, {str(i): (p, sp) for i, p in enumerate(PROMPTS)})
    open_steps = e.stats().steps - before
    assert closed == [done[str(i)][0] for i in range(len(PROMPTS))]
    assert open_steps >= 2 * MAX_RUN, open_steps  # one token a step
    assert closed_steps <= open_steps // 4, (closed_steps, open_steps)  # runs of MAX_RUN steps while a step is short


class _BadRuns(LlamacppWrapped):
    """llama.cpp's decoder whose greedy run raises (``mode="raise"``) or answers a token outside the vocabulary
    (``mode="garbage"``) on its ``fail_at``-th run."""

    RUNTIME = "bad-runs llama.cpp"
    RUNS = True

    def __init__(self, mode: str, fail_at: int) -> None:
        self.mode, self.fail_at, self.runs = mode, fail_at, 0

    def _greedy_steps(self, inner: Any, kv: Any, batch: Any, limits: np.ndarray, stop_ids: frozenset[int]) -> Any:
        self.runs += 1
        out = inner.greedy_steps(kv, batch, limits, stop_ids)
        if self.runs == self.fail_at:
            if self.mode == "raise":
                raise RuntimeError("llama.cpp aborted mid-run")
            out[0, 0] = 10**6
        return out


class _BadEnd(LlamacppWrapped):
    """llama.cpp's decoder with greedy runs whose end_run raises."""

    RUNTIME = "bad-end llama.cpp"
    RUNS = True
    ENDS = True

    def __init__(self) -> None:
        self.calls = 0

    def _end_run(self, inner: Any) -> None:
        self.calls += 1
        raise RuntimeError("end_run broke")


def _bad_engine(bad: LlamacppWrapped) -> tuple[LLMEngine, PluginHost]:
    host = PluginHost(PluginSettings(blocked={"npu", "cuda", "llamacpp"}))
    host.register(bad, "badruns")
    host.load()
    e = LLMEngine.from_model(MODEL, dtype="float32", decoder="badruns", max_batch_size=4, plugin_host=host,
                             decode_run_ms=RUN_MS)
    return e, host


@needs_llamacpp
@pytest.mark.parametrize("mode", ["raise", "garbage"])
def test_a_decoder_whose_run_fails_at_admission_is_declined(mode: str) -> None:
    # The engine's probe scenario runs a greedy run on a decoder that offers it (decoding/conformance.py).
    e, host = _bad_engine(_BadRuns(mode, fail_at=1))
    assert e.stats().decoder == "torch"
    why = {d["label"]: d["reason"] for d in e.decoder_choice.declined}
    assert ("aborted mid-run" if mode == "raise" else "is not 1 to") in why["badruns@cpu"], why


@needs_llamacpp
@pytest.mark.parametrize("mode", ["raise", "garbage"])
def test_a_run_failing_while_serving_fails_over_and_loses_no_request(mode: str) -> None:
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    reqs = {str(i): (p, sp) for i, p in enumerate(PROMPTS)}
    ref, _ = _drive(_engine(0.0, "torch"), reqs)
    bad = _BadRuns(mode, fail_at=2)  # the first run is the admission probe's
    e, host = _bad_engine(bad)
    assert e.stats().decoder == "badruns@cpu", e.decoder_choice
    e._run.observe(1.0)
    got, _ = _drive(e, reqs)
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in ref.items()}
    assert bad.runs == 2 and e.stats().decoder == "torch" and e.stats().decoder_failovers == 1
    fault = host.last_fault("badruns")
    assert fault is not None and fault.hook == "decoder.step" and "greedy_steps" in fault.reason
    assert ("aborted mid-run" if mode == "raise" else "is not 1 to") in fault.reason


class _Silent:
    """A drafter plugin whose drafter never drafts: whatever DeepSpec chooses, no proposal drafts anything."""

    DSPARK_API_VERSION = "1.1"

    def __init__(self) -> None:
        self.calls = 0

    @dspark.hookimpl
    def dspark_drafters(self, target: TargetModel) -> list[DrafterSpec]:
        outer = self

        class Drafter:
            def propose(self, tokens: list[int], k: int) -> Draft:
                outer.calls += 1
                return Draft(tokens=[])

        return [DrafterSpec(name="silent", kind="ngram", create=Drafter)]


@pytest.mark.parametrize("decoder", DECODERS)
def test_deepspec_runs_the_stretches_it_has_nothing_to_draft_for(decoder: str) -> None:
    """After DeepSpec's first proposals, two in a row without a draft let greedy runs of 2, 4, 8, ... steps take
    the stretch (a proposal between runs), with plain decoding's tokens."""
    plain = _first_tokens(decoder)
    host = PluginHost(PluginSettings(blocked={"npu", "cuda"}))
    silent = _Silent()
    host.register(silent, "silent")
    host.load()
    e = float_engine(decoder, decode_run_ms=RUN_MS, max_batch_size=4, plugin_host=host,
                     speculative_decoding={"strategy": "deepspec", "drafters": ["silent"], "stretch_ms": RUN_MS})
    assert e.spec is not None and [h.name for h in e.spec.handles] == ["silent"]
    calibration = silent.calls  # the startup calibration times the drafter
    done, streamed = _drive(e, {str(i): (p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
                                for i, p in enumerate(PROMPTS)})
    assert {k: v[0] for k, v in done.items()} == plain
    assert all(streamed[k] == v[1] for k, v in done.items())
    s = e.stats()
    # Prefill, single steps up to DeepSpec's first exploration, then runs of 2, 4, 8, ... steps with one
    # proposal after each: far fewer engine steps, and proposals, than tokens.
    assert s.forward_steps >= 40 and s.steps <= 2 + _EXPLORE_FIRST + 2 * 5, (s.steps, s.forward_steps)
    assert 0 < silent.calls - calibration <= len(PROMPTS) * (_EXPLORE_FIRST + 6)
    assert s.spec_drafts == 0


@pytest.mark.parametrize("decoder", DECODERS)
def test_deepspec_backs_off_a_batch_whose_proposals_yield_less_than_plain_decoding(
        decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose sequences draft something most steps (prompt lookup on code), with every verification slowed
    on purpose by 20 ms (a step of a few ms: no machine's noise crosses that): the proposals yield fewer tokens a
    ms than plain decoding, so after the first ones DeepSpec backs off to runs of 2, 4, ... 32 steps between
    proposals (speculative/runs/pays.py), and the tokens are plain decoding's."""
    n = 120
    plain = _first_tokens(decoder, n)
    e = float_engine(decoder, decode_run_ms=RUN_MS, max_batch_size=4,
                     speculative_decoding={"strategy": "deepspec", "drafters": ["prompt-lookup"]})
    assert e.spec is not None
    verify, verified = e.spec.verify, [0]

    def slowed(*a: Any) -> None:
        verified[0] += 1
        time.sleep(0.02)
        verify(*a)

    monkeypatch.setattr(e.spec, "verify", slowed)
    done, _ = _drive(e, {str(i): (p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                         for i, p in enumerate(PROMPTS)})
    assert {k: v[0] for k, v in done.items()} == plain
    s = e.stats()
    assert s.spec_drafts > 0  # it drafted, so the rule of proposals without a draft never let runs go
    # The first exploration's proposals, those before plain decoding is measured at 4 sequences, one after each
    # of the doubling runs: far fewer than the n a sequence would take proposing every step.
    assert verified[0] <= _EXPLORE_FIRST + EXPLORE_AFTER + 12, verified[0]
    assert s.steps * 3 < s.forward_steps, (s.steps, s.forward_steps)  # runs took the stretch


@needs_llamacpp
def test_a_decoder_whose_end_run_raises_is_charged_and_not_asked_again() -> None:
    # end_run is called from a request's arrival (the server's event loop): the plugin's fault is charged to it,
    # the arrival and the decoding go on, and its runs end at their budget from then on.
    bad = _BadEnd()
    e, host = _bad_engine(bad)
    assert e.stats().decoder == "badruns@cpu", e.decoder_choice
    e.end_run()
    e.end_run()
    assert bad.calls == 1
    assert [f.hook for f in host.faults.of("badruns")] == ["decoder.end_run"]
    done, _ = _drive(e, {"0": (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))})
    assert done["0"][0] == _first_tokens("llamacpp")["0"]
    assert e.runner.failovers == []


@pytest.mark.parametrize("decoder", DECODERS)
def test_the_engine_times_a_targets_runs_and_rolls_them_back(decoder: str) -> None:
    # A target that runs greedy runs is timed at them too (timing.run_b1: a run's time over its steps), and the
    # cache the timing used is as it was after each one: every run sees the same context.
    from dspark.llm.decoding.timing import Bench, shapes, time_targets

    e = _engine(RUN_MS, decoder)
    dr = e.runner
    bs = 16 if dr.current.keeps_kv else dr.current.compiled.block_size
    vocab = dr.reference.cfg.vocab_size
    both = Bench(dr.step, lambda n: dr.make_cache(n, bs), bs, max_seqs=1, context=40, max_rows=130, vocab=vocab,
                 greedy=dr.greedy_steps)
    lens = dict(both.cache.seq_lens)
    timed_run: list[float] = []
    real_run = both.run

    def counted(shape: Any) -> float:
        dt = real_run(shape)
        assert both.cache.seq_lens == lens  # rolled back
        if shape.run:
            timed_run.append(dt)
        return dt

    both.run = counted  # type: ignore[method-assign]
    sl = [s for s in shapes(1, 16) if s.name in ("decode_b1", "run_b1")]
    got = time_targets({"both": both}, sl, reps=1, blocks=1, span_s=0)["both"]
    assert set(got) == {"decode_b1", "run_b1"} and got["run_b1"] > 0 and timed_run
    steps_only = Bench(dr.step, lambda n: dr.make_cache(n, bs), bs, max_seqs=1, context=40, max_rows=130,
                       vocab=vocab)
    assert set(time_targets({"s": steps_only}, sl, reps=1, blocks=1, span_s=0)["s"]) == {"decode_b1"}
