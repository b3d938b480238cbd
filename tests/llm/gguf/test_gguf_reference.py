"""A quantized GGUF file's float reference within a memory budget (dspark.llm.gguf.reference): the probe's
judge of decoders that run the file as stored, on a box whose memory cannot hold the file dequantized.

It must give the logits of the file loaded whole (``load_runner``), the same whatever it keeps, and keep no
more float weights than its budget allows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf_testutil import make_checkpoint, write_gguf

from dspark.llm.decoding.conformance import PROBE_SCENARIO, Transcript, probe_blocks, record
from dspark.llm.gguf import load_runner
from dspark.llm.gguf.reference import BUDGET_ENV, default_budget, reference_runner

# Float matrices beside quantized ones in one projection (k beside q and v, up beside gate), a float head.
MIXED = {"attn_q": "Q4_K", "attn_k": "F16", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q8_0",
         "ffn_up": "F16", "ffn_down": "Q6_K", "output": "F16", "token_embd": "Q6_K"}
CASES = {"llama-q4_k": ("llama", "Q4_K"), "tied-q8_0": ("llama_tied", "Q8_0"), "qwen2-mixed": ("qwen2", "MIXED")}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-reference")
    out = {}
    for name, (arch, kind) in CASES.items():
        types: str | Callable[[str], str] = (lambda n: MIXED[n.split(".")[-2]]) if kind == "MIXED" else kind
        out[name] = write_gguf(make_checkpoint(root / name, arch), root / f"{name}.gguf", types)
    return out


def _logits(t: Transcript) -> list[torch.Tensor]:
    return [x for e in t.events if e[0] == "step" for x in e[2]]


def _record(runner: object) -> list[torch.Tensor]:
    return _logits(record(runner, 16, num_blocks=probe_blocks(16), **PROBE_SCENARIO))  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(CASES))
def test_the_reference_gives_the_whole_files_logits_whatever_it_keeps(files: dict[str, Path], case: str) -> None:
    whole, _ = load_runner(files[case], "float32")
    want = _record(whole)
    none = reference_runner(files[case], "float32", budget=0)
    got_none = _record(none)
    every = reference_runner(files[case], "float32", budget=1 << 40)
    got_every = _record(every)
    assert none.kept_bytes == 0 < every.kept_bytes
    assert len(want) == len(got_none) == len(got_every) > 5
    for w, a, b in zip(want, got_none, got_every):
        assert torch.equal(a, b)  # one path for every projection: the budget changes no logit
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-4)  # the same weights, another matmul order
        assert int(a.argmax()) == int(w.argmax())


def test_the_reference_keeps_no_more_than_its_budget(files: dict[str, Path]) -> None:
    every = reference_runner(files["llama-q4_k"], "float32", budget=1 << 40)
    _record(every)
    total = every.kept_bytes
    none = reference_runner(files["llama-q4_k"], "float32", budget=0)
    _record(none)
    # Nothing quantized is held as float: each layer's matrices are empty, the projections read the file.
    assert none.kept_bytes == 0
    assert all(getattr(L, w).numel() == 0 for L in none.layers for w in ("w_qkv_t", "w_o", "w_gate_up_t", "w_down"))
    half = reference_runner(files["llama-q4_k"], "float32", budget=total // 2)
    _record(half)
    assert 0 < half.kept_bytes <= total // 2


def test_the_budget_comes_from_the_environment_or_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BUDGET_ENV, "12345")
    assert default_budget() == 12345
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match=BUDGET_ENV):
        default_budget()
    monkeypatch.delenv(BUDGET_ENV)
    assert default_budget() > 0
