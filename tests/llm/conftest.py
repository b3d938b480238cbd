"""Fixtures for the LLM engine tests; checkpoints are built once per session."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_testutil import make_checkpoint
from logits_testutil import PROMPTS, ChoiceConstraint

from dspark.llm import LLM, GuidedSpec


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # On a shared 2-core box OpenMP spin barriers turn a 40 us matmul into 16 ms; one thread is faster.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``checkpoint(variant)`` -> path of a saved tiny model; each variant built once."""
    built: dict[str, Path] = {}

    def get(variant: str = "llama") -> Path:
        if variant not in built:
            built[variant] = make_checkpoint(tmp_path_factory.mktemp(variant), variant)
        return built[variant]

    return get


@pytest.fixture
def make_llm(checkpoint: Callable[[str], Path]) -> Iterator[Callable[..., Any]]:
    """Build ``dspark.LLM`` objects; on teardown assert every KV page came back."""
    from dspark.llm import LLM

    made: list[Any] = []

    def make(variant: str = "llama", **kw: Any) -> Any:
        kw.setdefault("dtype", "float32")
        llm = LLM(str(checkpoint(variant)), **kw)
        made.append(llm)
        return llm

    yield make
    leaked = [llm.engine.stats() for llm in made if not llm.engine.cache.all_free()]
    for llm in made:
        llm.engine.abort_all()
    assert not leaked, f"KV pages not returned at the end of the test: {leaked}"


# -- the logits processing tests (test_logits_processing.py, speculative/test_speculative_processing.py) --
# The embedded model, per module. Both modules use _pages_back on every test (pytestmark).


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def spec_self() -> LLM:
    return LLM(dtype="float32", speculative_decoding={"strategy": "fixed", "drafters": ["self"],
                                                      "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def spec_model() -> LLM:
    return LLM(dtype="float32", speculative_decoding={"strategy": "fixed", "drafters": ["model"],
                                                      "num_speculative_tokens": 4})


@pytest.fixture(scope="module")
def prompt_ids(plain: LLM) -> list[list[int]]:
    return [plain.engine.encode(p) for p in PROMPTS]


@pytest.fixture
def _pages_back(plain: LLM) -> Iterator[None]:
    yield
    assert plain.engine.cache.all_free()


@pytest.fixture
def grammar(monkeypatch: pytest.MonkeyPatch) -> list[ChoiceConstraint]:
    """Stands in for dspark.llm.structured: a ``grammar`` spec's value is a JSON list of token lists."""
    made: list[ChoiceConstraint] = []

    def build_constraint(inputs: Any, spec: GuidedSpec) -> ChoiceConstraint:
        c = ChoiceConstraint(json.loads(spec.value or "[]"), inputs.vocab_size)
        made.append(c)
        return c

    mod = types.ModuleType("dspark.llm.structured")
    mod.build_constraint = build_constraint  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dspark.llm.structured", mod)
    return made
