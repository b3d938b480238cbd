"""Token ids as the text and bytes OpenAI's ``logprobs`` report for them.

A token may hold part of a UTF-8 character (byte-level BPE splits them), so
each token's own bytes are recovered from the vocabulary, not by decoding it
alone (which would drop a leading space or yield U+FFFD). As OpenAI does, a
token whose bytes are not valid UTF-8 by themselves is shown as
``bytes:\\xNN...``; its ``bytes`` field always has the exact bytes.
"""

from __future__ import annotations

import re
from typing import Any

from dspark.llm import byte_level

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class TokenText:
    """Per-tokenizer: ``token_bytes(id)`` and ``token_str(id)``, cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        decoder = _decoder_types(tokenizer)
        self.is_byte_level = "ByteLevel" in decoder
        self._cache: dict[int, bytes] = {}
        # Added tokens (<s>, </s> ...) are stored as their text, not byte-level encoded.
        self._special: set[int] = set(tokenizer.get_added_tokens_decoder()) if tokenizer is not None else set()

    def token_bytes(self, tid: int) -> bytes:
        got = self._cache.get(tid)
        if got is not None:
            return got
        piece = self.tok.id_to_token(tid) if self.tok is not None else None
        if piece is None:
            b = b""
        elif tid in self._special:
            b = piece.encode()
        elif self.is_byte_level:
            b = byte_level.decode(piece) or piece.encode()
        elif m := _BYTE_FALLBACK.match(piece):
            b = bytes([int(m.group(1), 16)])
        else:  # SentencePiece-style: the word-boundary marker is a space
            b = piece.replace("\u2581", " ").encode()
        self._cache[tid] = b
        return b

    def token_str(self, tid: int) -> str:
        b = self.token_bytes(tid)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def _decoder_types(tokenizer: Any) -> str:
    """The decoder's type names as text (a Sequence decoder lists its parts), '' when unknown."""
    if tokenizer is None:
        return ""
    try:
        import json

        spec = json.loads(tokenizer.to_str()).get("decoder") or {}
    except Exception:  # a tokenizer object without to_str: fall back to plain UTF-8 pieces
        return ""
    return json.dumps(spec)
