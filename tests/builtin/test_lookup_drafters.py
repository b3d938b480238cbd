"""The built-in lookup drafters (dspark.builtin.ngram, dspark.builtin.suffix): where a prompt-lookup draft
was copied from, what a suffix lookup drafts from earlier requests, and its bounded store."""

from __future__ import annotations

import pytest

from dspark.builtin.ngram import PromptLookupDrafter
from dspark.builtin.suffix import SuffixDrafter
from dspark.types import DraftRequest


def test_lookup_drafts_say_where_they_were_copied_from() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    d = PromptLookupDrafter()
    ctx = prompt + [6, 7]  # the output repeats the prompt: the copy comes from the prompt
    one = d.propose(ctx, 3)
    batch = d.propose_batch([DraftRequest("s", ctx, 3)])[0]
    assert one.tokens == batch.tokens == [8, 9, 10] and one.source == batch.source == 3
    ctx = prompt + [20, 21, 22, 23, 20, 21]  # the output loops on itself: copied from the output
    one = d.propose(ctx, 3)
    batch = d.propose_batch([DraftRequest("s", ctx, 3)])[0]
    assert one.tokens == batch.tokens == [22, 23, 20] and one.source == batch.source == 9 >= len(prompt)
    assert d.propose([1, 2, 3], 3).source is None and d.propose_batch([DraftRequest("t", [1, 2, 3], 3)])[0].source is None


def test_suffix_lookup_drafts_what_followed_in_earlier_requests() -> None:
    d = SuffixDrafter()
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert d.propose_batch([DraftRequest("a", first, 4)])[0].tokens == []  # nothing stored yet
    assert d.stored_tokens == 0
    d.release("a")  # finished: its text is stored
    assert d.stored_tokens == len(first)
    # Another request whose last 4 tokens occurred in the first: what followed them there.
    ctx = [50, 51, 3, 4, 5, 6]
    got = d.propose_batch([DraftRequest("b", ctx, 3)])[0]
    assert got.tokens == [7, 8, 9] and got.source is None  # not a copy of its own context
    assert got.confidence == [4 / 6] * 3  # the true match is 4 tokens: 50, 51 differ from 1, 2
    longer = d.propose([0, 1, 2, 3, 4, 5, 6], 3)
    assert longer.tokens == [7, 8, 9] and longer.confidence == [6 / 8] * 3
    assert d.propose(ctx, 20).tokens == [7, 8, 9, 10, 11, 12]  # a draft ends where the stored text does
    assert d.propose([3, 4, 5], 3).tokens == []  # shorter than the shortest n-gram matched
    assert d.propose([9, 9, 9, 9], 3).tokens == [] and d.propose(ctx, 0).tokens == []
    d.release("b")  # the latest occurrence wins: b's continuation of 3, 4, 5, 6 was nothing (end of text)
    d.add([3, 4, 5, 6, 99, 98])
    assert d.propose(ctx, 2).tokens == [99, 98]
    d.release("never-seen")  # a release for a sequence it never drafted for changes nothing
    assert d.stored_tokens == len(first) + len(ctx) + 6


def test_suffix_lookup_store_is_bounded_and_drops_the_oldest_text() -> None:
    d = SuffixDrafter(max_tokens=100)
    texts = [[1000 + 40 * i + j for j in range(40)] for i in range(5)]  # 40 distinct tokens each
    for t in texts:
        d.add(t)
        assert d.stored_tokens <= 100
    assert d.propose(texts[0][:8], 2).tokens == []  # the oldest went
    assert d.propose(texts[-1][:8], 2).tokens == texts[-1][8:10]  # the newest is there
    kept = [i for i, t in enumerate(texts) if d.propose(t[:8], 1).tokens]
    assert kept == list(range(5 - len(kept), 5)) and d.stored_tokens == 40 * len(kept)
    long = [2000 + j for j in range(90)]  # more than half the cap: it stays, the rest goes
    d.add(long)
    assert d.stored_tokens == 90 and d.propose(long[:8], 2).tokens == long[8:10]
    d.add(list(range(3000, 3300)))  # longer than the cap: its last 100 tokens are kept
    assert d.stored_tokens == 100 and d.propose(list(range(3200, 3208)), 1).tokens == [3208]
    assert d.propose(list(range(3100, 3108)), 1).tokens == []
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixDrafter(max_tokens=0)
