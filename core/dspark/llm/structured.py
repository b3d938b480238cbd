"""Structured output: constrain generation to a JSON object, a JSON schema, a regex, a grammar or a choice.

The engine asks :func:`build_constraint` for one :class:`Constraint` per
constrained request, masks the logits with :meth:`Constraint.allowed` before
sampling and feeds every sampled (or verified speculative) token back through
:meth:`Constraint.accept` / :meth:`Constraint.rollback`.

The grammar engine is xgrammar, chosen by measurement against llguidance on
the embedded model's tokenizer (``benchmarks/grammar_mask.py``; figures and
the reasons in docs/structured-output.md). What each ``GuidedSpec.kind`` takes:

- ``json_object``: ``value`` None; any JSON object.
- ``json_schema``: ``value`` is the schema as JSON text. Properties the schema
  does not name are not generated (xgrammar's strict mode: the output is
  always valid, it just never uses an unnamed property).
- ``regex``: ``value`` is the pattern, matched in full (xgrammar's regex
  dialect: ECMAScript-like, no lookaround or backreferences).
- ``grammar``: ``value`` is an EBNF grammar in xgrammar's GBNF dialect (as
  llama.cpp's), with the start rule named ``root``, e.g.
  ``root ::= "yes" | "no" | [0-9]+``.
- ``choice``: ``value`` is a JSON list of strings; the output is exactly one.

JSON is generated compactly with ``", "`` and ``": "`` separators and no
other whitespace: a small model given free whitespace can spend its whole
budget on newlines. Special tokens (``<s>``, ``<pad>``...) are never allowed;
the EOS tokens (``engine.eos_ids``) are allowed exactly where the grammar may
end, and accepting one terminates the constraint.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from dspark.llm import byte_level

if TYPE_CHECKING:
    from dspark.llm.sampling import GuidedSpec

KINDS = ("json_object", "json_schema", "regex", "grammar", "choice")
# Where each kind comes from in an OpenAI-style request; errors name it.
FIELD = {
    "json_object": "response_format.json_object",
    "json_schema": "response_format.json_schema",
    "regex": "guided_regex",
    "grammar": "guided_grammar",
    "choice": "guided_choice",
}
SEPARATORS = (", ", ": ")
LRU_SIZE = 64  # compiled grammars kept per input processor


class Constraint(Protocol):
    def allowed(self) -> torch.Tensor: ...
    def accept(self, token: int) -> bool: ...
    def rollback(self, n: int) -> None: ...
    def is_terminated(self) -> bool: ...


class GrammarConstraint:
    """One request's grammar state (an xgrammar matcher) and its reusable bitmask buffer.

    ``allowed()`` costs one bitmask fill into the buffer (skipped if the state
    has not changed since the last call) plus an unpack of the 32-bit words
    into a new bool tensor of the model's vocabulary size.
    """

    def __init__(self, compiled: Any, tables: _Tables) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)
        self._vocab = tables.model_vocab
        self._bits = torch.zeros(tables.words, dtype=torch.int32)  # reused every step
        self._bytes = self._bits.numpy().view(np.uint8)  # little-endian: bit i of word w is token 32*w+i
        self._fresh = False  # whether _bits holds the current state's mask
        self._n = 0  # tokens accepted (and not rolled back)

    def allowed(self) -> torch.Tensor:
        """Bool tensor [model vocab_size]: the tokens allowed next (all False once terminated)."""
        if not self._fresh:
            if self._m.is_terminated():
                self._bits.zero_()
            else:
                self._m.fill_next_token_bitmask(self._bits)
            self._fresh = True
        bits = np.unpackbits(self._bytes, bitorder="little", count=self._vocab)
        return torch.from_numpy(bits).view(torch.bool)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) if the grammar does not allow it here."""
        if not 0 <= token < self._vocab or self._m.is_terminated():
            return False
        if not self._m.accept_token(int(token)):  # xgrammar leaves the state as it was on refusal
            return False
        self._n += 1
        self._fresh = False
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (an accepted EOS included)."""
        if n < 0 or n > self._n:
            raise ValueError(f"rollback({n}): only {self._n} tokens accepted")
        if n:
            self._m.rollback(n)
            self._n -= n
            self._fresh = False

    def is_terminated(self) -> bool:
        """The grammar has ended: an EOS token was accepted where the grammar may end."""
        return bool(self._m.is_terminated())

    @property
    def num_accepted(self) -> int:
        return self._n

    @staticmethod
    def batch_allowed(constraints: Seq[GrammarConstraint]) -> torch.Tensor:
        """``allowed()`` of many at once (the engine's batched processing calls this)."""
        return batch_allowed(constraints)


_BATCH: Any = None  # one xgrammar BatchGrammarMatcher per process (it holds a thread pool)
_BATCH_LOCK = threading.Lock()


def batch_allowed(constraints: Seq[GrammarConstraint]) -> torch.Tensor:
    """Bool [len(constraints), vocab]: ``allowed()`` of each, filled together by xgrammar's batch
    matcher (in parallel threads, without the GIL) rather than one by one."""
    global _BATCH
    vocab = constraints[0]._vocab
    out = torch.zeros(len(constraints), vocab, dtype=torch.bool)
    live = [i for i, c in enumerate(constraints)
            if isinstance(c, GrammarConstraint) and c._vocab == vocab and not c.is_terminated()]
    if len(live) > 1:
        import xgrammar as xgr

        with _BATCH_LOCK:
            if _BATCH is None:
                _BATCH = xgr.BatchGrammarMatcher(max(1, torch.get_num_threads()))
        words = constraints[live[0]]._bits.numel()
        bits = torch.zeros(len(live), words, dtype=torch.int32)
        _BATCH.batch_fill_next_token_bitmask([constraints[i]._m for i in live], bits)
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little", count=vocab)
        out[live] = torch.from_numpy(unpacked).view(torch.bool)
    done = set(live) if len(live) > 1 else set()
    for i, c in enumerate(constraints):
        if i not in done:
            out[i] = c.allowed()
    return out


class _Tables:
    """Per input processor: xgrammar's tokenizer info and compiler, and an LRU of compiled grammars."""

    def __init__(self, inputs: Any) -> None:
        tok = getattr(inputs, "tokenizer", None)
        if tok is None:
            raise ValueError("structured output needs the checkpoint's tokenizer.json")
        import xgrammar as xgr

        self.model_vocab = int(inputs.vocab_size)
        eos = sorted(int(t) for t in inputs.eos_ids)
        if not eos:
            raise ValueError("structured output needs an EOS token id (the model config has none)")
        self.info = _tokenizer_info(tok, self.model_vocab, eos)
        self.words = (self.info.vocab_size + 31) // 32
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=min(8, os.cpu_count() or 1),
                                            cache_enabled=False)  # our LRU bounds the memory instead
        self.lru: OrderedDict[tuple[str, str | None], Any] = OrderedDict()
        self.lock = threading.Lock()

    def compiled(self, kind: str, value: str | None) -> Any:
        key = (kind, value)
        with self.lock:
            hit = self.lru.get(key)
            if hit is not None:
                self.lru.move_to_end(key)
                return hit
        g = self._compile(kind, value)
        with self.lock:
            self.lru[key] = g
            while len(self.lru) > LRU_SIZE:
                self.lru.popitem(last=False)
        return g

    def _compile(self, kind: str, value: str | None) -> Any:
        field = FIELD[kind]
        c = self.compiler
        if kind == "json_object":
            if value not in (None, ""):
                raise ValueError(f"{field}: takes no value (any JSON object), got {value!r}")
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=SEPARATORS)
        if not isinstance(value, str):
            raise ValueError(f"{field}: a value is required (got {value!r})")
        if kind == "json_schema":
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{field}: invalid JSON schema: not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{field}: invalid JSON schema: must be an object or a boolean, "
                                 f"got {type(schema).__name__}")
            return _lib_call(lambda: c.compile_json_schema(value, any_whitespace=False, separators=SEPARATORS),
                             f"{field}: invalid JSON schema")
        if kind == "regex":
            return _lib_call(lambda: c.compile_regex(value), f"{field}: invalid regular expression")
        if kind == "grammar":
            if not value.strip():
                raise ValueError(f"{field}: invalid grammar: empty")
            return _lib_call(lambda: c.compile_grammar(value, root_rule_name="root"),
                             f"{field}: invalid grammar (EBNF, GBNF dialect, start rule 'root')")
        if kind == "choice":
            try:
                choices = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"{field}: must be a JSON list of strings: {e}") from None
            if not isinstance(choices, list) or not choices or not all(isinstance(s, str) for s in choices):
                raise ValueError(f"{field}: must be a non-empty list of strings, got {value!r}")
            rule = " | ".join(_ebnf_literal(s) if s else '""' for s in dict.fromkeys(choices))
            return _lib_call(lambda: c.compile_grammar(f"root ::= {rule}"), f"{field}: cannot build the choice")
        raise ValueError(f"guided: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")


