"""Per-token cost of grammar-constrained decoding: xgrammar vs llguidance.

Usage: .venv/bin/python benchmarks/grammar_mask.py [--reps 30] [--compile-reps 5]

Both libraries are driven on the embedded model's tokenizer
(core/dspark/assets/models/stdlib-llama/tokenizer.json: byte-level BPE, vocab 8192,
EOS 1) with the same settings dspark's structured output uses (no free
whitespace; separators ", " and ": "). For each case the realistic document
below is BPE-tokenized once, then replayed ``--reps`` times through a fresh
matcher: per token, compute the next-token bitmask into a reusable int32
buffer, then accept the token; the last step checks EOS is allowed. Printed:

- once per process/engine: importing the library and building its
  tokenizer info (xgrammar's import pulls in transformers);
- per case: compile time (median of ``--compile-reps`` fresh compiles, no
  cache; xgrammar precomputes its token masks here, llguidance builds its
  lexer and parser and computes masks lazily, the first time each lexer
  state is met), and the mean us/token of the first document after a
  compile ("cold", where llguidance's lazy masks are paid);
- median, p90 and mean us/token (mask + accept) over warm replays: new
  matchers from the compiled grammar (for llguidance a ``deep_copy`` of the
  compiled template, which shares its caches, as a server would reuse it);
- xgrammar / llguidance ratios, and their geometric mean over the cases;
- the chosen library inside dspark's ``Constraint``: ``allowed()`` (mask into
  the reused buffer, unpacked to the bool tensor the sampler takes) +
  ``accept()``, median us/token.

dspark depends on xgrammar (see pyproject.toml); llguidance is needed only
by this benchmark: ``.venv/bin/pip install llguidance`` (a self-contained
wheel, no dependencies). Without it the xgrammar rows alone are printed.
Run on an otherwise quiet machine; figures are in docs/structured-output.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

TOKENIZER = Path(__file__).resolve().parent.parent / "core" / "dspark" / "assets" / "models" / "stdlib-llama" / "tokenizer.json"
VOCAB = 8192  # the model's config.json vocab_size
EOS = 1
SEPARATORS = (", ", ": ")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "score", "active", "role", "tags"],
    "additionalProperties": False,
}
LOG_LINE = "2024-05-17 WARN dspark.server: request queue is 87% full, shedding load from the lowest priority tenants"
REGEX = r"\d{4}-\d{2}-\d{2} (INFO|WARN|ERROR) [a-z_.]+: [A-Za-z0-9 ,.'%-]{1,120}"

CASES: dict[str, tuple[str, Any, str]] = {
    # kind, grammar source, a document as a model would write it
    "json_object": ("json_object", None, json.dumps({
        "id": 4172, "user": {"name": "Grace Hopper", "email": "grace@navy.mil", "langs": ["COBOL", "FLOW-MATIC"]},
        "active": True, "ratio": 0.875, "note": None,
        "items": [{"sku": "A-113", "qty": 2, "price": 19.99}, {"sku": "B-7", "qty": 1, "price": 250.0}],
        "comment": "shipped on time, \"signed\" by the customer",
    })),
    "json_schema": ("json_schema", SCHEMA, json.dumps({
        "name": "Ada Lovelace", "age": 36, "score": 97.5, "active": True, "role": "admin",
        "tags": ["mathematics", "poetry", "analytical engine", "notes"],
    })),
    "regex": ("regex", REGEX, LOG_LINE),
    # The same without the counted repetition: llguidance's cost there is a fresh lexer state per character.
    "regex_plus": ("regex", REGEX.replace("{1,120}", "+"), LOG_LINE),
}


def _vocab_and_special() -> tuple[list[str], set[int]]:
    import json as _json

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    enc = [""] * VOCAB
    for s, i in tok.get_vocab(with_added_tokens=True).items():
        enc[i] = s
    special = {a["id"] for a in _json.loads(TOKENIZER.read_text())["added_tokens"] if a["special"]}
    return enc, special


class XGrammar:
    name = "xgrammar"

    def __init__(self) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        enc, special = _vocab_and_special()
        # Special tokens (<s>, <unk>, <pad>) as "" so that xgrammar never allows them as text;
        # from_huggingface would treat "<s>" as the three characters.
        enc = ["" if i in special else s for i, s in enumerate(enc)]
        self.info = xgr.TokenizerInfo(enc, xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.version = _version("xgrammar")

    def compile(self, kind: str, src: Any) -> Any:
        # A fresh compiler, no cache: the cost a new schema pays. Its masks are precomputed here.
        c = self.xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        if kind == "json_object":
            return c.compile_json_schema({"type": "object"}, any_whitespace=False, separators=SEPARATORS)
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(src), any_whitespace=False, separators=SEPARATORS)
        return c.compile_regex(src)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, buf: torch.Tensor) -> None:
        m.fill_next_token_bitmask(buf)

    def accept(self, m: Any, tok: int) -> bool:
        return bool(m.accept_token(tok))


class LLGuidance:
    name = "llguidance"

    def __init__(self) -> None:
        import llguidance

        self.ll = llguidance
        self.tok = llguidance.LLTokenizer(TOKENIZER.read_text(), n_vocab=VOCAB, eos_token=[EOS])
        self.version = _version("llguidance")

    def compile(self, kind: str, src: Any) -> Any:
        M = self.ll.LLMatcher
        opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        if kind == "json_object":
            g = M.grammar_from_json_schema({"type": "object"}, overrides=opts)
        elif kind == "json_schema":
            g = M.grammar_from_json_schema(src, overrides=opts)
        else:
            g = M.grammar_from_regex(src)
        m = M(self.tok, g, log_level=0)  # builds the lexer and parser; masks are computed lazily
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled: Any) -> Any:
        # A copy of the compiled template shares its lexer's caches, so a later request
        # does not recompute the masks an earlier one did.
        return compiled.deep_copy()

    def fill(self, m: Any, buf: torch.Tensor) -> None:
        m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)

    def accept(self, m: Any, tok: int) -> bool:
        return bool(m.consume_token(tok))


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def _bit(buf: torch.Tensor, tok: int) -> bool:
    return bool((int(buf.view(-1)[tok // 32]) >> (tok % 32)) & 1)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _replay(lib: Any, m: Any, toks: list[int], buf: torch.Tensor, case: str) -> list[float]:
    """Mask + accept per token of a document (us), then check EOS may follow."""
    per_tok = []
    for tok in toks:
        t0 = time.perf_counter_ns()
        lib.fill(m, buf)
        ok = lib.accept(m, tok)
        per_tok.append((time.perf_counter_ns() - t0) / 1e3)
        assert ok and _bit(buf, tok), f"{lib.name} {case}: token {tok} refused"
    lib.fill(m, buf)
    assert _bit(buf, EOS), f"{lib.name} {case}: EOS not allowed at the end of the document"
    return per_tok


def compile_and_cold(lib: Any, tokens: dict[str, list[int]], compile_reps: int) -> dict[str, dict[str, Any]]:
    """Per case: median compile time, and the first document through a fresh compile (cold caches)."""
    buf = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    out: dict[str, dict[str, Any]] = {}
    for case, (kind, src, _doc) in CASES.items():
        times, colds = [], []
        for _ in range(compile_reps):
            t0 = time.perf_counter()
            compiled = lib.compile(kind, src)
            times.append(time.perf_counter() - t0)
            colds.append(statistics.fmean(_replay(lib, lib.matcher(compiled), tokens[case], buf, case)))
        out[case] = {"compiled": compiled, "compile_ms": statistics.median(times) * 1e3,
                     "cold": statistics.median(colds), "warm": []}
    return out


def warm(lib: Any, res: dict[str, dict[str, Any]], tokens: dict[str, list[int]], reps: int) -> None:
    """Replays of each document through new matchers from the compiled grammar (steady state)."""
    buf = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    for case in CASES:
        for _ in range(reps):
            res[case]["warm"] += _replay(lib, lib.matcher(res[case]["compiled"]), tokens[case], buf, case)


def run_constraint(tokens: dict[str, list[int]], reps: int) -> dict[str, float]:
    """The chosen library through dspark's Constraint: allowed() (bool tensor) + accept(), per token."""
    from dataclasses import dataclass

    from tokenizers import Tokenizer

    from dspark.llm.inputs import InputProcessor
    from dspark.llm.structured import build_constraint

    @dataclass(frozen=True)
    class Spec:
        kind: str
        value: str | None

    # An engine's own input processor for the tokenizer (what build_constraint keeps its tables for).
    inputs = InputProcessor(tokenizer=Tokenizer.from_file(str(TOKENIZER)), vocab_size=VOCAB, bos_token_id=None,
                            eos_ids=frozenset({EOS}), max_model_len=1024, kv_tokens=1024)
    res = {}
    for case, (kind, src, _doc) in CASES.items():
        value = None if src is None else (src if isinstance(src, str) else json.dumps(src))
        build_constraint(inputs, Spec(kind, value))  # compile once, as the LRU would
        per_tok: list[float] = []
        for _ in range(reps):
            c = build_constraint(inputs, Spec(kind, value))
            for tok in tokens[case]:
                t0 = time.perf_counter_ns()
                allowed = c.allowed()
                ok = c.accept(tok)
                per_tok.append((time.perf_counter_ns() - t0) / 1e3)
                assert ok and bool(allowed[tok])
        res[case] = statistics.median(per_tok)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--reps", type=int, default=30, help="warm replays of each document per library")
    ap.add_argument("--compile-reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from tokenizers import Tokenizer

    bpe = Tokenizer.from_file(str(TOKENIZER))
    tokens = {case: bpe.encode(doc, add_special_tokens=False).ids for case, (_k, _s, doc) in CASES.items()}

    libs: list[Any] = []
    setup: dict[str, float] = {}
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        try:
            lib = cls()
        except ImportError as e:
            print(f"{cls.name}: not installed ({e}); see this file's docstring")
            continue
        setup[lib.name] = (time.perf_counter() - t0) * 1e3
        libs.append(lib)
    results = {lib.name: compile_and_cold(lib, tokens, args.compile_reps) for lib in libs}
    rounds = 3  # interleave the libraries so that machine noise hits both alike
    for _ in range(rounds):
        for lib in libs:
            warm(lib, results[lib.name], tokens, max(1, args.reps // rounds))

    print(f"tokenizer {TOKENIZER.parent.name}/{TOKENIZER.name}: vocab {VOCAB}; tokens per document: "
          + ", ".join(f"{c} {len(t)}" for c, t in tokens.items()))
    for lib in libs:
        print(f"{lib.name} {lib.version}: import + tokenizer info {setup[lib.name]:.0f} ms (once per process/engine)")
    print()
    print("compile: median of fresh compiles; cold: mean us/token of the first document after a compile;")
    print("median/p90/mean: us/token (next-token bitmask + accept) over warm replays")
    head = f"{'library':<11} {'case':<13} {'compile ms':>10} {'cold us/tok':>11} {'median':>7} {'p90':>7} {'mean':>7}"
    print(head)
    print("-" * len(head))
    for name, res in results.items():
        for case, d in res.items():
            w = d["warm"]
            print(f"{name:<11} {case:<13} {d['compile_ms']:>10.2f} {d['cold']:>11.1f} {statistics.median(w):>7.1f} "
                  f"{_pct(w, 0.9):>7.1f} {statistics.fmean(w):>7.1f}")
    if len(results) == 2:
        print()
        print("xgrammar / llguidance: median us/token | cold us/token | compile ms")
        logs = []
        for case in CASES:
            x, l_ = results["xgrammar"][case], results["llguidance"][case]
            r = statistics.median(x["warm"]) / statistics.median(l_["warm"])
            logs.append(r)
            print(f"  {case:<13} {r:>5.2f}x | {x['cold'] / l_['cold']:>5.2f}x | {x['compile_ms'] / l_['compile_ms']:>6.1f}x")
        print(f"  geometric mean of the median ratios: {statistics.geometric_mean(logs):.2f}x")
    try:
        import dspark.llm.structured  # noqa: F401
    except ImportError:
        return
    print()
    print("dspark Constraint (allowed() as a bool tensor [vocab] + accept()), median us/token:")
    for case, v in run_constraint(tokens, max(1, args.reps // 3)).items():
        print(f"  {case:<13} {v:.1f}")


if __name__ == "__main__":
    main()
