"""Which way a lone greedy request decodes its next stretch: plain greedy steps, or copy steps of k tokens
drafted by one lookup (prompt lookup, or a store of earlier requests' text) at a fixed width, judged on what
each would have cost over the text the request just produced.

One request at a time, a verification step's shape and the per-step choice weigh most: a step of 1 + k rows
costs little more than a step of one row once its shape holds, and a change of shape, or the choice itself,
costs as much as a whole step of a small model. Greedy verification keeps exactly the tokens plain decoding
makes, so once tokens are out, what a lookup would have done over them is known exactly, whichever way they
were made: at each step's start p, the lookup's draft of k tokens from the text before p is accepted up to
its first token unlike the text, and the target adds one. ``Replay`` goes over every token a request
produces, for each lookup and each k of ``KS``, and keeps decayed counts of the tokens and steps each would
have taken; ``choose`` picks the way whose steps would have cost least per token at the measured step costs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dspark.builtin.prompt_lookup import NgramIndex

KS = (1, 2, 3, 5, 7)  # drafted tokens per copy step tried
DECAY = 0.98  # per token replayed: the recent text counts (half-life about 35 tokens)
MIN_TOKENS = 12.0  # replayed tokens before the replay decides
STRETCH_TOKENS = 16.0  # tokens a stretch makes, about: what a change of way is spread over
# Greedy stretches chosen in a row while every copy way would have cost at least LEAD x plain steps a token run
# twice as long each time (up to GROW_MAX x): their choice and each run's own cost are paid less often.
LEAD, GROW_MAX = 1.25, 4

# A lookup other than the request's own prompt lookup: (the text so far, k) -> its draft of up to k tokens.
Lookup = Callable[[list[int], int], list[int]]


@dataclass
class _Way:
    """Copy steps of ``k`` tokens drafted by lookup ``src``, replayed: where its next step starts, decayed
    tokens and steps."""

    src: int
    k: int
    pos: int
    tokens: float = 0.0
    steps: float = 0.0

    def step(self, made: int) -> None:
        f = DECAY ** made
        self.tokens = self.tokens * f + made
        self.steps = self.steps * f + 1.0
        self.pos += made


class Replay:
    """One request's replay. ``ids`` are its prompt then its outputs; the replay starts at its first output.
    Lookup 0 is prompt lookup in the request's own text (n-grams of ``min_ngram`` to ``max_ngram`` tokens,
    the ``prompt-lookup`` drafter's rule); ``others`` are lookups 1, 2, ..."""

    def __init__(self, prompt: list[int], min_ngram: int = 1, max_ngram: int = 3,
                 others: Sequence[Lookup] = ()) -> None:
        self.index = NgramIndex(min_ngram, max_ngram)
        self.index.extend(list(prompt))
        self.others = list(others)
        self.start = len(prompt)
        self.ways = [_Way(src, k, self.start) for src in range(1 + len(self.others)) for k in KS]
        self.drafts: dict[int, list[list[int]]] = {}  # position -> each lookup's draft from the text before it
        self.way: tuple[int, int] = (0, 0)  # the way last chosen: (lookup, drafted tokens a step); k 0: plain
        self.grow = 1  # a greedy stretch's length, in stretches: doubled while plain steps lead by LEAD

    @property
    def tokens(self) -> float:
        return min(w.tokens for w in self.ways)

    def catch_up(self, ids: list[int]) -> None:
        """Replay the tokens of ``ids`` not replayed yet."""
        kmax = KS[-1]
        for p in range(len(self.index.toks), len(ids)):
            self.drafts[p] = [self.index.lookup(kmax)[0], *(f(ids[:p], kmax) for f in self.others)]
            self.index.extend([ids[p]])
        end = len(ids)
        for w in self.ways:
            while w.pos < end:
                d = self.drafts[w.pos][w.src][:w.k]
                j = 0
                while j < len(d) and w.pos + j < end and d[j] == ids[w.pos + j]:
                    j += 1
                if w.pos + j >= end:  # the target's token after the accepted ones is not out yet
                    break
                w.step(j + 1)
        low = min(w.pos for w in self.ways)
        for p in [p for p in self.drafts if p < low]:
            del self.drafts[p]

    def choose(self, step_ms: Callable[[int], float], change_ms: float = 0.0) -> tuple[int, int] | None:
        """The way of the next stretch, (lookup, drafted tokens a step; 0: plain greedy steps), at
        ``step_ms(rows)`` a step of one sequence of that many rows; a way other than the last one chosen also
        pays ``change_ms`` (a change of the step's shape) over a stretch's tokens. None while too little is
        replayed."""
        if self.tokens < MIN_TOKENS:
            return None
        per_switch = change_ms / STRETCH_TOKENS
        last_rows = 1 + self.way[1]

        def cost(rows: int, per_token: float) -> float:
            return per_token + (per_switch if rows != last_rows else 0.0)

        plain = cost(1, step_ms(1))
        best, low, copy = (0, 0), plain, float("inf")
        for w in self.ways:
            c = cost(1 + w.k, step_ms(1 + w.k) * w.steps / w.tokens)
            copy = min(copy, c)
            if c < low:
                best, low = (w.src, w.k), c
        self.way = best
        self.grow = min(2 * self.grow, GROW_MAX) if best[1] == 0 and copy >= LEAD * plain else 1
        return best
