"""The feature-level draft head (EAGLE-style): found next to its target, fed the target's own row
by the engine, lossless inside continuous batching, and real agreement on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from llm_testutil import make_checkpoint, random_prompts

from dspark.llm import LLM, SamplingParams
from dspark.llm.runner.model import ModelRunner, SeqChunk
from dspark.llm.speculative.head.model import FeatureHead, find_heads, load_head, save_head
from dspark.llm.speculative.head.drafter import FeatureHeadDrafter, target_matrices
from dspark.types import DraftRequest

EMBEDDED = Path(__file__).resolve().parents[4] / "core" / "dspark" / "assets" / "models"


@pytest.fixture(scope="module", params=[0, 4], ids=["mlp", "window4"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target with a (randomly initialised) head made for it next to it: without attention,
    and attending over a window of 4 rows."""
    root = tmp_path_factory.mktemp("head")
    t = make_checkpoint(root / "tinyh", "llama", seed=11, num_hidden_layers=2)
    hidden = json.loads((t / "config.json").read_text())["hidden_size"]
    torch.manual_seed(0)
    save_head(FeatureHead(hidden, 2 * hidden, window=request.param), root / "tinyh-head", t.name, {})
    return t


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_a_head_is_found_next_to_its_target_and_only_there(tiny: Path, tmp_path: Path) -> None:
    assert find_heads(tiny) == [tiny.parent / "tinyh-head"]
    assert find_heads(tmp_path) == []
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"dspark_role": "draft"}))
    with pytest.raises(ValueError, match="dspark_role is 'draft'"):
        load_head(tmp_path / "x")


def test_the_targets_hidden_state_is_recovered_from_its_logits(tiny: Path) -> None:
    runner = ModelRunner.from_pretrained(str(tiny), "float32")
    cache = runner.make_cache(8, 16)
    ids = random_prompts(1, seed=2, lo=12, hi=13)[0]
    hidden = runner.step(cache, [SeqChunk("s", ids, all_logits=True, hidden_only=True)])[0]
    logits = runner.head(hidden)
    d = FeatureHeadDrafter(tiny.parent / "tinyh-head", tiny)
    for j in (0, 5, len(ids) - 1):
        assert torch.allclose(d._feature(logits[j]), hidden[j].float(), atol=2e-4), j
        assert torch.equal(d._feature(hidden[j]), hidden[j].float())
    # the same draft from either row
    a = d.propose_batch([DraftRequest("a", ids, 4, target_rows=[hidden[-1]])])[0]
    b = d.propose_batch([DraftRequest("b", ids, 4, target_rows=[logits[-1]])])[0]
    assert a.tokens == b.tokens and len(a.tokens) == 4
    # no row, no draft (standalone propose has none)
    assert d.propose(ids, 4).tokens == []
    assert d.propose_batch([DraftRequest("c", ids, 4)])[0].tokens == []


@pytest.mark.parametrize("spec", [
    {"strategy": "fixed", "drafters": ["feature-head"], "num_speculative_tokens": 3, "draft_head": "auto"},
    {"strategy": "deepspec", "draft_head": "auto"},
])
def test_greedy_output_is_token_identical_with_the_head(tiny: Path, spec: dict) -> None:
    prompts = random_prompts(6, seed=4, lo=3, hi=30)
    lens = [9, 17, 4, 25, 12, 30]
    ref = LLM(str(tiny), dtype="float32").generate(prompts, [_greedy(n) for n in lens])
    llm = LLM(str(tiny), dtype="float32", speculative_decoding=spec, max_batch_size=3)
    out = llm.generate(prompts, [_greedy(n) for n in lens])
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    s = llm.stats()
    assert "feature-head:tinyh-head" in s.spec_drafters, s.spec_drafters
    assert s.spec_drafter_failures == 0
    if spec["strategy"] == "fixed":
        assert s.spec_drafters["feature-head:tinyh-head"]["drafts"] > 0, s.spec_drafters
    assert llm.engine.cache.all_free()


def test_seeded_sampling_with_the_head_is_reproducible(tiny: Path) -> None:
    spec = {"strategy": "fixed", "drafters": ["feature-head"], "num_speculative_tokens": 3, "draft_head": "auto"}
    p = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    prompts = random_prompts(2, seed=9, lo=5, hi=12)
    runs = [[o.token_ids for o in LLM(str(tiny), dtype="float32", speculative_decoding=spec).generate(prompts, p)]
            for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 20 for t in runs[0])


def test_a_head_is_offered_only_when_asked_for(tiny: Path) -> None:
    def heads(**spec: str) -> list[str]:
        llm = LLM(str(tiny), dtype="float32", speculative_decoding={"strategy": "deepspec", **spec})
        return [h.name for h in llm.engine.spec.handles if h.name.startswith("feature-head")]

    assert heads() == [] and heads(draft_head="none") == []
    assert heads(draft_head="auto") == heads(draft_head=str(tiny.parent / "tinyh-head")) == ["feature-head:tinyh-head"]


