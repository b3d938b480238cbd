"""Built-in prompt-lookup drafter (plugin name ``ngram``).

Proposes the tokens that followed the most recent earlier occurrence of the
sequence's last n-gram: cheap, model-free, and strong on copy-heavy text
(edits, code that repeats its context).
"""

from __future__ import annotations

from dspark.hookspecs import hookimpl
from dspark.types import Draft, DrafterSpec, TargetModel

DSPARK_API_VERSION = "1.0"


class PromptLookupDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, tokens: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft(tokens=[])
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            # Latest earlier match first: recent context predicts best.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    follow = tokens[start + n:start + n + k]
                    if follow:
                        return Draft(tokens=list(follow))
        return Draft(tokens=[])


@hookimpl
def dspark_drafters(target: TargetModel) -> list[DrafterSpec]:
    return [DrafterSpec(name="prompt-lookup", kind="ngram", create=PromptLookupDrafter,
                        description="n-gram lookup in the request's own context (n = 3..1)")]
