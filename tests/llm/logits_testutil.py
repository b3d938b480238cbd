"""What the logits processing tests share (tests/llm/test_logits_processing.py and
tests/llm/speculative/test_speculative_processing.py): greedy parameters, transformers' logits on the
embedded model, a test grammar and the logprobs check. Their fixtures (the embedded model plain and
under speculative decoding, the grammar standing in for dspark.llm.structured) are in tests/llm/conftest.py.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch

from dspark.llm import GuidedSpec, SamplingParams, TokenLogprobs, default_model_path

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


def _guided(choices: list[list[int]]) -> GuidedSpec:
    return GuidedSpec(kind="grammar", value=json.dumps(choices))


def _check_logprobs(prompt: list[int], out: Any, n: int) -> None:
    ref = torch.log_softmax(_hf_logits(prompt + out.token_ids)[len(prompt) - 1 : -1], -1)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert isinstance(lp, TokenLogprobs) and lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[i, tok]), abs=1e-4)
        v, ix = torch.topk(ref[i], n)
        assert [t for t, _ in lp.top] == ix.tolist()
        np.testing.assert_allclose([x for _, x in lp.top], v.numpy(), atol=1e-4)
