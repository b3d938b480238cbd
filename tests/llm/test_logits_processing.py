"""Logits processing and raw logprobs, checked against transformers on the embedded model. The same
under speculative decoding, and the processed verification rules: speculative/test_speculative_processing.py.
The fixtures (plain, spec_self, prompt_ids, grammar) are in tests/llm/conftest.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from logits_testutil import EOS, N, ChoiceConstraint, _check_logprobs, _greedy, _guided, _hf, _hf_logits
from pydantic import ValidationError

from dspark.llm import LLM, SamplingParams
from dspark.llm.logits import process, token_logprobs

# Every test here ends with the plain engine's KV pages all back (tests/llm/conftest.py's _pages_back).
pytestmark = pytest.mark.usefixtures("_pages_back")


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
