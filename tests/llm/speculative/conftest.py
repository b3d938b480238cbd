"""Fixtures of the speculative decoding tests: a tiny 4-layer target with a noisy draft next to it, the
target itself as a draft, LLMs on it that must give back every KV page, and plain decoding's outputs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_testutil import make_checkpoint, make_draft_checkpoint
from spec_testutil import GREEDY_LENS, _greedy, _prompts

from dspark.llm import LLM


@pytest.fixture(scope="session")
def target4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-layer tiny target with a draft next to it (found by draft_model='auto')."""
    root = tmp_path_factory.mktemp("spec")
    t = make_checkpoint(root / "tiny4", "llama", seed=3, num_hidden_layers=4)
    make_draft_checkpoint(t, root / "tiny4-draft", noise=0.35)
    return t


@pytest.fixture(scope="session")
def exact_draft(target4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's own weights as a draft: every drafted token is accepted (the bonus-token path)."""
    return make_draft_checkpoint(target4, tmp_path_factory.mktemp("exact") / "exact", noise=0.0)


@pytest.fixture
def spec_llm(target4: Path) -> Iterator[Callable[..., LLM]]:
    """Build LLMs on the tiny target; afterwards every KV page, target's and draft model's, must be back."""
    made: list[LLM] = []

    def make(spec: Any = None, **kw: Any) -> LLM:
        kw.setdefault("dtype", "float32")
        if spec is not None:
            kw["speculative_decoding"] = spec
        llm = LLM(str(kw.pop("model", target4)), **kw)
        made.append(llm)
        return llm

    yield make
    problems = []
    for llm in made:
        if not llm.engine.cache.all_free():
            problems.append(("target", llm.engine.cache.stats()))
        for h in getattr(llm.engine.spec, "handles", []):
            cache = getattr(h.obj, "cache", None)
            if cache is not None and not cache.all_free():
                problems.append((h.name, cache.stats()))
        llm.engine.abort_all()
    assert not problems, f"KV pages not returned: {problems}"


@pytest.fixture(scope="module")
def plain_outputs(target4: Path) -> list[list[int]]:
    llm = LLM(str(target4), dtype="float32")
    return [o.token_ids for o in llm.generate(_prompts(), [_greedy(n) for n in GREEDY_LENS])]
