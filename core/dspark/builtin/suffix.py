"""Built-in lookup across requests (drafter ``suffix-lookup``, in plugin ``ngram``).

Proposes what followed the context's last n tokens in the text of earlier
requests (their prompts and outputs, kept when each finishes): the global
store of SuffixDecoding (arXiv 2411.04975, vLLM's ``suffix`` method), here
as n-gram lookups rather than a frequency-weighted suffix tree; the
request's own text is ``prompt-lookup``'s. Where
``prompt-lookup`` only copies from the request's own context, this one also
drafts at a request's start, and where a model says what it has said to
others (a small model's code idioms, a template, an agent's repeated tool
calls): where the store's match is much longer than the request's own, its
draft tends to hold longer, and the reverse (benchmarks/suffix_replay.py
measures both). DeepSpec learns which to take.

The n-grams matched are long (16, 8, 4 tokens), longest first, latest
occurrence first; a draft's confidence comes from the true length of the
match (up to 32 tokens), as for ``prompt-lookup``, so the controller learns
how far each holds. Memory is bounded: past ``max_tokens`` stored tokens the
oldest requests' text is dropped.

The store is shared by every request of one engine: one user's text can
shape what is drafted for another's. That changes speed only, never output
(verification keeps exactly the target's tokens); leave the drafter out
(``drafters``) where even the timing should not depend on other users.
"""

from __future__ import annotations

from typing import Any

from dspark.builtin.prompt_lookup import confidence
from dspark.types import Draft, DraftRequest

NGRAMS = (16, 8, 4)
MAX_TOKENS = 1 << 16


class SuffixDrafter:
    def __init__(self, ngrams: tuple[int, ...] = NGRAMS, max_tokens: int = MAX_TOKENS) -> None:
        if not ngrams or min(ngrams) < 1:
            raise ValueError(f"ngrams must be positive lengths, got {ngrams}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        self.ngrams = tuple(sorted(set(ngrams), reverse=True))
        self.max_tokens = max_tokens
        self._texts: dict[int, list[int]] = {}  # stored request number -> its tokens, oldest first
        self._next = 0
        self._stored = 0
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (request number, end)
        self._live: dict[str, list[int]] = {}  # a running request's latest context

    @property
    def stored_tokens(self) -> int:
        return self._stored

    def add(self, tokens: list[int]) -> None:
        """Store a finished request's text; past ``max_tokens`` the oldest texts go."""
        toks = list(tokens)
        if len(toks) <= min(self.ngrams):
            return
        if len(toks) > self.max_tokens:
            toks = toks[-self.max_tokens:]
        no = self._next
        self._next += 1
        self._texts[no] = toks
        self._stored += len(toks)
        if self._stored > self.max_tokens:
            # Drop to half, so rebuilding is amortised; the newest text stays whatever its length.
            while self._stored > self.max_tokens // 2 and len(self._texts) > 1:
                self._stored -= len(self._texts.pop(next(iter(self._texts))))
            self._index = {}
            for n_, t in self._texts.items():
                self._put(n_, t)
        else:
            self._put(no, toks)

    def _put(self, no: int, toks: list[int]) -> None:
        index = self._index
        for n in self.ngrams:
            # Only n-grams with something after them: a match at a text's very end drafts nothing.
            for i in range(len(toks) - n):
                index[tuple(toks[i:i + n])] = (no, i + n)

    def propose(self, tokens: list[int], k: int) -> Draft:
        L = len(tokens)
        if k <= 0:
            return Draft(tokens=[])
        for n in self.ngrams:
            if n > L:
                continue
            hit = self._index.get(tuple(tokens[L - n:]))
            if hit is None:
                continue
            text = self._texts[hit[0]]
            end = hit[1]
            draft = text[end:end + k]
            m = _match_len_between(text, end, tokens)
            return Draft(tokens=draft, confidence=[confidence(m)] * len(draft))
        return Draft(tokens=[])

    def propose_batch(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            self._live[r.seq_id] = r.tokens
            out.append(self.propose(r.tokens, r.k))
        return out

    def release(self, seq_id: str) -> None:
        toks = self._live.pop(seq_id, None)
        if toks:
            self.add(toks)

    def snapshot(self) -> Any:
        """The store as it is now (``restore`` puts it back): what a benchmark restores between rounds."""
        return dict(self._texts), self._next, self._stored, dict(self._index)

    def restore(self, state: Any) -> None:
        texts, self._next, self._stored, index = state
        self._texts, self._index = dict(texts), dict(index)
        self._live.clear()


def _match_len_between(text: list[int], end: int, tokens: list[int], most: int = 32) -> int:
    """How many tokens before ``text[end]`` equal the last ones of ``tokens``: the match's true length."""
    m = 0
    L = len(tokens)
    while m < most and m < end and m < L and text[end - m - 1] == tokens[L - m - 1]:
        m += 1
    return m
