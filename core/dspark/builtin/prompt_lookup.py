"""The prompt-lookup drafter (``prompt-lookup``, offered by the built-in plugin ``ngram``).

Proposes the tokens that followed the most recent earlier occurrence of the
sequence's last n-gram (continuing the copy into itself when it reaches the
end of the context, so a repeating loop is drafted to any length): cheap,
model-free, and strong on copy-heavy text (edits, code that repeats its
context, a model stuck in a loop).

``propose`` scans the context; ``propose_batch`` (API 1.1) keeps, per
sequence, an index of every n-gram's last two starts, extended by the new
tokens each step, so a lookup costs the same at any context length.
"""

from __future__ import annotations

from dspark.types import Draft, DraftRequest


class NgramIndex:
    """n-gram -> (latest start, the start before it), for n in [lo, hi], over ``toks``: the drafter's lookup,
    extended token by token (also what DeepSpec replays a lone request's text with, dspark.llm.speculative.runs)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.toks: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}
        self.prev: dict[tuple[int, ...], int] = {}

    def extend(self, new: list[int]) -> None:
        toks, last, prev = self.toks, self.last, self.prev
        for t in new:
            toks.append(t)
            end = len(toks)
            for n in range(self.lo, min(self.hi, end) + 1):
                g = tuple(toks[end - n:end])
                old = last.get(g)
                if old is not None:
                    prev[g] = old
                last[g] = end - n

    def lookup(self, k: int) -> tuple[list[int], int, int]:
        """(draft, match length, where the draft was copied from)."""
        toks = self.toks
        L = len(toks)
        for n in range(min(self.hi, L - 1), self.lo - 1, -1):
            start = self.prev.get(tuple(toks[L - n:]))  # the latest occurrence is the suffix itself
            if start is not None:
                return _follow(toks, start + n, k), _match_len(toks, start + n, L), start + n
        return [], 0, 0


def _match_len(toks: list[int], a: int, b: int, most: int = 32) -> int:
    """How many tokens before position ``a`` equal those before ``b`` (a < b): the match's true length."""
    m = 0
    while m < most and a - m - 1 >= 0 and toks[a - m - 1] == toks[b - m - 1]:
        m += 1
    return m


def confidence(match_len: int) -> float:
    """A longer match (a loop, a copied passage) predicts the continuation better: m / (m + 2)."""
    return match_len / (match_len + 2.0)


def _follow(toks: list[int], pos: int, k: int) -> list[int]:
    """k tokens copied from ``pos`` on; past the end of the context the copy continues into
    itself, so a loop of period p (a match p tokens back) is drafted to any length."""
    out = toks[pos:pos + k]
    L = len(toks)
    while len(out) < k:
        out.append(out[pos + len(out) - L])
    return out


class PromptLookupDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._index: dict[str, NgramIndex] = {}

    def propose(self, tokens: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft(tokens=[])
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            # Latest earlier match first: recent context predicts best.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    follow = _follow(tokens, start + n, k)
                    c = confidence(_match_len(tokens, start + n, len(tokens)))
                    return Draft(tokens=follow, confidence=[c] * len(follow), source=start + n)
        return Draft(tokens=[])

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            idx = self._index.get(r.seq_id)
            have = 0 if idx is None else len(idx.toks)
            if idx is None or have > len(r.tokens) or r.tokens[:have] != idx.toks:
                idx = self._index[r.seq_id] = NgramIndex(self.min_ngram, self.max_ngram)
                have = 0
            idx.extend(r.tokens[have:])
            if r.k <= 0:
                out.append(Draft(tokens=[]))
                continue
            toks, m, src = idx.lookup(r.k)
            out.append(Draft(tokens=toks, confidence=[confidence(m)] * len(toks) if toks else None,
                             source=src if toks else None))
        return out

    def release(self, seq_id: str) -> None:
        self._index.pop(seq_id, None)
