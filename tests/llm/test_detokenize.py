"""Incremental detokenization: the same text as decoding every output token again, step after step."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from dspark.llm import SamplingParams
from dspark.llm.detokenize import Detokenizer, streams_exactly
from dspark.llm.scheduler import Sequence

EMBEDDED = Path(__file__).resolve().parents[2] / "core" / "dspark" / "assets" / "models" / "stdlib-llama" / "tokenizer.json"


def _seq(skip: bool = True) -> Sequence:
    return Sequence("r", None, [1], SamplingParams(skip_special_tokens=skip), 0, 0)


@pytest.mark.parametrize("skip", [True, False])
def test_the_incremental_text_is_the_whole_decode_at_every_step(skip: bool) -> None:
    tok = Tokenizer.from_file(str(EMBEDDED))
    d = Detokenizer(tok)
    assert d.incremental
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    partial = 0
    for _ in range(40):  # random ids: partial UTF-8 characters and invalid bytes come up often
        seq = _seq(skip)
        for _ in range(60):
            seq.output_ids.extend(rng.randrange(vocab) for _ in range(rng.choice((1, 1, 1, 3))))  # drafts add several
            whole = d.whole(seq)
            assert d.text(seq) == whole.rstrip("\ufffd")
            partial += whole != whole.rstrip("\ufffd")
    assert partial  # the case that matters was exercised


def test_a_byte_fallback_tokenizer_is_decoded_whole() -> None:
    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}, "\u2581a": 258}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    assert not streams_exactly(tok)
    d = Detokenizer(tok)
    seq = _seq()
    seq.output_ids += [0xC3 + 2, 258, 0xA9 + 2]  # a lone lead byte, a word, a lone continuation byte
    assert d.text(seq) == tok.decode(seq.output_ids, skip_special_tokens=True) and seq.detok is None


def test_a_finished_text_and_its_stream_are_the_whole_decode(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    assert llm.engine.detokenizer.incremental
    base = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = llm.generate("def hello", base)[0]
    assert ref.text == llm.engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    streamed = "".join(llm.generate_stream("def hello", base))
    assert streamed == ref.text
