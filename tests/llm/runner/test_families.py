"""Every supported checkpoint family against transformers: greedy tokens through the engine (continuous
batching, chunked prefill, prompts past the sliding window, speculative decoding) and logits of the runner.

Checkpoints are tiny random ones transformers writes here (family_testutil.py). Both attention paths
run: the paged C kernel ("auto" on a float32 CPU) and gather + SDPA / eager attention ("torch").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from dspark.llm import LLM, ModelRunner, SamplingParams, SeqChunk
from dspark.llm.runner.loader import load_config
from family_testutil import FAMILIES, WINDOW, make_family_checkpoint
from llm_testutil import make_draft_checkpoint, random_prompts

ENGINE_FAMILIES = [v for v in FAMILIES if v != "llama_dynamic"]  # dynamic NTK only acts past the engine's limit
NEW = 10


@pytest.fixture(scope="session")
def family(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in built:
            built[variant] = make_family_checkpoint(tmp_path_factory.mktemp(variant), variant)
        return built[variant]

    return get


@pytest.fixture
def llms() -> Iterator[Callable[..., LLM]]:
    """Build LLMs; afterwards every KV page, the target's and a draft model's, must be back."""
    made: list[LLM] = []

    def make(path: Path, attention: str = "auto", **kw: Any) -> LLM:
        llm = LLM(str(path), dtype="float32", **kw)
        llm.engine.runner.attention = attention
        made.append(llm)
        return llm

    yield make
    leaked = [llm.engine.stats() for llm in made if not llm.engine.cache.all_free()]
    for llm in made:
        for h in getattr(llm.engine.spec, "handles", []):
            c = getattr(h.obj, "cache", None)
            if c is not None and not c.all_free():
                leaked.append((h.name, c.stats()))
        llm.engine.abort_all()
    assert not leaked, f"KV pages not returned: {leaked}"


@cache
def _hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # the full length, like ignore_eos
    return m


@cache
def _hf_greedy(path: Path, prompts: tuple[tuple[int, ...], ...], n: int = NEW) -> list[list[int]]:
    m = _hf(path)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        g = m.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def _prompts(path: Path) -> list[list[int]]:
    """Text, random prompts of 1 to 60 tokens (most past the window of 8), and repetitive ones to copy."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = [tok.encode(s).ids for s in ("def hello(name):", "import os\nprint(")]
    return text + random_prompts(5, seed=1, lo=1, hi=60) + [[7, 8, 9, 10, 11] * 6, list(range(50, 62)) * 3]


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def _check_identical(path: Path, llm: LLM, prompts: list[list[int]]) -> None:
    refs = _hf_greedy(path, tuple(tuple(p) for p in prompts))
    outs = llm.generate(prompts, _greedy())
    bad = [(i, len(p)) for i, (p, o, r) in enumerate(zip(prompts, outs, refs)) if o.token_ids != r]
    assert not bad, f"(prompt, length) pairs that differ from transformers: {bad}"


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("variant", ENGINE_FAMILIES)
def test_greedy_matches_transformers_in_continuous_batching(family: Callable[[str], Path], llms: Callable[..., LLM],
                                                            variant: str, attention: str) -> None:
    path = family(variant)
    # Odd pages and a small step budget: chunked prefill, prefill mixed with decodes in one step.
    llm = llms(path, attention, page_size=7, max_num_batched_tokens=40)
    _check_identical(path, llm, _prompts(path))


@pytest.mark.parametrize("variant", ENGINE_FAMILIES)
def test_speculative_decoding_gives_the_same_tokens(family: Callable[[str], Path], llms: Callable[..., LLM],
                                                    variant: str) -> None:
    """Self-drafting (the first layer, exiting early) accepts some drafts and rejects others."""
    path = family(variant)
    spec = {"strategy": "fixed", "drafters": ["self"], "num_speculative_tokens": 4, "exit_layer": 1}
    llm = llms(path, speculative_decoding=spec, page_size=5, max_batch_size=4)
    _check_identical(path, llm, _prompts(path))
    s = llm.stats()
    assert s.spec_drafts > 0 and s.spec_draft_tokens > 0


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("variant", ["gemma2", "smollm3", "phi3_longrope"])
def test_verification_chunks_longer_than_the_window(family: Callable[[str], Path], llms: Callable[..., LLM],
                                                    tmp_path: Path, variant: str, attention: str) -> None:
    """A draft model with the target's own weights: every draft of 11 tokens holds, so each verification
    chunk (12 rows) is longer than the window of 8 and its rows see different windows."""
    path = family(variant)
    draft = make_draft_checkpoint(path, tmp_path / "draft", noise=0.0)
    spec = {"strategy": "fixed", "draft_model": str(draft), "drafters": ["model"], "num_speculative_tokens": 11}
    llm = llms(path, attention, speculative_decoding=spec)
    prompts = _prompts(path)[:5]
    _check_identical(path, llm, prompts)
    s = llm.stats()
    assert s.spec_accepted_tokens == s.spec_draft_tokens > 0


@pytest.mark.parametrize("attention", ["auto", "torch"])
@pytest.mark.parametrize("variant", list(FAMILIES))
def test_logits_close_over_chunks_past_the_window(family: Callable[[str], Path], variant: str,
                                                  attention: str) -> None:
    path = family(variant)
    runner = ModelRunner.from_pretrained(str(path), "float32")
    runner.attention = attention
    ids = random_prompts(1, seed=7, lo=40, hi=41)[0]
    n = len(ids)
    with torch.no_grad():
        ref = _hf(path)(torch.tensor([ids])).logits[0]
    c = runner.make_cache(64, 5)

    def chunk(seq: str, toks: list[int], all_logits: bool = True) -> SeqChunk:
        return SeqChunk(seq, toks, all_logits=all_logits, prompt_len=n)  # one prompt, as transformers' forward

    # Prefill in chunks (one past the window on its own), then decodes beside another sequence's prefill.
    a = runner.step(c, [chunk("a", ids[:13])])[0]
    b = runner.step(c, [chunk("a", ids[13:36]), chunk("b", ids[:30], False)])[0]
    d = runner.step(c, [chunk("a", ids[36:37], False), chunk("b", ids[30:31], False)])
    e = runner.step(c, [chunk("a", ids[37:])])[0]
    got = torch.cat([a, b, d[0][None], e])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(d[1], ref[30], atol=1e-4, rtol=1e-4)
    c.free("a"), c.free("b")
    assert c.all_free()


def test_dynamic_rope_decodes_past_max_position(family: Callable[[str], Path]) -> None:
    """Dynamic NTK re-derives its base at every decode step past max_position_embeddings (32)."""
    path = family("llama_dynamic")
    runner = ModelRunner.from_pretrained(str(path), "float32")
    prompt = random_prompts(1, seed=3, lo=20, hi=21)[0]
    (ref,) = _hf_greedy(path, (tuple(prompt),), 24)
    c = runner.make_cache(16, 8)
    logits = runner.step(c, [SeqChunk("a", prompt, prompt_len=len(prompt))])[0]
    got = []
    for _ in range(24):
        got.append(int(logits.argmax()))
        logits = runner.step(c, [SeqChunk("a", [got[-1]], prompt_len=len(prompt))])[0]
    assert got == ref
    c.free("a")


def test_config_maps_each_family(family: Callable[[str], Path]) -> None:
    q = load_config(family("qwen3_sliding_yarn"))
    assert q.head_dim == 32 and q.qk_norm and q.rope_type == "yarn"
    assert [q.window(i) for i in range(2)] == [None, WINDOW]
    s = load_config(family("smollm3"))
    assert s.rope_layers == (True, False, True, False) and [s.window(i) for i in range(4)] == [None, 8, None, 8]
    p = load_config(family("phi3_longrope"))
    assert p.fused_projections and p.partial_rotary_factor == 0.5 and p.window(0) == p.window(1) == 12
    assert p.rope_scaling and p.rope_scaling["original_max_position_embeddings"] == 32
    g2 = load_config(family("gemma2"))
    assert g2.gemma and g2.attn_logit_softcapping == 2.0 and g2.final_logit_softcapping == 3.0
    assert [g2.window(i) for i in range(3)] == [WINDOW, None, WINDOW] and g2.hidden_act == "gelu_pytorch_tanh"
    g3 = load_config(family("gemma3"))
    assert g3.qk_norm and g3.attn_logit_softcapping is None and g3.rope_type == "linear"
    assert g3.local_rope == {"rope_type": "default", "rope_theta": 10_000.0}
    assert load_config(family("phi4_mini")).tie_word_embeddings


@pytest.mark.parametrize("variant", ["qwen3", "gemma2", "phi3_longrope"])
def test_engine_quantizes_new_families(family: Callable[[str], Path], llms: Callable[..., LLM],
                                       variant: str) -> None:
    llm = llms(family(variant), quantization={"method": "int8_mixed", "calibration_samples": 2,
                                              "calibration_seq_len": 32})
    assert llm.plan is not None and {lp.name for lp in llm.plan.layers} >= set(llm.engine.runner.linear_names())
    out = llm.generate(["def f(x):", "import os"], _greedy(6))
    assert [len(o.token_ids) for o in out] == [6, 6]
