"""A sequence's output text, kept up to date a few tokens at a time instead of decoded whole every step.

Decoding every output token again at each step costs a step O(output length) per sequence (vLLM
keeps prefix/read offsets for the same reason). ``tokenizers``' own ``DecodeStream`` does the
incremental part. Its text equals the whole decode less trailing U+FFFD (a character still missing
bytes) for byte-level decoders (GPT-2 style BPE: the embedded model's and every GGUF tokenizer
dspark builds); with byte fallback (SentencePiece style) it can differ, so those tokenizers decode
whole, as before. A finished sequence's text is always the whole decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark.llm.scheduler import Sequence


def streams_exactly(tokenizer: Any) -> bool:
    """True when ``DecodeStream`` gives ``tokenizer``'s whole decode (less trailing U+FFFD) at every step."""
    try:
        from tokenizers import Tokenizer, decoders
    except ImportError:
        return False
    return isinstance(tokenizer, Tokenizer) and isinstance(tokenizer.decoder, decoders.ByteLevel)


class Detokenizer:
    """Decodes sequences' output tokens: whole, or incrementally where :func:`streams_exactly`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.incremental = streams_exactly(tokenizer)

    def whole(self, seq: Sequence, drop_last: bool = False) -> str:
        ids = seq.output_ids[:-1] if drop_last else seq.output_ids
        text: str = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        return text

    def text(self, seq: Sequence) -> str:
        """``seq``'s text through its last output token, feeding the stream only the tokens it has not seen."""
        if not self.incremental:
            return self.whole(seq)
        if seq.detok is None:
            from tokenizers.decoders import DecodeStream

            seq.detok, seq.detok_n, seq.detok_text = DecodeStream(skip_special_tokens=seq.params.skip_special_tokens), 0, ""
        step, text = seq.detok.step, seq.detok_text
        for t in seq.output_ids[seq.detok_n :]:  # one at a time: given a list, step() can drop text
            chunk = step(self.tokenizer, t)
            if chunk:
                text += chunk
        seq.detok_n, seq.detok_text = len(seq.output_ids), text
        return text
