"""Bad input and faults: each gets a clear error or a defined result, never a hang or a leak."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from llm_testutil import random_prompts

from dspark.llm import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def test_prompt_longer_than_max_model_len(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(max_model_len=32)
    with pytest.raises(ValueError, match="prompt of 40 tokens does not fit max_model_len=32"):
        llm.generate([list(range(3, 43))], GREEDY)


@pytest.mark.parametrize("n", [0, -3])
def test_non_positive_max_tokens(n: int) -> None:
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=n)


def test_empty_prompt_is_bos_only(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    text_out, ids_out = llm.generate(["", []], GREEDY)
    assert text_out.prompt_token_ids == [1] and ids_out.prompt_token_ids == [1]
    assert text_out.token_ids == ids_out.token_ids and len(text_out.token_ids) == 6


def test_empty_prompt_without_bos_is_an_error(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    llm.engine.inputs = dataclasses.replace(llm.engine.inputs, bos_token_id=None)  # a model without one
    with pytest.raises(ValueError, match="empty prompt, and the model has no bos_token_id"):
        llm.generate([[]], GREEDY)


def test_token_outside_vocab(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match="token id 9999 is outside the vocabulary"):
        make_llm().generate([[5, 9999]], GREEDY)


def test_request_that_can_never_fit_the_kv_budget(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(page_size=4, max_total_tokens=32)
    with pytest.raises(ValueError, match=r"may need 70 KV tokens \(prompt 20 \+ max_tokens 50\).*allows 32"):
        llm.generate([[5, 6], list(range(3, 23))], [GREEDY, SamplingParams(max_tokens=50)])
    assert llm.engine.cache.all_free() and not llm.engine.has_unfinished()  # nothing half-queued


def test_more_requests_than_the_budget_holds_all_complete(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(page_size=4, max_total_tokens=32)
    outs = llm.generate(random_prompts(10, seed=11, lo=5, hi=20), GREEDY)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)


def test_cancel_mid_generation_returns_pages(make_llm: Callable[..., Any]) -> None:
    eng = make_llm(page_size=4).engine
    eng.add_request("a", list(range(3, 30)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    eng.add_request("b", [5, 6], GREEDY)
    for _ in range(3):
        eng.step()
    used = eng.stats().kv_used_pages
    out = eng.abort("a")
    assert out is not None and out.finish_reason == "abort" and len(out.token_ids) == 3
    assert eng.stats().kv_used_pages < used and "a" not in eng.cache.block_tables
    assert eng.abort("a") is None  # idempotent
    while eng.has_unfinished():
        eng.step()
    assert eng.cache.all_free()


def test_duplicate_request_id(make_llm: Callable[..., Any]) -> None:
    eng = make_llm().engine
    eng.add_request("a", [5], GREEDY)
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        eng.add_request("a", [6], GREEDY)
    eng.abort("a")
