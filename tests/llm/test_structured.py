"""Structured output: constraints driven on the embedded model's real tokenizer, and one engine run."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dspark.llm import byte_level, structured
from dspark.llm.inputs import InputProcessor
from dspark.llm.structured import build_constraint

MODEL = Path(structured.__file__).resolve().parent.parent / "assets" / "models" / "stdlib-llama"
EOS = 1  # config.json eos_token_id
SPECIAL = (0, 2, 3)  # <s>, <unk>, <pad>: never allowed, even inside a JSON string

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]},
    },
    "required": ["name", "age", "score", "active", "role", "tags", "owner"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Spec:
    """Stands in for dspark.llm.sampling.GuidedSpec (duck-typed: kind and value)."""

    kind: str
    value: str | None = None


def _engine(vocab_size: int = 8192) -> InputProcessor:
    """An engine's input processor (what build_constraint reads), built from the real checkpoint files."""
    from tokenizers import Tokenizer

    cfg = json.loads((MODEL / "config.json").read_text())
    assert cfg["vocab_size"] == 8192 and cfg["eos_token_id"] == EOS
    return InputProcessor(tokenizer=Tokenizer.from_file(str(MODEL / "tokenizer.json")), vocab_size=vocab_size,
                          bos_token_id=cfg.get("bos_token_id"), eos_ids=frozenset({EOS}), max_model_len=2048,
                          kv_tokens=8192)


@pytest.fixture(scope="module")
def engine() -> InputProcessor:
    return _engine()


CLOSERS: list[int] = []


def _closers(tok: Any) -> list[int]:
    """Token ids that end a string, an array or an object, in the order the closing rule prefers them."""
    if not CLOSERS:
        for text in ('"}', '"]', '"', "}", "]", ")"):
            i = tok.token_to_id(byte_level.encode(text))
            if i is not None:
                CLOSERS.append(i)
    return CLOSERS


ONE_BYTE: set[int] = set()


def _one_byte(tok: Any) -> set[int]:
    if not ONE_BYTE:
        ONE_BYTE.update(i for s, i in tok.get_vocab(with_added_tokens=False).items() if len(s) == 1)
    return ONE_BYTE


def drive(c: Any, tok: Any, seed: int, wander: int = 30, limit: int = 600) -> tuple[list[int], list[torch.Tensor]]:
    """Generate with a deterministic rule until EOS: ``wander`` steps of a seeded random pick among the
    allowed tokens (EOS included), then head for the end: EOS if allowed, else a closing token
    (``"``, ``}``, ``]``...) if allowed, else a seeded random pick among the allowed one-byte tokens
    (so a run like ``[a-z]+`` meets its terminator soon), else among all allowed.

    Returns the tokens (EOS last) and the mask seen before each. Asserts every step's invariants.
    """
    rng = random.Random(seed)
    closers = _closers(tok)
    one_byte = _one_byte(tok)
    out: list[int] = []
    masks: list[torch.Tensor] = []
    for step in range(limit):
        a = c.allowed()
        assert a.dtype == torch.bool and a.shape == (8192,)
        assert not a[list(SPECIAL)].any(), "a special token was allowed"
        ids = a.nonzero().flatten().tolist()
        assert ids, f"dead end after {tok.decode(out)!r}"
        if step < wander:
            t = rng.choice(ids)
        elif a[EOS]:
            t = EOS
        else:
            short = [x for x in ids if x in one_byte]
            t = next((x for x in closers if a[x]), None) or rng.choice(short or ids)
        masks.append(a)
        assert c.accept(t), f"accept refused allowed token {t}"
        out.append(t)
        if t == EOS:
            assert c.is_terminated()
            return out, masks
        assert not c.is_terminated()
    raise AssertionError(f"no EOS within {limit} tokens: {tok.decode(out)!r}")


def text_of(tok: Any, ids: list[int]) -> str:
    assert ids[-1] == EOS and EOS not in ids[:-1]
    return str(tok.decode(ids[:-1], skip_special_tokens=False))


