"""The engine's batched logits processing: a row comes out the same whatever else is in the batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dspark.llm import default_model_path
from dspark.llm.inputs import InputProcessor
from dspark.llm.logits import process, process_batch
from dspark.llm.sampling import GuidedSpec, SamplingParams
from dspark.llm.scheduler import Sequence

V = 8192
EOS = {1}


@pytest.fixture(scope="module")
def engine_like() -> InputProcessor:
    """An engine's input processor (what build_constraint reads), from the embedded model's real tokenizer."""
    from tokenizers import Tokenizer

    root = Path(default_model_path())
    return InputProcessor(tokenizer=Tokenizer.from_file(str(root / "tokenizer.json")), vocab_size=V,
                          bos_token_id=None, eos_ids=frozenset(EOS), max_model_len=2048, kv_tokens=8192)


def _seq(i: int, params: SamplingParams, outputs: list[int], constraint: object = None) -> Sequence:
    s = Sequence(request_id=f"r{i}", prompt=None, prompt_ids=[0, 17 + i, 300, 17 + i], params=params, priority=0,
                 arrival=i)
    s.output_ids = list(outputs)
    s.constraint = constraint
    s.refresh()
    return s


def test_batch_equals_row_by_row(engine_like: InputProcessor) -> None:
    from dspark.llm.structured import build_constraint

    g = torch.Generator().manual_seed(0)
    cases = [
        SamplingParams(max_tokens=8, presence_penalty=0.7, frequency_penalty=-0.4),
        SamplingParams(max_tokens=8, repetition_penalty=1.3, logit_bias={5: 3.0, 300: -2.0}),
        SamplingParams(max_tokens=8, min_tokens=6, stop_token_ids=[7, 9]),
        SamplingParams(max_tokens=8, min_tokens=2, ignore_eos=True, repetition_penalty=0.8),
        SamplingParams(max_tokens=8, logprobs=3),  # nothing to process: the row passes through
        SamplingParams(max_tokens=8, guided=GuidedSpec(kind="json_object")),
        SamplingParams(max_tokens=8, guided=GuidedSpec(kind="regex", value="[a-c]{2,4}"), presence_penalty=1.0),
        SamplingParams(max_tokens=8, guided=GuidedSpec(kind="choice", value=json.dumps(["yes", "no"]))),
    ]
    seqs = []
    for i, p in enumerate(cases):
        c = build_constraint(engine_like, p.guided) if p.guided is not None else None
        outs = [int(t) for t in torch.randint(4, 600, (i % 4,), generator=g)] + [17 + i, 17 + i]
        if c is not None:
            outs = []
        seqs.append(_seq(i, p, outs, c))
    rows = torch.randn(len(cases), V, generator=g) * 4
    rows[:, 17:20] = torch.tensor([2.0, -3.0, 0.0])  # repeated tokens with positive, negative and zero logits
    batched = process_batch(rows, seqs, EOS)
    for r, s in enumerate(seqs):
        alone = process(rows[r], s.prompt_ids, s.output_ids, s.params, s.constraint, EOS)
        assert torch.equal(batched[r], alone), (r, s.params)
    assert torch.equal(rows, rows.clone())  # the input is left as it was
    # Every row the processing touched really changed, so the comparison above tests something.
    changed = [not torch.equal(batched[r], rows[r]) for r in range(len(cases))]
    assert changed == [True, True, True, True, False, True, True, True]


def test_penalty_counts_follow_the_outputs() -> None:
    s = _seq(0, SamplingParams(max_tokens=8, frequency_penalty=1.0), [5, 5])
    rows = torch.zeros(1, V)
    first = process_batch(rows, [s], EOS)
    assert first[0, 5] == -2.0
    s.output_ids += [5, 6]  # the engine appended two more
    second = process_batch(rows, [s], EOS)
    assert second[0, 5] == -3.0 and second[0, 6] == -1.0
    assert torch.equal(second[0], process(rows[0], s.prompt_ids, s.output_ids, s.params, None, EOS))
