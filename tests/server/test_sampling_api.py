"""logprobs, penalties, logit_bias, min_tokens and structured output through the real server and the
official client, checked against the engine in this process (itself checked against transformers in
tests/llm/test_logits_processing.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest

from dspark.llm import SamplingParams

PROMPT = "def quick_sort(arr):"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["list", "dict", "set"]}},
          "required": ["name", "size", "kind"], "additionalProperties": False}


def test_completion_logprobs_match_the_engine(server: Any, reference: Any) -> None:
    r = server.openai().completions.create(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                           logprobs=3)
    ref = reference.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, logprobs=3))[0]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.token_ids) == 12
    assert "".join(lp.tokens) == r.choices[0].text == ref.text
    for got, want, top in zip(lp.token_logprobs, ref.logprobs, lp.top_logprobs):
        assert got == pytest.approx(want.logprob, abs=1e-4)
        assert len(top) in (3, 4) and max(top.values()) == pytest.approx(want.top[0][1], abs=1e-4)
        assert got == pytest.approx(max(top.values()), abs=1e-6)  # greedy: the chosen token is the likeliest
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs_streamed_equal_unstreamed(server: Any, reference: Any) -> None:
    kw: dict[str, Any] = dict(model=server.model, messages=[{"role": "user", "content": "def add(a, b):"}],
                              max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    client = server.openai()
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               for c in content)
    assert b"".join(bytes(c.bytes) for c in content).decode() == full.choices[0].message.content
    streamed = [c for ch in client.chat.completions.create(**kw, stream=True) for choice in ch.choices
                if choice.logprobs is not None for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 5)) for c in streamed] == [(c.token, round(c.logprob, 5)) for c in content]


@pytest.mark.parametrize("extra", [
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 1.4},
    {"logit_bias": {"910": 100}},
    {"min_tokens": 20, "frequency_penalty": -1.0},
], ids=["presence-frequency", "repetition", "logit_bias", "min_tokens"])
def test_penalties_and_bias_match_the_engine(server: Any, reference: Any, extra: dict[str, Any]) -> None:
    r = server.openai().completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                           extra_body={k: v for k, v in extra.items()
                                                       if k in ("repetition_penalty", "min_tokens")},
                                           **{k: v for k, v in extra.items()
                                              if k not in ("repetition_penalty", "min_tokens")})
    params = {**extra}
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    ref = reference.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, **params))[0]
    plain = reference.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))[0]
    assert r.choices[0].text == ref.text
    assert ref.token_ids != plain.token_ids  # the parameter changed the output: the comparison means something


def test_json_schema_output_validates(server: Any) -> None:
    r = server.openai().chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Describe a container as JSON."}],
        max_tokens=60, temperature=0.7, seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "container", "schema": SCHEMA}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_and_regex_and_choice(server: Any) -> None:
    client = server.openai()
    obj = client.completions.create(model=server.model, prompt="config = ", max_tokens=48, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:  # cut by max_tokens: still a valid JSON prefix that opened an object
        assert obj.choices[0].text.lstrip().startswith("{")
    rx = client.completions.create(model=server.model, prompt="version = ", max_tokens=16, temperature=0,
                                   extra_body={"guided_regex": r"[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,2}"})
    assert rx.choices[0].finish_reason == "stop" and re.fullmatch(r"[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,2}", rx.choices[0].text)
    ch = client.completions.create(model=server.model, prompt="answer: ", max_tokens=8, temperature=0, n=3,
                                   extra_body={"guided_choice": ["True", "False", "None"], "temperature": 1.0,
                                               "seed": 1})
    assert all(c.text in ("True", "False", "None") for c in ch.choices)


def test_bad_schema_is_a_400_naming_the_field(server: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.openai().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e2:
        server.openai().completions.create(model=server.model, prompt="x", max_tokens=4,
                                           extra_body={"guided_regex": "(unclosed"})
    assert e2.value.body["param"] == "guided_regex" and "regular expression" in e2.value.body["message"]  # type: ignore[index]
