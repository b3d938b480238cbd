"""The embedded default model (issue 19): it is good enough to be the first thing a user sees.

Measured with the engine's own forward on held-out files the model never saw
in training (``heldout_files.txt``), and on the README's example prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from dspark.llm import LLM, SamplingParams
from dspark.llm.quantization.evaluate import heldout_windows, perplexity
from dspark.llm.api import default_model_path
from dspark.llm.runner.model import ModelRunner

README_PROMPT = "def quick_sort(arr):"


def _load_script_helper(name: str, script: str = "train_default_model") -> Any:
    """A function of scripts/train_default_model.py (or another module of scripts/): the card's figures and
    this test use the same one."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / f"{script}.py"
    spec = importlib.util.spec_from_file_location(script, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


_repeat_run = _load_script_helper("repeat_run")  # longest run of one identical non-blank line
_repeated_phrase = _load_script_helper("repeated_phrase")  # a run of words said three times back to back


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32")


def test_engine_reproduces_the_cards_heldout_figures() -> None:
    """The engine's own forward on the first held-out windows gives the figures the training script
    measured with transformers on the same windows (``dspark_heldout_slice`` in config.json)."""
    path = default_model_path()
    want = json.loads((path / "config.json").read_text())["dspark_heldout_slice"]
    runner = ModelRunner.from_pretrained(str(path), "float32")
    windows = heldout_windows(path, seq_len=want["seq_len"], max_windows=want["windows"])
    m = perplexity(runner, windows)
    assert m["tokens"] == want["tokens"]
    assert m["perplexity"] == pytest.approx(want["perplexity"], rel=2e-3), (m, want)
    assert abs(m["top1"] - want["top1"]) <= 2e-3, (m, want)
    card = (path / "README.md").read_text()
    assert f"perplexity {want['perplexity']:.3f}" in card


def test_readme_example_is_python_not_a_loop(llm: LLM) -> None:
    """The README's example, greedy: indented Python lines, no line repeated back to back."""
    out = llm.generate([README_PROMPT], SamplingParams(temperature=0, max_tokens=64))[0].text
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) >= 3, out
    assert _repeat_run(README_PROMPT + out) <= 2, out
    assert any(re.match(r"\s{4,}\S", ln) for ln in lines), out  # a body, not a flat stream of tokens
    assert len(set(lines)) >= 0.6 * len(lines), out
    assert _repeated_phrase(out) is None, out  # not "a list of a list of a list of"


@pytest.mark.parametrize("decoder", ["torch", "cpu", "llamacpp"])
def test_readme_example_in_the_engines_own_precision_is_not_a_loop(decoder: str) -> None:
    """As `dspark serve` runs it: in the dtype the engine picks on this machine (bfloat16 where the CPU computes
    it natively), on each decoder that may run it, whose rounding differs (a loop can start sooner on one)."""
    llm = LLM(decoder=decoder, max_batch_size=1)
    ran = llm.engine.stats().decoder
    if not ran.startswith(decoder):
        pytest.skip(f"decoder {decoder!r} does not run the model here (it ran on {ran})")
    out = llm.generate([README_PROMPT], SamplingParams(temperature=0, max_tokens=64))[0].text
    assert _repeat_run(README_PROMPT + out) <= 2, out
    assert _repeated_phrase(out) is None, out


def test_repeated_phrase_finds_a_loop_of_words() -> None:
    assert _repeated_phrase("Return a list of a list of a list of the list.") == "a list of"
    assert _repeated_phrase("x = 1\ny = 2\nz = 3") is None
    assert _repeated_phrase("return return return") == "return"


def test_unlikelihood_marks_every_token_of_an_ngram_seen_before() -> None:
    """The training script's sequence-level unlikelihood (scripts/unlikelihood.py) penalises the tokens of a
    greedy continuation that repeat an n-gram of the row, and nothing else."""
    import torch

    repeats = _load_script_helper("repeats", "unlikelihood")
    seq = torch.tensor([[1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 1, 2, 3],
                        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]])
    got = repeats(seq, 4, 3)  # a prefix of 4 tokens, trigrams
    assert got[0].tolist() == [False, False, True, True, True, False, True, True, True]
    assert not got[1].any()
    assert repeats(seq, 4, 2)[0].tolist() == [False, False, True, True, True, False, True, True, True]


def test_model_card_quotes_this_model() -> None:
    """The card's figures belong to the weights beside it: architecture, exits and parameter count."""
    from safetensors import safe_open

    path = default_model_path()
    card = (path / "README.md").read_text()
    cfg = json.loads((path / "config.json").read_text())
    assert f"hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers" in card
    for k in cfg["dspark_early_exit_layers"]:
        assert f"| exit{k} |" in card
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # a tied lm_head is stored once
        n = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    assert f"**Parameters: {n:,}**" in card


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
