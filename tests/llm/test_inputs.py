"""Input processing (dspark.llm.inputs): the engine's request checks, and the same checks rebuilt from a
description, as a cluster's ingress runs them without a model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dspark.llm import LLM, AsyncLLMEngine, SamplingParams
from dspark.llm.inputs import InputProcessor
from dspark.llm.sampling import GuidedSpec


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=64, max_total_tokens=32, dtype="float32", decoder="torch")


def _error(fn: Any, *args: Any) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


def test_the_engines_checks_are_its_input_processors(llm: LLM) -> None:
    eng = llm.engine
    inputs = eng.inputs
    assert AsyncLLMEngine(eng).inputs is inputs  # one processor: its grammar tables are built once
    assert (inputs.max_model_len, inputs.kv_tokens, inputs.vocab_size) == (
        64, eng.cache.allocator.num_pages * eng.cache.page_size, eng.runner.cfg.vocab_size)
    assert inputs.kv_tokens == 32 and inputs.token_budget == 32  # the KV cache, not the model length, binds
    assert eng.encode("import os") == inputs.encode("import os") == eng.tokenizer.encode("import os").ids
    assert inputs.encode([]) == [eng.runner.cfg.bos_token_id]  # an empty prompt starts from BOS
    seq = eng.make_sequence("r", "import os", SamplingParams(max_tokens=4, seed=3))
    assert seq.prompt_ids == inputs.encode("import os") and seq.generator is not None


def test_a_processor_rebuilt_from_its_description_says_the_same(llm: LLM) -> None:
    mine = llm.engine.inputs
    d = json.loads(json.dumps(mine.describe()))  # what a replica sends the ingress
    theirs = InputProcessor.from_description(d)
    assert theirs is not mine and theirs.encode("def f(x):") == mine.encode("def f(x):")
    vocab = mine.vocab_size
    cases: list[tuple[Any, SamplingParams]] = [
        ([vocab + 5], SamplingParams()),  # a token id outside the vocabulary
        ([1] * 64, SamplingParams()),  # no room left for output
        ("x", SamplingParams(max_tokens=40)),  # fits the model length, not the KV cache even alone
        ("x", SamplingParams(logit_bias={vocab: 1.0})),
        ("x", SamplingParams(guided=GuidedSpec(kind="regex", value="("))),  # a grammar that does not compile
    ]
    for prompt, params in cases:
        a = _error(mine.make_sequence, "r", prompt, params)
        assert a == _error(theirs.make_sequence, "r", prompt, params)
    ok = theirs.make_sequence("r", "x", SamplingParams(max_tokens=4, guided=GuidedSpec(kind="choice",
                                                                                        value='["yes", "no"]')))
    assert ok.constraint is not None
    no_tok = InputProcessor.from_description({**d, "tokenizer": None})
    assert "no tokenizer.json" in _error(no_tok.encode, "text") and no_tok.encode([3, 4]) == [3, 4]
