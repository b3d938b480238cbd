"""Logits processing, raw logprobs and grammar constraints, checked against transformers on the
embedded model, and losslessly the same under speculative decoding."""

from __future__ import annotations

import json
import math
import sys
import types
from collections.abc import Iterator
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from scipy.stats import chisquare

from dspark.llm import LLM, GuidedSpec, SamplingParams, TokenLogprobs, default_model_path
from dspark.llm.logits import process, token_logprobs
from dspark.llm.sampling import distribution
from dspark.llm.scheduler import ScheduledChunk, Sequence
from dspark.llm.speculative.verify import accept_processed, accept_sampling, clip_to_grammar, grammar_prefix

PROMPTS = ["def hello(name):", "import os\n", "class Stack:\n    def push(self, x):"]
EOS = 1
N = 16  # new tokens per request


def _greedy(**kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", N)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(temperature=0, **kw)


@cache
def _hf() -> Any:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # full length unless a test says otherwise
    return m


def _hf_logits(ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf()(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def spec_self() -> LLM:
    return LLM(dtype="float32", speculative_decoding={"strategy": "fixed", "drafters": ["self"],
                                                      "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def spec_model() -> LLM:
    return LLM(dtype="float32", speculative_decoding={"strategy": "fixed", "drafters": ["model"],
                                                      "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def prompt_ids(plain: LLM) -> list[list[int]]:
    return [plain.engine.encode(p) for p in PROMPTS]


@pytest.fixture(autouse=True)
def _pages_back(plain: LLM) -> Iterator[None]:
    yield
    assert plain.engine.cache.all_free()


# -- a test grammar: one of a few token sequences, then EOS ----------------------------------------


class ChoiceConstraint:
    """Allows exactly the token sequences ``choices``, each followed by EOS (a tiny trie)."""

    def __init__(self, choices: list[list[int]], vocab: int, eos: int = EOS) -> None:
        self.choices, self.vocab, self.eos = choices, vocab, eos
        self.done: list[int] = []
        self.ended = False
        self.refused = 0

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        if self.ended:
            return mask
        n = len(self.done)
        for c in self.choices:
            if c[:n] == self.done:
                mask[c[n] if len(c) > n else self.eos] = True
        return mask

    def accept(self, token: int) -> bool:
        if not bool(self.allowed()[token]):
            self.refused += 1
            return False
        self.done.append(token)
        self.ended = token == self.eos
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            self.done.pop()
        self.ended = bool(self.done) and self.done[-1] == self.eos

    def is_terminated(self) -> bool:
        return self.ended


@pytest.fixture
def grammar(monkeypatch: pytest.MonkeyPatch) -> list[ChoiceConstraint]:
    """Stands in for dspark.llm.structured: a ``grammar`` spec's value is a JSON list of token lists."""
    made: list[ChoiceConstraint] = []

    def build_constraint(engine: Any, spec: GuidedSpec) -> ChoiceConstraint:
        c = ChoiceConstraint(json.loads(spec.value or "[]"), engine.runner.cfg.vocab_size)
        made.append(c)
        return c

    mod = types.ModuleType("dspark.llm.structured")
    mod.build_constraint = build_constraint  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dspark.llm.structured", mod)
    return made


def _guided(choices: list[list[int]]) -> GuidedSpec:
    return GuidedSpec(kind="grammar", value=json.dumps(choices))


# -- parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty",
                                   "repetition_penalty"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValidationError, match=f"{field} must be a finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(("bad", "msg"), [
    ({"presence_penalty": 2.5}, "presence_penalty must be between -2 and 2"),
    ({"frequency_penalty": -3}, "frequency_penalty must be between -2 and 2"),
    ({"repetition_penalty": 0}, "repetition_penalty must be between 0.01 and 100"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty must be between 0.01 and 100"),
    ({"logit_bias": {5: 101}}, "logit_bias for token 5 must be between -100 and 100"),
    ({"logit_bias": {5: math.nan}}, "logit_bias for token 5 must be a finite number"),
    ({"logit_bias": {-3: 1}}, "logit_bias token id -3"),
    ({"logprobs": 21}, "logprobs must be between 0 and 20"),
    ({"logprobs": -1}, "logprobs must be between 0 and 20"),
    ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20"),
    ({"min_tokens": -1}, "min_tokens must be >= 0"),
    ({"min_tokens": 17, "max_tokens": 16}, r"min_tokens \(17\) must be <= max_tokens \(16\)"),
    ({"guided": {"kind": "regex"}}, "needs a value"),
    ({"guided": {"kind": "choice", "value": "[1, 2]"}}, "JSON list of strings"),
    ({"guided": {"kind": "xml", "value": "x"}}, "guided.kind"),
])
def test_bad_params_are_refused_clearly(bad: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValidationError, match=msg):
        SamplingParams(**bad)


def test_params_defaults_and_processing_flag() -> None:
    p = SamplingParams(logit_bias={"7": 2})  # JSON object keys are strings
    assert p.logit_bias == {7: 2.0} and p.needs_processing
    assert not SamplingParams().needs_processing and not SamplingParams(logprobs=3).needs_processing
    for kw in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1},
               {"min_tokens": 1}, {"guided": {"kind": "json_object"}}):
        assert SamplingParams(**kw).needs_processing, kw


def test_engine_refuses_bad_ids_and_lengths(plain: LLM) -> None:
    with pytest.raises(ValueError, match="logit_bias token id 8192 is outside the vocabulary"):
        plain.engine.make_sequence("x", "hi", SamplingParams(logit_bias={8192: 1.0}))
    with pytest.raises(ValueError, match="max_model_len 2048 exceeds the model's max_position_embeddings 1024"):
        LLM(dtype="float32", max_model_len=2048)


# -- the processor itself ---------------------------------------------------------------------------


def test_process_order_and_semantics_on_a_row() -> None:
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    batch = row[None].repeat(2, 1)
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias={5: -1.5}, min_tokens=3, stop_token_ids=[4])
    got = process(batch[0], [0, 1], [2, 2, 3], p, None, {3})
    # output has 3 tokens (= min_tokens): nothing blocked. Repetition over prompt+output {0,1,2,3}:
    # 2 -> 1, -1 -> -2, 0.5 -> 0.25, 3 -> 1.5; then counts {2: 2, 3: 1}.
    want = torch.tensor([1.0, -2.0, 0.25 - 0.5 - 0.5, 1.5 - 0.5 - 0.25, -2.0, 1.0 - 1.5])
    torch.testing.assert_close(got, want)
    assert torch.equal(batch[0], row)  # the batch's row is left alone
    early = process(row, [0], [2], p, None, {3})  # 1 < min_tokens: EOS 3 and stop token 4 blocked
    assert early[3] == -math.inf and early[4] == -math.inf and torch.isfinite(early[[0, 1, 2, 5]]).all()
    no_eos = process(row, [0], [2], p.model_copy(update={"ignore_eos": True}), None, {3})
    assert torch.isfinite(no_eos[3]) and no_eos[4] == -math.inf  # an ignored EOS is no stop: as vLLM


def test_grammar_mask_wins_over_min_tokens() -> None:
    """At the grammar's end only EOS is allowed; min_tokens would block it too: the grammar's EOS stands."""
    c = ChoiceConstraint([[2]], vocab=5, eos=1)
    assert c.accept(2)
    out = process(torch.zeros(5), [0], [2], SamplingParams(min_tokens=4, max_tokens=8), c, {1})
    assert out.argmax() == 1 and torch.isinf(out[[0, 2, 3, 4]]).all()


def test_raw_logprobs_of_a_row() -> None:
    row = torch.tensor([1.0, 3.0, 2.0, -1.0])
    lp = torch.log_softmax(row, -1)
    got = token_logprobs(row, 2, 2)
    assert got.token_id == 2 and got.logprob == pytest.approx(float(lp[2]))
    assert [t for t, _ in got.top] == [1, 2] and got.top[0][1] == pytest.approx(float(lp[1]))
    assert token_logprobs(row, 0, 0).top == []


# -- against transformers -------------------------------------------------------------------------


def _check_logprobs(prompt: list[int], out: Any, n: int) -> None:
    ref = torch.log_softmax(_hf_logits(prompt + out.token_ids)[len(prompt) - 1 : -1], -1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert isinstance(lp, TokenLogprobs) and lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        v, ix = torch.topk(ref[i], n)
        assert [t for t, _ in lp.top] == ix.tolist()
        np.testing.assert_allclose([x for _, x in lp.top], v.numpy(), atol=1e-4)


def test_raw_logprobs_match_transformers(plain: LLM, prompt_ids: list[list[int]]) -> None:
    # With a penalty the logprobs are still the model's raw ones, as vLLM's default raw_logprobs.
    outs = plain.generate(prompt_ids, [_greedy(logprobs=5), _greedy(logprobs=0, repetition_penalty=1.5),
                                       SamplingParams(max_tokens=N, temperature=0.9, seed=3, logprobs=3)])
    for p, o, n in zip(prompt_ids, outs, (5, 0, 3)):
        _check_logprobs(p, o, n)
    assert plain.generate(prompt_ids[:1], _greedy())[0].logprobs is None


def _check_prompt_logprobs(prompt: list[int], out: Any, n: int) -> None:
    ref = torch.log_softmax(_hf_logits(prompt)[:-1], -1)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt) - 1
    for k, lp in enumerate(out.prompt_logprobs):  # entry k: prompt token k + 1
        assert lp.token_id == prompt[k + 1] and lp.logprob == pytest.approx(float(ref[k, prompt[k + 1]]), abs=1e-4)
        assert [t for t, _ in lp.top] == torch.topk(ref[k], n).indices.tolist()


@pytest.mark.parametrize("spec", [None, "spec_self"])
def test_prompt_logprobs_match_transformers_through_chunked_prefill(spec: str | None, request: pytest.FixtureRequest,
                                                                    prompt_ids: list[list[int]]) -> None:
    llm = LLM(dtype="float32", max_num_batched_tokens=5) if spec is None else request.getfixturevalue(spec)
    outs = llm.generate(prompt_ids, [_greedy(max_tokens=4, prompt_logprobs=2, logprobs=1), _greedy(max_tokens=4),
                                     SamplingParams(max_tokens=3, temperature=0.7, seed=1, prompt_logprobs=0)])
    _check_prompt_logprobs(prompt_ids[0], outs[0], 2)
    _check_prompt_logprobs(prompt_ids[2], outs[2], 0)
    _check_logprobs(prompt_ids[0], outs[0], 1)
    assert outs[1].prompt_logprobs is None
    assert llm.engine.cache.all_free()


def test_prompt_and_output_logprobs_survive_preemption(plain: LLM) -> None:
    text = "import os\nimport sys\nprint(os.getcwd(), sys.argv)\nfor i in range(10):\n    print(i * i)\n"
    prompts = [plain.engine.encode(text[i:]) for i in (0, 7, 14, 21)]
    llm = LLM(dtype="float32", page_size=4, max_total_tokens=80, max_num_batched_tokens=8)
    params = _greedy(max_tokens=10, prompt_logprobs=1, logprobs=1)
    outs = llm.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    for p, o in zip(prompts, outs):
        _check_prompt_logprobs(p, o, 1)
        _check_logprobs(p, o, 1)


def test_repetition_penalty_matches_transformers_generate(plain: LLM, prompt_ids: list[list[int]]) -> None:
    base = [o.token_ids for o in plain.generate(prompt_ids, _greedy())]
    outs = plain.generate(prompt_ids, _greedy(repetition_penalty=1.3))
    for p, o, b in zip(prompt_ids, outs, base):
        ids = torch.tensor([p])
        ref = _hf().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                             repetition_penalty=1.3, pad_token_id=3)[0, len(p):].tolist()
        assert o.token_ids == ref
    assert [o.token_ids for o in outs] != base  # the penalty changed something


def test_logit_bias_and_min_tokens_match_transformers(plain: LLM, prompt_ids: list[list[int]]) -> None:
    p = prompt_ids[1]
    base = plain.generate([p], _greedy())[0].token_ids
    stop = base[1]  # a token greedy decoding emits early
    bias = {base[0]: -100.0, 42: 7.5}
    params = SamplingParams(max_tokens=N, temperature=0, logit_bias=bias, min_tokens=6, stop_token_ids=[stop])
    out = plain.generate([p], params)[0]
    ids = torch.tensor([p])
    ref = _hf().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                         sequence_bias={(t,): b for t, b in bias.items()}, min_new_tokens=6,
                         eos_token_id=[EOS, stop], pad_token_id=3)[0, len(p):].tolist()
    end = next((i + 1 for i, t in enumerate(ref) if t in (EOS, stop)), len(ref))
    assert out.token_ids == ref[:end] and len(out.token_ids) >= 6
    if len(out.token_ids) < N:  # stopped on a stop token (kept in token_ids, as EOS is)
        assert out.finish_reason == "stop" and out.token_ids[-1] in (EOS, stop)
    assert out.token_ids[0] != base[0] and stop not in out.token_ids[:5]


def test_presence_and_frequency_penalties_step_by_step(plain: LLM, prompt_ids: list[list[int]]) -> None:
    pres, freq = 0.8, 0.6
    outs = plain.generate(prompt_ids, _greedy(presence_penalty=pres, frequency_penalty=freq))
    base = [o.token_ids for o in plain.generate(prompt_ids, _greedy())]
    for p, o in zip(prompt_ids, outs):
        gen: list[int] = []
        for _ in range(N):  # OpenAI's formula over the output so far, on transformers' logits
            lg = _hf_logits(p + gen)[-1]
            counts = torch.bincount(torch.tensor(gen, dtype=torch.long), minlength=lg.shape[0]).float()
            gen.append(int(torch.argmax(lg - freq * counts - pres * (counts > 0).float())))
        assert o.token_ids == gen
    assert [o.token_ids for o in outs] != base


def test_min_tokens_defers_eos_and_stop_strings(plain: LLM) -> None:
    eng = plain.engine
    base = plain.generate("import os\n", _greedy())[0]
    stop_text = plain.engine.tokenizer.decode(base.token_ids[:1])
    assert len(plain.generate("import os\n", _greedy(stop=[stop_text]))[0].token_ids) == 1
    out = plain.generate("import os\n", _greedy(stop=[stop_text], min_tokens=5))[0]
    assert len(out.token_ids) >= 5 and out.token_ids[:5] == base.token_ids[:5]
    eng.eos_ids = {base.token_ids[0]}  # EOS is greedy's first token: blocked until 3 tokens
    try:
        out = plain.generate("import os\n", SamplingParams(max_tokens=N, temperature=0, min_tokens=3))[0]
    finally:
        eng.eos_ids = {EOS}
    assert base.token_ids[0] not in out.token_ids[:3] and len(out.token_ids) >= 3


def test_grammar_constrained_greedy_matches_a_masked_reference(plain: LLM, prompt_ids: list[list[int]],
                                                               grammar: list[ChoiceConstraint]) -> None:
    p = prompt_ids[0]
    base = plain.generate([p], _greedy())[0].token_ids
    choices = [base[:4] + [77, 78], [base[0], 90, 91], [55]]  # greedy's own path, then off it
    out = plain.generate([p], _greedy(guided=_guided(choices)))[0]
    ref, c = [], ChoiceConstraint(choices, 8192)
    while not c.is_terminated():  # transformers' logits, masked by the same grammar
        t = int(torch.argmax(_hf_logits(p + ref)[-1].masked_fill(~c.allowed(), -math.inf)))
        assert c.accept(t)
        ref.append(t)
    assert out.token_ids == ref and ref[-1] == EOS and out.finish_reason == "stop"
    assert ref[:-1] in choices and grammar[0].done == ref and grammar[0].refused == 0


def test_queue_time_and_logprobs_views_while_streaming(plain: LLM) -> None:
    eng = plain.engine
    eng.add_request("lp", "def hello(name):", _greedy(max_tokens=6, logprobs=1))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [len(o.logprobs) for o in outs] == [len(o.token_ids) for o in outs] == list(range(1, 7))
    assert outs[0].logprobs[0] == outs[-1].logprobs[0] and outs[-1].logprobs[-2:] == list(outs[-1].logprobs)[4:]
    assert outs[0].first_scheduled is not None and outs[0].first_scheduled == outs[-1].first_scheduled


# -- speculative decoding: the same outputs ----------------------------------------------------------


def _cases(base: list[list[int]]) -> list[SamplingParams]:
    """Greedy requests exercising every kind of processing, for prompts whose plain greedy is ``base``."""
    return [
        _greedy(repetition_penalty=1.3, logprobs=3),
        _greedy(presence_penalty=0.8, frequency_penalty=0.5, logprobs=0),
        SamplingParams(max_tokens=N, temperature=0, logit_bias={base[2][0]: -100.0, 42: 4.0}, min_tokens=4,
                       stop_token_ids=[base[2][1]]),
        _greedy(logprobs=2),
    ]


def _same(a: Any, b: Any) -> None:
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason and a.text == b.text
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


@pytest.mark.parametrize("spec", ["spec_self", "spec_model"])
def test_speculation_is_lossless_with_processing_and_logprobs(spec: str, request: pytest.FixtureRequest,
                                                              plain: LLM, prompt_ids: list[list[int]]) -> None:
    llm: LLM = request.getfixturevalue(spec)
    base = [o.token_ids for o in plain.generate(prompt_ids, _greedy())]
    prompts = [p for p in prompt_ids for _ in range(4)]
    params = _cases(base) * len(prompt_ids)
    before = llm.stats().spec_accepted_tokens
    ref = plain.generate(prompts, params)
    got = llm.generate(prompts, params)
    for a, b in zip(got, ref):
        _same(a, b)
    assert llm.stats().spec_accepted_tokens > before  # drafts were verified and taken
    assert llm.engine.cache.all_free()


def test_speculation_with_deepspec_is_lossless(plain: LLM, prompt_ids: list[list[int]],
                                               grammar: list[ChoiceConstraint]) -> None:
    llm = LLM(dtype="float32", speculative_decoding={"strategy": "deepspec"})
    base = [o.token_ids for o in plain.generate(prompt_ids, _greedy())]
    params = _cases(base)[:3] + [_greedy(guided=_guided([base[0][:8] + [5, 6], base[0][:3]]))]
    prompts = [prompt_ids[0]] * 4
    for a, b in zip(llm.generate(prompts, params), plain.generate(prompts, params)):
        _same(a, b)
    assert llm.engine.cache.all_free()


@pytest.mark.parametrize("spec", ["spec_self", "spec_model"])
def test_speculation_is_lossless_under_a_grammar(spec: str, request: pytest.FixtureRequest, plain: LLM,
                                                 prompt_ids: list[list[int]], grammar: list[ChoiceConstraint]) -> None:
    llm: LLM = request.getfixturevalue(spec)
    base = [o.token_ids for o in plain.generate(prompt_ids, _greedy())]
    # Long runs of the model's own greedy text (drafts get accepted), then a turn the drafter cannot guess.
    choices = [[b[:10] + [300, 301], b[:5] + [302]] for b in base]
    params = [_greedy(guided=_guided(c), logprobs=1) for c in choices]
    ref = plain.generate(prompt_ids, params)
    before = llm.stats().spec_accepted_tokens
    got = llm.generate(prompt_ids, params)
    for a, b, c in zip(got, ref, choices):
        _same(a, b)
        assert a.token_ids[:-1] in c and a.token_ids[-1] == EOS and a.finish_reason == "stop"
    assert llm.stats().spec_accepted_tokens > before
    assert sum(c.refused for c in grammar) > 0  # some drafts ran off the grammar and were cut


def test_sampling_under_speculation_keeps_the_grammar_and_target_logprobs(
        spec_model: LLM, prompt_ids: list[list[int]], grammar: list[ChoiceConstraint]) -> None:
    p = prompt_ids[0]
    base = spec_model.generate([p], _greedy())[0].token_ids
    choices = [base[:6] + [300], base[:3] + [301, 302], [base[0], 303]]
    params = [SamplingParams(max_tokens=N, temperature=0.8, seed=s, guided=_guided(choices), logprobs=2)
              for s in range(4)]
    params += [SamplingParams(max_tokens=N, temperature=1.0, seed=9, logprobs=2, presence_penalty=0.5)]
    outs = spec_model.generate([p] * len(params), params)
    for o in outs[:4]:
        assert o.token_ids[:-1] in choices and o.token_ids[-1] == EOS
    for o in outs:
        _check_logprobs(p, o, 2)  # the target's values, never the drafter's


# -- the verification rules themselves ----------------------------------------------------------------


def _seq(params: SamplingParams, out: list[int] | None = None, constraint: Any = None) -> Sequence:
    return Sequence("s", None, [0, 1], params, 0, 0, output_ids=list(out or []), constraint=constraint)


def test_processed_greedy_verification_judges_each_row_after_the_accepted_tokens() -> None:
    rows = torch.zeros(4, 6)
    rows[:, 3] = 1.0  # the raw argmax is always 3
    rows[:, 4] = 0.9
    seq = _seq(SamplingParams(temperature=0, presence_penalty=0.5, logprobs=1))
    # Row 0: 3 wins. Row 1: 3 has been emitted (-0.5) so 4 wins: the draft [3, 3, ...] breaks at 1.
    toks, n_acc, lps = accept_processed(seq, [3, 3, 4], None, rows, {5}, None)
    assert (toks, n_acc) == ([3, 4], 1)
    assert lps is not None and [lp.token_id for lp in lps] == [3, 4]
    assert lps[1].logprob == pytest.approx(float(torch.log_softmax(rows[1], -1)[4]))  # raw, not penalised
    toks, n_acc, _ = accept_processed(seq, [3, 4, 3], None, rows, {5}, None)
    assert (toks, n_acc) == ([3, 4, 3, 3], 3)  # all accepted, then the bonus row (presence counts once)


@pytest.mark.parametrize("deterministic", [False, True])
def test_processed_sampling_verification_samples_the_processed_distribution(deterministic: bool) -> None:
    g = torch.Generator().manual_seed(0)
    V = 6
    rows = torch.randn(3, V, generator=g) * 1.5
    params = SamplingParams(temperature=1.0, logit_bias={0: 2.0}, presence_penalty=1.0, repetition_penalty=1.2)
    seq = _seq(params, out=[4])
    p0 = distribution(process(rows[0], seq.prompt_ids, seq.output_ids, params, None, set()), params)
    q = None if deterministic else torch.softmax(torch.randn(2, V, generator=g), -1)
    gen = torch.Generator().manual_seed(1)
    counts = np.zeros(V)
    for _ in range(3000):
        draft = [2, 0] if q is None else [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        toks, _, _ = accept_processed(seq, draft, q, rows, set(), gen)
        counts[toks[0]] += 1
    exp = p0.numpy() * counts.sum()
    keep = exp >= 5
    obs, exp = np.append(counts[keep], counts[~keep].sum()), np.append(exp[keep], exp[~keep].sum())
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3
    # ... and the raw rows' distribution is a different one (the check above can fail).
    raw = distribution(rows[0], params).numpy()
    assert np.abs(raw - p0.numpy()).max() > 0.05


def test_plain_sampling_rule_is_unchanged_by_the_refactor() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 7, generator=g), -1)
    q = torch.softmax(torch.randn(2, 7, generator=g), -1)
    runs = [accept_sampling([1, 2], q, p, torch.Generator().manual_seed(s)) for s in range(20)]
    seqs = [accept_processed(_seq(SamplingParams()), [1, 2], q, torch.log(p), set(),
                             torch.Generator().manual_seed(s))[:2] for s in range(20)]
    assert runs == [tuple(s) for s in seqs]