def check_schema(doc: Any) -> None:
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(doc, SCHEMA)
    # By hand as well (jsonschema is optional here).
    assert isinstance(doc, dict) and set(doc) == set(SCHEMA["required"])
    assert isinstance(doc["name"], str)
    assert isinstance(doc["age"], int) and not isinstance(doc["age"], bool) and 0 <= doc["age"] <= 150
    assert isinstance(doc["score"], (int, float)) and not isinstance(doc["score"], bool)
    assert isinstance(doc["active"], bool)
    assert doc["role"] in ("admin", "user", "guest")
    assert isinstance(doc["tags"], list) and all(isinstance(t, str) for t in doc["tags"])
    assert isinstance(doc["owner"], dict) and isinstance(doc["owner"]["id"], int)


@pytest.mark.parametrize("seed", range(4))
def test_json_object_output_parses_as_an_object(engine: Any, seed: int) -> None:
    c = build_constraint(engine, Spec("json_object"))
    ids, _ = drive(c, engine.tokenizer, seed)
    text = text_of(engine.tokenizer, ids)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(engine: Any, seed: int) -> None:
    c = build_constraint(engine, Spec("json_schema", json.dumps(SCHEMA)))
    ids, _ = drive(c, engine.tokenizer, seed, wander=60)
    text = text_of(engine.tokenizer, ids)
    check_schema(json.loads(text))


REGEXES = [
    r"\d{4}-\d{2}-\d{2} (INFO|WARN|ERROR) [a-z_.]+: [A-Za-z0-9 ,.'%-]{1,40}",
    r"[a-z]+@[a-z]+\.(com|org)",
    r"(yes|no|maybe)!?",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
]


@pytest.mark.parametrize("pattern", REGEXES)
@pytest.mark.parametrize("seed", range(3))
def test_regex_output_matches_in_full(engine: Any, pattern: str, seed: int) -> None:
    c = build_constraint(engine, Spec("regex", pattern))
    ids, _ = drive(c, engine.tokenizer, seed)
    text = text_of(engine.tokenizer, ids)
    assert re.fullmatch(pattern, text), (pattern, text)


ARITH = r"""
root ::= expr
expr ::= term ("+" term)*
term ::= factor ("*" factor)*
factor ::= [1-9] [0-9]* | "(" expr ")"
"""


def _parse_arith(s: str) -> bool:
    pos = 0

    def expr() -> None:
        term()
        while peek("+"):
            term()

    def term() -> None:
        factor()
        while peek("*"):
            factor()

    def factor() -> None:
        nonlocal pos
        if peek("("):
            expr()
            if not peek(")"):
                raise SyntaxError(s)
            return
        m = re.compile(r"[1-9][0-9]*").match(s, pos)
        if not m:
            raise SyntaxError(s)
        pos = m.end()

    def peek(ch: str) -> bool:
        nonlocal pos
        if s.startswith(ch, pos):
            pos += 1
            return True
        return False

    expr()
    return pos == len(s)


@pytest.mark.parametrize("seed", range(4))
def test_grammar_output_parses(engine: Any, seed: int) -> None:
    c = build_constraint(engine, Spec("grammar", ARITH))
    ids, _ = drive(c, engine.tokenizer, seed, wander=25)
    text = text_of(engine.tokenizer, ids)
    assert _parse_arith(text), text


CHOICES = ["yes", "no", "yes, but", 'he said "hi"\\', "naïve 😀", "a\nb"]


def test_choice_output_is_exactly_one_choice(engine: Any) -> None:
    seen = set()
    for seed in range(24):
        c = build_constraint(engine, Spec("choice", json.dumps(CHOICES)))
        ids, _ = drive(c, engine.tokenizer, seed, wander=3)
        text = text_of(engine.tokenizer, ids)
        assert text in CHOICES, text
        seen.add(text)
    assert len(seen) >= 3, seen  # the seeded walk reaches several of them, not one forced path


