"""One step loop: with speculation on, the engine alone appends tokens, checks stops and emits outputs.

The speculative decoder only proposes drafts, judges them and learns; so every request-level
rule (stop strings, stop tokens, max_tokens, min_tokens, logprobs, penalties) must give under
greedy decoding exactly what plain decoding gives, wherever a stop lands inside a draft.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import dspark.llm.speculative as speculative_pkg
import pytest
from dspark.llm import LLM, SamplingParams
from llm_testutil import make_checkpoint, make_draft_checkpoint, random_prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loop")
    t = make_checkpoint(root / "tiny4", "llama", seed=3, num_hidden_layers=4)
    make_draft_checkpoint(t, root / "tiny4-draft", noise=0.35)  # found by draft_model="auto"
    make_draft_checkpoint(t, root / "exact", noise=0.0)
    return t


def _prompts() -> list[list[int]]:
    rep = [[7, 8, 9, 10, 11] * 5, [40, 41, 42] * 8 + [40], list(range(50, 62)) * 3]
    return random_prompts(5, seed=5, lo=4, hi=40) + rep


def _params(base: list[Any]) -> list[SamplingParams]:
    """Per request one rule that ends or shapes its output, taken from its plain output."""
    out = []
    for i, o in enumerate(base):
        kw: dict[str, Any] = {"max_tokens": 12 + i, "temperature": 0, "ignore_eos": True}
        rule = i % 4
        if rule == 0:
            kw["stop"] = [o.text[4:7]]  # a stop string a few tokens in
        elif rule == 1:
            kw.update(stop_token_ids=[o.token_ids[1], o.token_ids[6]], min_tokens=3)  # the first hit is too early
        elif rule == 2:
            kw["logprobs"] = 2
        else:
            kw.update(repetition_penalty=1.3, min_tokens=5, stop_token_ids=[o.token_ids[2]])
        out.append(SamplingParams(**kw))
    return out


def _view(o: Any) -> tuple[Any, ...]:
    lps = None if o.logprobs is None else [(lp.token_id, round(lp.logprob, 4), [t for t, _ in lp.top])
                                            for lp in o.logprobs]
    return o.token_ids, o.text, o.finish_reason, o.usage.completion_tokens, lps


@pytest.mark.parametrize("spec", ["exact", "noisy", "ngram"])
def test_speculative_outputs_and_finish_reasons_equal_plain_decoding(target: Path, spec: str) -> None:
    prompts = _prompts()
    plain = LLM(str(target), dtype="float32")
    base = plain.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    params = _params(base)
    ref = plain.generate(prompts, params)
    cfg = {
        # Every drafted token accepted: each stop lands inside a long accepted run.
        "exact": {"draft_model": str(target.parent / "exact"), "drafters": ["model"], "num_speculative_tokens": 8},
        "noisy": {"drafters": ["model"], "num_speculative_tokens": 5},  # accepts and rejects
        "ngram": {"drafters": ["prompt-lookup"], "num_speculative_tokens": 4},
    }[spec]
    llm = LLM(str(target), dtype="float32", max_batch_size=3, speculative_decoding={"strategy": "fixed", **cfg})
    streamed: dict[str, str] = {}
    outs = llm.generate(prompts, params)
    assert [_view(o) for o in outs] == [_view(r) for r in ref]
    reasons = {r.finish_reason for r in ref}
    assert reasons == {"stop", "length"}  # both kinds of ending are exercised
    s = llm.stats()
    assert s.spec_drafts > 0 and s.spec_accepted_tokens > 0
    # Streaming goes through the same outputs: the deltas add up to the final text.
    eng = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"s{i}", p, sp)
    while eng.has_unfinished():
        for o in eng.step():
            streamed[o.request_id] = streamed.get(o.request_id, "") + o.delta
    assert [streamed[f"s{i}"] for i in range(len(prompts))] == [r.text for r in ref]
    assert eng.cache.all_free()


def test_speculative_code_does_not_reach_into_the_engine() -> None:
    """The speculative package imports no engine module and touches no other object's private members."""
    offenders = []
    for f in sorted(Path(speculative_pkg.__file__).parent.glob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dspark.llm.engine"):
                offenders.append(f"{f.name}:{node.lineno} imports {node.module}")
            if isinstance(node, ast.Import) and any(a.name.startswith("dspark.llm.engine") for a in node.names):
                offenders.append(f"{f.name}:{node.lineno} imports the engine")
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                offenders.append(f"{f.name}:{node.lineno} uses .{node.attr}")
    assert not offenders, offenders
