"""The built-in lookup drafters' plugin (plugin name ``ngram``).

It offers ``prompt-lookup`` (:mod:`dspark.builtin.prompt_lookup`: n-gram lookup
in the request's own context) and ``suffix-lookup`` (:mod:`dspark.builtin.suffix`:
lookup in earlier requests' text).
"""

from __future__ import annotations

from dspark.builtin.prompt_lookup import PromptLookupDrafter, confidence
from dspark.builtin.suffix import NGRAMS, SuffixDrafter
from dspark.hookspecs import hookimpl
from dspark.types import DrafterSpec, TargetModel

DSPARK_API_VERSION = "1.3"  # Draft.source

__all__ = ["DSPARK_API_VERSION", "PromptLookupDrafter", "SuffixDrafter", "confidence", "dspark_drafters"]


@hookimpl
def dspark_drafters(target: TargetModel) -> list[DrafterSpec]:
    return [DrafterSpec(name="prompt-lookup", kind="ngram", create=PromptLookupDrafter,
                        description="n-gram lookup in the request's own context (n = 3..1)"),
            DrafterSpec(name="suffix-lookup", kind="ngram", create=SuffixDrafter,
                        description="n-gram lookup in earlier requests' text (n = "
                        + ", ".join(map(str, NGRAMS)) + ")")]
