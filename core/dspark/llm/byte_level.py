"""GPT-2's byte-level alphabet: how a byte-level BPE vocabulary (tokenizers' ``ByteLevel``) spells
bytes as printable characters, one character per byte."""

from __future__ import annotations


def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_TO_CHAR: dict[int, str] = _bytes_to_unicode()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}


def encode(text: str) -> str:
    """``text`` in the byte-level alphabet (how such a vocabulary spells it)."""
    return "".join(BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


def decode(piece: str) -> bytes | None:
    """The bytes a byte-level vocabulary entry stands for; None when ``piece`` is not in the alphabet."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in piece)
    except KeyError:
        return None
