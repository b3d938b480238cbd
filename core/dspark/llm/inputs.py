"""Input processing: a request's prompt and parameters checked against the model and turned into a sequence.

vLLM's v1 engine keeps this apart from the core step loop (its ``Processor``),
and so does dspark: :class:`InputProcessor` holds only what the checks read
(the tokenizer, the vocabulary, BOS/EOS ids, the model length, the KV
capacity), so the server's routes, the engine and the cluster's ingress run
the same checks, the ingress without a model (:meth:`describe` /
:meth:`from_description` carry it from a replica).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dspark.llm.sampling import SamplingParams
from dspark.llm.scheduler import Sequence


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: grammar tables are kept per processor
class InputProcessor:
    """The checks between a request and the scheduler. ``tokenizer``: a ``tokenizers.Tokenizer`` or None
    (prompts must then be token ids); ``kv_tokens``: the most tokens the KV cache holds at once."""

    tokenizer: Any
    vocab_size: int
    bos_token_id: int | None
    eos_ids: frozenset[int]
    max_model_len: int
    kv_tokens: int

    @property
    def token_budget(self) -> int:
        """The most prompt + output tokens one sequence can get: model length and KV capacity."""
        return min(self.max_model_len, self.kv_tokens)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of ``prompt`` (text through the tokenizer), each checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json; pass prompts as token id lists")
            ids: list[int] = self.tokenizer.encode(prompt).ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            # Empty prompt: generate from BOS alone, as a Llama tokenizer would encode "".
            if self.bos_token_id is None:
                raise ValueError("empty prompt, and the model has no bos_token_id to start from")
            ids = [self.bos_token_id]
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def make_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                      priority: int = 0) -> Sequence:
        """Validate and tokenize; pure, so callers on other threads may use it."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit max_model_len={self.max_model_len} "
                             "(at least one token must be left for output)")
        worst = min(len(ids) + params.max_tokens, self.max_model_len)
        if worst > self.kv_tokens:
            # Refuse now: a request that cannot fit even alone would otherwise preempt forever.
            raise ValueError(f"request {request_id!r} may need {worst} KV tokens (prompt {len(ids)} + "
                             f"max_tokens {params.max_tokens}) but max_total_tokens allows {self.kv_tokens}")
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        constraint = None
        if params.guided is not None:
            from dspark.llm.structured import build_constraint

            constraint = build_constraint(self, params.guided)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        return Sequence(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                        prompt_ids=ids, params=params, priority=priority, arrival=0, generator=gen,
                        constraint=constraint)

    def describe(self) -> dict[str, Any]:
        """This processor as JSON-able data (the tokenizer as its JSON), for :meth:`from_description`."""
        tok = self.tokenizer
        return {"tokenizer": tok.to_str() if tok is not None else None, "vocab_size": self.vocab_size,
                "bos_token_id": self.bos_token_id, "eos_ids": sorted(self.eos_ids),
                "max_model_len": self.max_model_len, "kv_tokens": self.kv_tokens}

    @classmethod
    def from_description(cls, d: dict[str, Any]) -> InputProcessor:
        from tokenizers import Tokenizer

        return cls(tokenizer=Tokenizer.from_str(d["tokenizer"]) if d["tokenizer"] else None,
                   vocab_size=int(d["vocab_size"]), bos_token_id=d["bos_token_id"], eos_ids=frozenset(d["eos_ids"]),
                   max_model_len=int(d["max_model_len"]), kv_tokens=int(d["kv_tokens"]))