def test_drafts_are_cut_where_the_grammar_refuses() -> None:
    c = ChoiceConstraint([[5, 6, 7]], vocab=10)
    assert grammar_prefix(c, [5, 6, 9, 7]) == 2 and c.done == []  # state left as it was
    assert grammar_prefix(c, [5, 6, 7, 1, 4]) == 4  # through EOS, nothing after it

    class P:
        def __init__(self, toks: list[int], q: torch.Tensor | None) -> None:
            self.tokens, self.q = toks, q

    seq = _seq(SamplingParams(), constraint=c)
    det, sto = P([5, 8, 6], None), P([5, 8, 6], torch.full((3, 10), 0.1))
    clip_to_grammar([ScheduledChunk(seq, 1)], {"s": det})
    assert det.tokens == [5]
    clip_to_grammar([ScheduledChunk(seq, 1)], {"s": sto})  # a sampled draft keeps the refused token
    assert sto.tokens == [5, 8] and sto.q is not None and sto.q.shape[0] == 2


def test_a_sampled_draft_cut_by_the_grammar_still_samples_exactly() -> None:
    """Dropping the refused token too would emit from p whenever q drew a refused token: biased."""
    V = 4
    rows = torch.zeros(2, V)  # p = uniform over what the grammar allows: tokens 0 and 1
    q = torch.tensor([[0.5, 0.0, 0.5, 0.0]])  # the drafter likes 0 and a refused token, never 1
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(2)
    counts = np.zeros(V)
    for _ in range(2000):
        c = ChoiceConstraint([[0], [1]], vocab=V, eos=3)
        seq = _seq(params, constraint=c)
        x = int(torch.multinomial(q[0], 1, generator=gen))
        d = types.SimpleNamespace(tokens=[x], q=q.clone())
        clip_to_grammar([ScheduledChunk(seq, 1)], {"s": d})
        toks, _, _ = accept_processed(seq, d.tokens, d.q, rows[: len(d.tokens) + 1], {3}, gen)
        counts[toks[0]] += 1
    assert counts[2:].sum() == 0
    assert chisquare(counts[:2], [1000, 1000]).pvalue > 1e-3