def test_accept_refuses_disallowed_tokens_and_keeps_the_state(engine: Any) -> None:
    tok = engine.tokenizer
    c = build_constraint(engine, Spec("json_schema", json.dumps(SCHEMA)))
    for t in tok.encode('{"name": "Ada", "age": 3', add_special_tokens=False).ids:
        assert c.accept(t)
    before = c.allowed().clone()
    assert not before[EOS], "EOS allowed in the middle of an object"
    refused = [int(before.logical_not().nonzero()[0]), EOS, *SPECIAL, tok.token_to_id('"'), 8192, -1, 10**9]
    for t in refused:
        assert not c.accept(t), t
        assert torch.equal(c.allowed(), before), f"state changed by refused token {t}"
        assert not c.is_terminated()
    assert c.num_accepted == len(tok.encode('{"name": "Ada", "age": 3', add_special_tokens=False).ids)
    # Still usable: the document can be finished from here.
    for t in tok.encode('7, "score": 1.5, "active": false, "role": "user", "tags": [], "owner": {"id": 1}}',
                        add_special_tokens=False).ids:
        assert c.accept(t), tok.id_to_token(t)
    assert c.allowed()[EOS] and c.accept(EOS) and c.is_terminated()


def test_eos_only_where_the_grammar_may_end(engine: Any) -> None:
    tok = engine.tokenizer
    c = build_constraint(engine, Spec("regex", r"ab(cd)?"))
    assert not c.allowed()[EOS]
    for t in tok.encode("ab", add_special_tokens=False).ids:
        assert c.accept(t)
    assert c.allowed()[EOS]  # "ab" may end here, or go on with "cd"
    assert c.allowed()[tok.token_to_id("c")]
    assert c.accept(tok.token_to_id("c"))
    assert not c.allowed()[EOS]
    assert c.accept(tok.token_to_id("d"))
    a = c.allowed()
    assert a.nonzero().flatten().tolist() == [EOS]  # nothing but the end is left
    assert c.accept(EOS) and c.is_terminated()
    assert not c.allowed().any()  # terminated: nothing more
    assert not c.accept(tok.token_to_id("a"))


def test_rollback_restores_allowed_exactly(engine: Any) -> None:
    c = build_constraint(engine, Spec("json_schema", json.dumps(SCHEMA)))
    ids, masks = drive(c, engine.tokenizer, seed=7, wander=40)
    assert c.is_terminated()
    n = len(ids)
    # Undo the EOS, then chunks of drafted-and-rejected tokens, checking each restored state.
    for k in (1, 3, 1, 5, 8):
        c.rollback(k)
        n -= k
        assert not c.is_terminated()
        assert c.num_accepted == n
        assert torch.equal(c.allowed(), masks[n]), f"mask after rolling back to {n} tokens differs"
    # Replaying the same tokens from there takes the same path to termination.
    for t, m in zip(ids[n:], masks[n:]):
        assert torch.equal(c.allowed(), m)
        assert c.accept(t)
    assert c.is_terminated()
    c.rollback(0)
    assert c.is_terminated()
    with pytest.raises(ValueError, match="only"):
        c.rollback(len(ids) + 1)
    c.rollback(len(ids))
    assert torch.equal(c.allowed(), masks[0])


def test_constraints_from_one_compiled_grammar_are_independent(engine: Any) -> None:
    tok = engine.tokenizer
    a = build_constraint(engine, Spec("json_object"))
    b = build_constraint(engine, Spec("json_object"))
    fresh = b.allowed().clone()
    for t in tok.encode('{"k": [1', add_special_tokens=False).ids:
        assert a.accept(t)
    assert torch.equal(b.allowed(), fresh) and not torch.equal(a.allowed(), fresh)


