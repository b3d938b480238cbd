"""Speculative decoding's verification (dspark.llm.speculative.verify): the rejection rule samples the
target's distribution, greedy acceptance takes the matching prefix, blockwise verification equals the
whole, and a tiny model's speculative samples follow its own distribution."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llm_testutil import make_draft_checkpoint, make_small_vocab_checkpoint
from scipy.stats import chisquare

from dspark.llm import LLM, SamplingParams
from dspark.llm.sampling import distribution
from dspark.llm.speculative.verify import accept_greedy, accept_greedy_blocks, accept_sampling, split


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    keep = probs * counts.sum() >= 5  # pool rare categories so the chi-square approximation holds
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()  # exact equality of totals, as scipy insists
    return float(chisquare(obs, exp).pvalue)


def _first_token_counts(p: torch.Tensor, q: torch.Tensor | None, draws: int, seed: int,
                        rule: Callable[..., tuple[list[int], int]] = accept_sampling) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    V = p.shape[-1]
    counts = np.zeros(V)
    for _ in range(draws):
        if q is None:
            draft = [2, 0]  # a deterministic drafter's fixed guess
        else:
            draft = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        toks, _ = rule(draft, q, p, gen)
        counts[toks[0]] += 1
    return counts


@pytest.mark.parametrize("deterministic", [False, True])
def test_rejection_rule_samples_the_target_distribution(deterministic: bool) -> None:
    g = torch.Generator().manual_seed(0)
    V = 6
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = None if deterministic else torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    counts = _first_token_counts(p, q, 6000, seed=1)
    assert _chi2(counts, p[0].numpy()) > 1e-3


def test_the_chi_square_check_catches_a_biased_rule() -> None:
    """The test above can fail: always accepting the draft follows q, not p, and is caught."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)

    def always_accept(draft: list[int], q: Any, p: Any, gen: Any) -> tuple[list[int], int]:
        return list(draft), len(draft)

    assert _chi2(_first_token_counts(p, q, 6000, 1, always_accept), p[0].numpy()) < 1e-6


def test_identical_draft_distribution_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, 10, generator=g), -1)
    draft = [int(torch.multinomial(p[j], 1, generator=g)) for j in range(3)]
    toks, n = accept_sampling(draft, p[:3].clone(), p, g)
    assert n == 3 and toks[:3] == draft and len(toks) == 4


def test_greedy_acceptance_is_the_matching_prefix_then_the_target_token() -> None:
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([3, 1, 4, 0]):
        logits[row, best] = 1.0
    assert accept_greedy([3, 1, 2], logits) == ([3, 1, 4], 2)
    assert accept_greedy([3, 1, 4], logits) == ([3, 1, 4, 0], 3)
    assert accept_greedy([0], logits[:2]) == ([3], 0)


def test_blockwise_greedy_verification_equals_whole_and_stops_at_the_first_mismatch() -> None:
    g = torch.Generator().manual_seed(5)
    W = torch.randn(16, 40, generator=g)  # a toy head: 16-wide hidden rows -> 40 logits
    calls: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ W

    hidden, drafts, whole = [], [], []
    for n_match, k in [(0, 20), (3, 20), (8, 20), (20, 20), (5, 5), (2, 9)]:
        h = torch.randn(k + 1, 16, generator=g)
        best = torch.argmax(h @ W, dim=-1).tolist()
        d = best[:n_match] + [(b + 1) % 40 for b in best[n_match:k]]  # matches the first n_match rows
        hidden.append(h)
        drafts.append(d)
        whole.append((best[:n_match + 1], n_match))  # the matched rows, then the target's own token
    got = accept_greedy_blocks(drafts, hidden, head, block=4)
    for (toks, n, rows), (w_toks, w_n), d in zip(got, whole, drafts):
        assert (toks, n) == (w_toks, w_n)
        # Long drafts (over two blocks): logits through the first block, the rest only if it held.
        assert rows == (4 if split(len(d), 4) and n < 4 else len(d) + 1)
    # ... in two head calls: every draft's first block (a short draft's every row), then the rest of
    # the long ones that held through their first block
    assert calls == [sum(4 if split(len(d), 4) else len(d) + 1 for d in drafts),
                     sum(len(d) + 1 - 4 for (_, n, _), d in zip(got, drafts) if n >= 4 and split(len(d), 4))]
    assert [split(len(d), 4) for d in drafts] == [True, True, True, True, False, True]


def test_distribution_matches_the_sampler() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, generator=g)
    for p in (SamplingParams(temperature=0.7, top_k=4), SamplingParams(top_p=0.7), SamplingParams(temperature=0)):
        dist = distribution(logits, p).numpy()
        assert abs(dist.sum() - 1) < 1e-5
        gen = torch.Generator().manual_seed(1)
        from dspark.llm.sampling import sample

        counts = np.bincount([sample(logits, p, gen) for _ in range(3000)], minlength=9)
        if p.greedy:
            assert counts.argmax() == dist.argmax() and counts.max() == 3000
        else:
            assert (counts[dist == 0] == 0).all() and _chi2(counts, dist) > 1e-3


def test_end_to_end_sampling_matches_the_target_model(tmp_path: Path) -> None:
    """Speculative sampling of a real (tiny) model: tokens 2 and 3 follow the model's own distribution.

    Token 1 comes from the prefill step; the next step drafts two tokens with
    a noisy draft model (sampling from its own softened distribution) and
    verifies them, so tokens 2 and 3 pass through acceptance, residual
    resampling and the bonus token. Expected frequencies are exact, from the
    model's conditional distributions.
    """
    from dspark.llm.runner.model import ModelRunner, SeqChunk

    tgt = make_small_vocab_checkpoint(tmp_path / "v8", vocab=8, seed=2)
    draft = make_draft_checkpoint(tgt, tmp_path / "v8-draft", noise=0.8)
    prompt = [0, 3, 5]
    params = SamplingParams(max_tokens=4, temperature=0.9, top_k=6, ignore_eos=True)
    n = 3000
    llm = LLM(str(tgt), dtype="float32", max_batch_size=256,
              speculative_decoding={"strategy": "fixed", "drafters": ["model"], "num_speculative_tokens": 2})
    outs = llm.generate([prompt] * n, [params.model_copy(update={"seed": i}) for i in range(n)])
    s = llm.stats()
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    assert llm.engine.cache.all_free() and llm.engine.spec.handles[0].obj.cache.all_free()

    runner = ModelRunner.from_pretrained(str(tgt), "float32")

    def dist(ctx: list[int]) -> np.ndarray:
        cache = runner.make_cache(8, 16)
        return distribution(runner.step(cache, [SeqChunk("s", ctx)])[0], params).double().numpy()

    p1 = dist(prompt)
    p12 = np.stack([p1[a] * dist(prompt + [a]) for a in range(8)])  # P(t1, t2)
    p2 = p12.sum(0)
    p3 = sum(p12[a, b] * dist(prompt + [a, b]) for a in range(8) for b in range(8))
    toks = np.array([o.token_ids for o in outs])
    assert _chi2(np.bincount(toks[:, 1], minlength=8).astype(float), p2) > 1e-3
    assert _chi2(np.bincount(toks[:, 2], minlength=8).astype(float), p3) > 1e-3
    assert _chi2(np.bincount(toks[:, 0] * 8 + toks[:, 1], minlength=64).astype(float), p12.reshape(-1)) > 1e-3
