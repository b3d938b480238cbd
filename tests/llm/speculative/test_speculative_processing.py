"""Logits processing, raw logprobs and grammar constraints are losslessly the same under speculative
decoding, on the embedded model; and the processed verification rules themselves
(dspark.llm.speculative.verify). The plain engine against transformers: tests/llm/test_logits_processing.py.
The fixtures (plain, spec_self, spec_model, prompt_ids, grammar) are in tests/llm/conftest.py."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
import torch
from logits_testutil import EOS, N, ChoiceConstraint, _check_logprobs, _greedy, _guided
from scipy.stats import chisquare

from dspark.llm import LLM, SamplingParams
from dspark.llm.logits import process
from dspark.llm.sampling import distribution
from dspark.llm.scheduler import ScheduledChunk, Sequence
from dspark.llm.speculative.verify import accept_processed, accept_sampling, clip_to_grammar, grammar_prefix

# Every test here ends with the plain engine's KV pages all back (tests/llm/conftest.py's _pages_back).
pytestmark = pytest.mark.usefixtures("_pages_back")


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
