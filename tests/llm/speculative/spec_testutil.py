"""What the speculative decoding tests share: prompts (random ones, and repetitive ones that lookup
drafting can copy from) and greedy sampling parameters. The fixtures on the tiny target are in this
folder's conftest.py."""

from __future__ import annotations

from typing import Any

from llm_testutil import random_prompts

from dspark.llm import SamplingParams


def _prompts() -> list[list[int]]:
    """Random prompts, and repetitive ones on which lookup drafting has something to copy."""
    rep = [[7, 8, 9, 10, 11] * 5, [40, 41, 42] * 8 + [40], list(range(50, 62)) * 3]
    return random_prompts(5, seed=5, lo=4, hi=40) + rep


GREEDY_LENS = [12, 5, 17, 9, 24, 30, 7, 20]


def _greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)
