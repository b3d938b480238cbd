"""An example third-party drafter: follow the request's own most frequent bigrams.

For the context's last token it proposes the token that most often followed
it earlier in the same context (the most recent one on ties), then the same
for that token, up to k tokens. It needs no model and no state, so it is
written against the plugin API 1.0 (``propose`` only) and shows that such
plugins keep working: the engine calls ``propose`` once per sequence.
"""

from __future__ import annotations

import dspark
from dspark import Draft, DrafterSpec, TargetModel

DSPARK_API_VERSION = "1.0"

WINDOW = 512  # context tokens the table is built from


class BigramDrafter:
    def propose(self, tokens: list[int], k: int) -> Draft:
        ctx = tokens[-WINDOW:]
        if k <= 0 or len(ctx) < 2:
            return Draft(tokens=[])
        # follower -> (count, last position) per token
        table: dict[int, dict[int, tuple[int, int]]] = {}
        for i, (a, b) in enumerate(zip(ctx, ctx[1:])):
            row = table.setdefault(a, {})
            n, _ = row.get(b, (0, 0))
            row[b] = (n + 1, i)
        out: list[int] = []
        t = ctx[-1]
        while len(out) < k and t in table:
            t = max(table[t].items(), key=lambda kv: kv[1])[0]  # most frequent, then most recent
            out.append(t)
        return Draft(tokens=out)


@dspark.hookimpl
def dspark_drafters(target: TargetModel) -> list[DrafterSpec]:
    return [DrafterSpec(name="bigram", kind="other", create=BigramDrafter,
                        description="most frequent follower of the last token in the request's own context")]