_TABLES: weakref.WeakKeyDictionary[Any, _Tables] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _tables(inputs: Any) -> _Tables:
    """The tables of ``inputs`` (an :class:`~dspark.llm.inputs.InputProcessor`), built on first need."""
    with _TABLES_LOCK:
        t = _TABLES.get(inputs)
        if t is None:
            t = _TABLES[inputs] = _Tables(inputs)
        return t


def prepare(inputs: Any) -> None:
    """Import xgrammar and build ``inputs``'s tokenizer info now (~1.5-3 s here, mostly the import of
    transformers that xgrammar does), so that the first constrained request does not stall a step."""
    _tables(inputs)


def build_constraint(inputs: Any, spec: GuidedSpec | Any) -> GrammarConstraint:
    """A fresh constraint for one request.

    ``inputs``: an engine's :class:`~dspark.llm.inputs.InputProcessor` (its
    ``tokenizer``, ``vocab_size`` and ``eos_ids`` are used; the tokenizer info
    and the compiler are built once per processor, compiled grammars are kept
    in an LRU by ``(kind, value)``).
    ``spec``: anything with ``.kind`` and ``.value`` (a ``GuidedSpec``).
    Raises ``ValueError`` naming the request field for bad input.
    """
    kind, value = getattr(spec, "kind", None), getattr(spec, "value", None)
    if kind not in FIELD:
        raise ValueError(f"guided: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    t = _tables(inputs)
    return GrammarConstraint(t.compiled(kind, value), t)


def _lib_call(fn: Any, what: str) -> Any:
    try:
        return fn()
    except (RuntimeError, ValueError, TypeError) as e:
        # xgrammar prefixes its messages with "[time] /path/file.cc:line: "
        msg = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
        raise ValueError(f"{what}: {msg}") from None


def _ebnf_literal(s: str) -> str:
    """``s`` as a GBNF string literal."""
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            out.append(f"\\U{ord(ch):08x}" if ord(ch) > 0xFFFF else f"\\u{ord(ch):04x}")
    return '"' + "".join(out) + '"'


def _tokenizer_info(tok: Any, model_vocab: int, eos: list[int]) -> Any:
    """xgrammar's TokenizerInfo for a ``tokenizers.Tokenizer``, special tokens blanked.

    xgrammar reads the vocabulary as text, so it would allow ``<s>`` inside a
    JSON string as the three characters ``<s>``; the engine decodes with
    special tokens skipped, so that text would vanish. An empty entry is never
    allowed (except as a stop token). The vocabulary's type (byte-level,
    byte-fallback, raw) and prefix space are read by xgrammar from the
    tokenizer's own description.
    """
    import transformers
    import xgrammar as xgr

    vocab: dict[str, int] = tok.get_vocab(with_added_tokens=True)
    size = max(model_vocab, max(vocab.values()) + 1)
    meta = xgr.TokenizerInfo.from_huggingface(transformers.PreTrainedTokenizerFast(tokenizer_object=tok),
                                              vocab_size=size, stop_token_ids=eos)
    encoded = [""] * size
    for s, i in vocab.items():
        encoded[i] = s
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special:
            encoded[i] = ""
        elif meta.vocab_type == xgr.VocabType.BYTE_LEVEL:
            encoded[i] = byte_level.encode(added.content)  # added tokens are stored as plain text
    return xgr.TokenizerInfo(encoded, meta.vocab_type, vocab_size=size, stop_token_ids=eos,
                             add_prefix_space=meta.add_prefix_space)