def test_mask_is_padded_to_the_model_vocab() -> None:
    eng = _engine(vocab_size=8200)  # a model whose embedding is larger than the tokenizer
    c = build_constraint(eng, Spec("json_object"))
    a = c.allowed()
    assert a.shape == (8200,) and a.dtype == torch.bool
    assert a[:8192].any() and not a[8192:].any()
    assert not c.accept(8195)


def test_tables_and_compiled_grammars_are_cached_per_engine(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    t = structured._tables(engine)
    assert structured._tables(engine) is t
    assert structured._tables(_engine()) is not t  # another engine, its own tables
    spec = Spec("regex", r"[0-9]{3}")
    build_constraint(engine, spec)
    g = t.lru[("regex", spec.value)]
    build_constraint(engine, spec)
    assert t.lru[("regex", spec.value)] is g  # not recompiled
    monkeypatch.setattr(structured, "LRU_SIZE", 2)
    for p in ("a", "b", "c"):
        build_constraint(engine, Spec("regex", p))
    assert list(t.lru) == [("regex", "b"), ("regex", "c")]


@pytest.mark.parametrize(("spec", "message"), [
    (Spec("json_schema", "{not json"), "response_format.json_schema: invalid JSON schema: not JSON"),
    (Spec("json_schema", "[1, 2]"), "response_format.json_schema: invalid JSON schema: must be an object"),
    (Spec("json_schema", '{"type": "foo"}'), 'response_format.json_schema: invalid JSON schema: Unsupported type "foo"'),
    (Spec("json_schema", '{"$ref": "#/$defs/missing"}'), "response_format.json_schema: invalid JSON schema"),
    (Spec("json_schema", None), "response_format.json_schema: a value is required"),
    (Spec("json_object", '{"type": "object"}'), "response_format.json_object: takes no value"),
    (Spec("regex", "[a-"), "guided_regex: invalid regular expression: .*Unclosed '\\['"),
    (Spec("regex", "(ab"), "guided_regex: invalid regular expression: .*parenthesis"),
    (Spec("grammar", "root ::= undefined_rule"), 'guided_grammar: invalid grammar .*Rule "undefined_rule" is not defined'),
    (Spec("grammar", 'start ::= "x"'), 'guided_grammar: invalid grammar .*root rule'),
    (Spec("grammar", "   "), "guided_grammar: invalid grammar: empty"),
    (Spec("choice", "[]"), "guided_choice: must be a non-empty list of strings"),
    (Spec("choice", '["a", 1]'), "guided_choice: must be a non-empty list of strings"),
    (Spec("choice", "yes"), "guided_choice: must be a JSON list of strings"),
    (Spec("xml", "<a/>"), "guided: unknown kind 'xml'"),
])
def test_bad_input_raises_a_clear_value_error(engine: Any, spec: Spec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_constraint(engine, spec)


def test_no_tokenizer_is_a_clear_error() -> None:
    eng = dataclasses.replace(_engine(), tokenizer=None)
    with pytest.raises(ValueError, match="structured output needs the checkpoint's tokenizer.json"):
        build_constraint(eng, Spec("json_object"))


def test_engine_generates_schema_valid_json() -> None:
    from dspark.llm import sampling

    if "guided" not in sampling.SamplingParams.model_fields:
        pytest.skip("the engine does not take SamplingParams.guided yet (engine integration not landed)")
    from dspark.llm import LLM

    schema = {"type": "object",
              "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "n"], "additionalProperties": False}
    spec = sampling.GuidedSpec(kind="json_schema", value=json.dumps(schema))  # type: ignore[attr-defined]
    llm = LLM(dtype="float32")
    (out,) = llm.generate(["def main():\n    return "],
                          sampling.SamplingParams(max_tokens=64, temperature=0, guided=spec))  # type: ignore[call-arg]
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    doc = json.loads(out.text)
    assert set(doc) == {"answer", "n"} and doc["answer"] in ("yes", "no") and doc["n"] in range(10), out.text
