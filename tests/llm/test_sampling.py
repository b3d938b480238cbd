"""Sampling parameters: greedy, temperature/top-k/top-p, seeds, stop conditions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from llm_testutil import random_prompts

from dspark.llm import SamplingParams
from dspark.llm.sampling import distribution, sample, sample_rows


def test_sampler_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, 2.8, -5.0])
    g = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(temperature=0), None) == 1
    assert sample(logits, SamplingParams(top_k=1), g) == 1
    assert {sample(logits, SamplingParams(top_k=3, temperature=5.0), g) for _ in range(200)} == {1, 2, 3}
    assert {sample(logits, SamplingParams(top_p=0.01), g) for _ in range(50)} == {1}
    # top_p keeps the smallest prefix reaching p: the top two here carry ~0.69 of the mass.
    assert {sample(logits, SamplingParams(top_p=0.6), g) for _ in range(200)} == {1, 2}


def test_seed_is_reproducible_regardless_of_batch(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=123, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], p)[0].token_ids
    crowd = llm.generate([[9, 9], [5, 6, 7], [4]], [SamplingParams(max_tokens=7, temperature=1.0, seed=1), p,
                                                     SamplingParams(max_tokens=3, temperature=0.7)])
    assert crowd[1].token_ids == alone
    other = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=1.0, seed=124, ignore_eos=True))
    assert other[0].token_ids != alone


def test_max_tokens_and_length(make_llm: Callable[..., Any]) -> None:
    (out,) = make_llm().generate([[5, 6]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.usage.prompt_tokens == 2 and out.usage.completion_tokens == 5 and out.usage.total_tokens == 7


def test_stop_token_ids_and_eos(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    prompt = random_prompts(1, seed=8)[0]
    full = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    tok = full[4]
    cut = full.index(tok) + 1
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[tok]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[:cut]
    llm.engine.eos_ids = {tok}  # the same token as the model's EOS
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert out.finish_reason == "stop" and out.token_ids == full[:cut]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == full


def test_stop_string_truncates_text_and_stream(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    base = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate("def hello", base)[0].text
    i = next(i for i, ch in enumerate(full) if i >= 3 and ch.isascii() and ch.isprintable())
    stop = full[i]
    params = base.model_copy(update={"stop": [stop, "never-there"]})
    out = llm.generate("def hello", params)[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)] and stop not in out.text
    assert "".join(llm.generate_stream("def hello", params)) == out.text


def test_stop_accepts_a_single_string() -> None:
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]


@pytest.mark.parametrize("bad", [{"top_p": 0.0}, {"temperature": -1.0}, {"top_k": -2}, {"bogus": 1}])
def test_bad_params_name_the_field(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def _full_sort_prefix(probs: torch.Tensor, top_p: float) -> set[int]:
    """top_p's kept tokens by a full sort: the smallest prefix, largest first, reaching top_p."""
    sp, si = torch.sort(probs, descending=True)
    drop = (torch.cumsum(sp, 0) - sp) >= top_p
    drop[0] = False
    return set(si[~drop].tolist())


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0])  # flat to peaked: from thousands of tokens kept to a few
def test_top_p_draws_only_what_a_full_sort_keeps(scale: float) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(8192, generator=g) * scale
    probs = torch.softmax(logits, dim=-1)
    for top_p in (1e-9, 0.1, 0.5, 0.9, 0.99):
        kept = _full_sort_prefix(probs, top_p)
        gen = torch.Generator().manual_seed(2)
        drawn = {sample(logits, SamplingParams(top_p=top_p), gen) for _ in range(300)}
        assert drawn <= kept, top_p
        support = distribution(logits, SamplingParams(top_p=top_p)).nonzero().flatten().tolist()
        assert set(support) == kept, top_p
        if len(kept) <= 3:
            assert drawn == kept


def test_the_sampler_draws_from_the_distribution_it_keeps() -> None:
    """A flat row of 300 tokens (top_p 0.9 keeps 270, drawn by rejection with a rising pivot), and with
    temperature and top_k: the counts of 30,000 draws against distribution()'s probabilities (chi-square)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=g) * 0.05
    for p in (SamplingParams(top_p=0.9), SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=40)):
        dist = distribution(logits, p).double().numpy()
        gen = torch.Generator().manual_seed(1)
        counts = np.bincount([sample(logits, p, gen) for _ in range(30000)], minlength=300)
        assert (counts[dist == 0] == 0).all()
        live = dist > 0
        assert chisquare(counts[live], dist[live] / dist[live].sum() * counts.sum()).pvalue > 1e-4, p


def test_rows_sampled_as_a_batch_pick_what_each_row_picks_alone() -> None:
    """The engine samples a step's plain rows as one batch (sample_rows): each row, with its own seeded
    generator, must draw the tokens it draws alone, whatever rows share the batch (greedy, top_k, top_p
    that rejects and draws again, temperature only)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 2048, generator=g) * torch.tensor([0.2, 1.0, 3.0, 0.5, 2.0, 0.05, 1.0])[:, None]
    params = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=0.0),
              SamplingParams(top_p=0.5), SamplingParams(temperature=1.3, top_k=40), SamplingParams(temperature=0.7),
              SamplingParams(top_p=0.9, top_k=100), SamplingParams(top_p=1e-9)]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(7)]
    together = [sample_rows(logits, params, gens) for _ in range(50)]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(7)]
    alone = [[sample(logits[i], params[i], gens[i]) for i in range(7)] for _ in range(50)]
    assert together == alone
    assert len({t[0] for t in together}) > 5  # rows really drew (not one token every time)
    assert {t[1] for t in together} == {int(logits[1].argmax())} and {t[6] for t in together} == {int(logits[6].argmax())}
