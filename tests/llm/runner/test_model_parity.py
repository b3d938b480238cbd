"""Our runner against transformers on the same checkpoint: logits and greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch
from llm_testutil import VARIANTS, random_prompts

from dspark.llm import ModelRunner, SamplingParams, SeqChunk

NEW_TOKENS = 8


@cache
def _hf(path: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # generate the full length, like ignore_eos
    return m


@cache
def _hf_greedy(path: Path, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    m = _hf(path)
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=NEW_TOKENS, pad_token_id=0)
        refs.append(out[0, len(p):].tolist())
    return refs


def _prompts(llm_tokenizer_path: Path, n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(llm_tokenizer_path / "tokenizer.json"))
    text = [tok.encode(s).ids for s in ("def hello(name):", "import os\nprint(", "the quick brown fox")]
    return text + random_prompts(n - len(text), seed=1)


@pytest.mark.parametrize(("variant", "page_size"), [("llama", 1), ("llama", 16), ("llama", 7)]
                         + [(v, 7) for v in VARIANTS if v != "llama"])
def test_greedy_matches_transformers(make_llm: Callable[..., object], checkpoint: Callable[[str], Path],
                                     variant: str, page_size: int) -> None:
    path = checkpoint(variant)
    prompts = _prompts(path, 20)
    refs = _hf_greedy(path, tuple(tuple(p) for p in prompts))
    # A small step budget forces chunked prefill and mixes prefill with decodes in one step.
    llm = make_llm(variant, page_size=page_size, max_num_batched_tokens=40)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))  # type: ignore[attr-defined]
    mismatched = [i for i, (o, r) in enumerate(zip(outs, refs)) if o.token_ids != r]
    assert not mismatched, f"prompts {mismatched} differ from transformers"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_logits_close_prefill_and_decode(checkpoint: Callable[[str], Path], variant: str, page_size: int) -> None:
    path = checkpoint(variant)
    runner = ModelRunner.from_pretrained(str(path), "float32")
    ids = random_prompts(1, seed=7, lo=23, hi=24)[0]
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([ids])).logits[0]
    cache_ = runner.make_cache(64, page_size)
    # Prefill in two chunks, then decode two tokens alongside another sequence's prefill.
    a = runner.step(cache_, [SeqChunk("a", ids[:10], all_logits=True)])[0]
    b = runner.step(cache_, [SeqChunk("a", ids[10:21], all_logits=True), SeqChunk("b", ids[:4])])[0]
    c = runner.step(cache_, [SeqChunk("a", ids[21:22]), SeqChunk("b", ids[4:5])])
    d = runner.step(cache_, [SeqChunk("a", ids[22:23])])[0]
    got = torch.cat([a, b, c[0][None], d[None]])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(c[1], ref[4], atol=1e-4, rtol=1e-4)
    cache_.free("a"), cache_.free("b")
    assert cache_.all_free()


def test_rollback_then_recompute_matches(checkpoint: Callable[[str], Path]) -> None:
    runner = ModelRunner.from_pretrained(str(checkpoint("llama")), "float32")
    cache_ = runner.make_cache(32, 4)
    ids = random_prompts(1, seed=3, lo=12, hi=13)[0]
    full = runner.step(cache_, [SeqChunk("a", ids, all_logits=True)])[0]
    cache_.truncate("a", 5)  # speculative rollback: 7 tokens kept, pages of the rest freed
    assert cache_.seq_lens["a"] == 7 and len(cache_.block_tables["a"]) == 2
    again = runner.step(cache_, [SeqChunk("a", ids[7:], all_logits=True)])[0]
    torch.testing.assert_close(again, full[7:], atol=1e-5, rtol=1e-5)
    cache_.free("a")
    assert cache_.all_free()