@pytest.mark.skipif(not (EMBEDDED / "stdlib-llama-head").exists(), reason="the embedded head is not built")
def test_the_embedded_head_agrees_with_its_model_and_drafts_are_accepted() -> None:
    import sysconfig

    src = (Path(sysconfig.get_paths()["stdlib"]) / "statistics.py").read_text()
    spec = {"strategy": "fixed", "drafters": ["feature-head"], "num_speculative_tokens": 1, "draft_head": "auto"}
    plain = LLM(dtype="float32")
    tok = plain.engine.tokenizer
    prompts = [tok.encode(src[i:i + 600]).ids for i in (0, 5000)]
    ref = plain.generate(prompts, _greedy(32))
    llm = LLM(dtype="float32", speculative_decoding=spec)
    assert [o.token_ids for o in llm.generate(prompts, _greedy(32))] == [o.token_ids for o in ref]
    st = llm.stats().spec_drafters["feature-head:stdlib-llama-head"]
    # an untrained head is right about 1 time in 2048 (its draft vocabulary); the trained one about half the time
    assert st["drafts"] >= 30 and st["acceptance_rate"] >= 0.3, st


def test_a_draft_vocabulary_limits_the_drafts_and_still_recovers_the_state(tiny: Path, tmp_path: Path) -> None:
    """A head saved with a frequency-ranked draft vocabulary drafts only among it, and the target's
    state is solved from those tokens' logits alone."""
    hidden = json.loads((tiny / "config.json").read_text())["hidden_size"]
    head, _ = load_head(tiny.parent / "tinyh-head")
    ids = torch.randperm(json.loads((tiny / "config.json").read_text())["vocab_size"],
                         generator=torch.Generator().manual_seed(1))[: 3 * hidden]
    save_head(head, tmp_path / "sub", tiny.name, {}, draft_vocab=ids)
    d = FeatureHeadDrafter(tmp_path / "sub", tiny)
    assert torch.equal(d.recover_rows, ids)
    runner = ModelRunner.from_pretrained(str(tiny), "float32")
    ctx = random_prompts(1, seed=3, lo=10, hi=11)[0]
    hid = runner.step(runner.make_cache(8, 16), [SeqChunk("s", ctx, all_logits=True, hidden_only=True)])[0][-1]
    assert torch.allclose(d._feature(runner.head(hid[None])[0]), hid.float(), atol=2e-4)
    allowed = set(ids.tolist())
    for t in (0.0, 0.9):
        dr = d.propose_batch([DraftRequest("a", ctx, 6, temperature=t, generator=torch.Generator().manual_seed(2),
                                           target_rows=[hid])])[0]
        assert len(dr.tokens) == 6 and set(dr.tokens) <= allowed, dr.tokens
        if t > 0:  # sampled: the full-vocabulary distributions it drew from, zero outside the subset
            q = torch.as_tensor(dr.probs)
            assert q.shape[0] == 6 and torch.allclose(q.sum(-1), torch.ones(6))
            assert float(q[:, [i for i in range(q.shape[1]) if i not in allowed]].sum()) == 0.0


def test_drafting_row_by_row_equals_the_head_over_the_whole_sequence(tiny: Path) -> None:
    """The drafter's incremental path (cached window rows across calls, drafted rows chained on its own
    predictions) computes what the head computes over the whole sequence at once, as in training."""
    runner = ModelRunner.from_pretrained(str(tiny), "float32")
    ctx = random_prompts(1, seed=6, lo=14, hi=15)[0]
    hidden = runner.step(runner.make_cache(8, 16), [SeqChunk("s", ctx, all_logits=True, hidden_only=True)])[0]
    d = FeatureHeadDrafter(tiny.parent / "tinyh-head", tiny)
    head, Wt = d.head, d.Wt
    emb, _ = target_matrices(tiny)

    def whole(n: int, k: int) -> list[int]:
        """Draft k tokens after ctx[:n] with the head over the whole sequence, window rows masked as in training."""
        us, toks, out = list(hidden[: n - 1]), list(ctx[1:n]), []
        for _ in range(k):
            with torch.no_grad():
                u = head(torch.stack(us)[None], emb[torch.tensor(toks)][None])[0, -1]
            t = int(d.ids[int((u @ Wt).argmax())])
            out.append(t)
            us.append(u)
            toks.append(t)
        return out

    n1, n2 = 8, 11

    def rows(n: int) -> list[torch.Tensor]:  # the target's logits rows before position n - 1, as the engine keeps them
        return list(runner.head(hidden[: n - 1]))[-d.target_rows:]

    first = d.propose_batch([DraftRequest("s", ctx[:n1], 3, target_rows=rows(n1))])[0].tokens
    assert first == whole(n1, 3)
    d.commit("s", n1 + 1)  # one drafted token kept
    # the next call gives only the rows since (3 new positions), the rest come from the window kept
    second = d.propose_batch([DraftRequest("s", ctx[:n2], 4, target_rows=rows(n2)[-3:])])[0].tokens
    assert second == whole(n2, 4)
    d.release("s")
    assert "s" not in d.state
