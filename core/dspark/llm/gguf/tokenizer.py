"""The tokenizer a GGUF file describes, as a ``tokenizers`` fast tokenizer.

A GGUF has no tokenizer.json: its vocabulary, merges, token types and special
ids are metadata under llama.cpp's keys. We build the same tokenizer
transformers builds from them (``integrations/gguf/gguf_tokenizer_mapping.py``):
byte-level BPE with the split regex the file's ``tokenizer.ggml.pre`` names,
control tokens as special tokens, user-defined ones kept whole, BOS/EOS as
``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` say. Other tokenizer
models (SentencePiece ``llama``, ``t5``) are not built here: the model still
loads and takes token-id prompts, with a warning saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dspark.host.log import get_logger

log = get_logger("dspark.llm.gguf")

SUPPORTED_TOKENIZERS = ("gpt2",)
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split its merges were learned with (transformers' GGUF_PRE_TOKENIZER_SPLITS);
# any other value splits as GPT-2 does (ByteLevel's own regex).
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35, "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies are spelled in it)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _special_id(md: dict[str, Any], key: str) -> int | None:
    v = md.get(f"tokenizer.ggml.{key}_token_id")
    return None if v is None else int(v)


def build_tokenizer(md: dict[str, Any], path: Path) -> Any:
    """The file's tokenizer, or None (with a warning) when it has none or one of another model."""
    kind = md.get("tokenizer.ggml.model")
    tokens = md.get("tokenizer.ggml.tokens")
    if kind not in SUPPORTED_TOKENIZERS or not tokens or "tokenizer.ggml.merges" not in md:
        log.warning("gguf.no_tokenizer", file=str(path), tokenizer_model=kind,
                    reason=f"tokenizer model {kind!r} (or no vocabulary/merges) is not built here; supported: "
                           f"{', '.join(SUPPORTED_TOKENIZERS)}; prompts must be token-id lists")
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(md.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = list(md.get("tokenizer.ggml.token_type") or [])
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel (transformers skips it too).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
                            if k == CONTROL and set(t) <= alphabet])
    known = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                    if k == USER_DEFINED and t in known])
    bos, eos = _special_id(md, "bos"), _special_id(md, "eos")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join(([f"{tokens[bos]}:0"] if add_bos and bos is not None else []) + ["$A:0"]
                          + ([f"{tokens[eos]}:0"] if add_eos and eos is not None else []))
        special = [(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on and i is not None]
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    return tok


def tokenizer_config(md: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint's tokenizer_config.json would say: the chat template and the special tokens' text."""
    tokens = md.get("tokenizer.ggml.tokens") or []
    out: dict[str, Any] = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        i = _special_id(md, key)
        if i is not None and i < len(tokens):
            out[name] = tokens[i]
    template = md.get("tokenizer.chat_template")
    if isinstance(template, str):
        out["chat_template"] = template
    return out
