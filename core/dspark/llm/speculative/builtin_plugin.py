"""The engine's built-in drafters plugin (plugin name ``drafters``).

Offers, for a target running in this process:

- ``draft-model:<dir>`` (kind ``model``): a separate small checkpoint with the
  target's vocabulary and tokenizer: the one named by the engine's
  ``draft_model`` setting, or with ``auto`` the ones found next to the target
  that say they were made for it (the embedded model's ``stdlib-llama-draft``);
- ``feature-head:<dir>`` (kind ``model``), when ``draft_head`` asks for one: a feature-level head
  (EAGLE-style) over the target's own last hidden states, found next to the target
  (``dspark_head_for`` in its config, with ``auto``) or named by its directory;
- ``self-draft`` (kind ``self``): the target's own first layers plus its LM
  head, exiting at the layer it was trained for (``dspark_early_exit_layers``
  in its config) or at the one measured best.

The engine's settings reach the hook in ``target.properties``. Heavy imports
happen inside the hook, so loading the plugin stays cheap. It lives with the
engine's drafters because it offers them; the lookup drafters are the
built-in plugin ``ngram`` (:mod:`dspark.builtin.ngram`), which needs no engine.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from dspark.hookspecs import hookimpl
from dspark.types import DrafterSpec, TargetModel

DSPARK_API_VERSION = "1.1"


@hookimpl
def dspark_drafters(target: TargetModel) -> list[DrafterSpec] | None:
    from dspark.llm.speculative.drafters import DraftModelDrafter, SelfDrafter, compatibility_problem, find_draft_models

    props: dict[str, Any] = target.properties
    specs: list[DrafterSpec] = []
    choice = str(props.get("draft_model", "auto"))
    if target.path is not None and choice != "none":
        paths = find_draft_models(target.path) if choice == "auto" else [choice]
        for p in paths:
            if compatibility_problem(target.path, p) is not None:
                continue  # the engine validated an explicit path already; auto only lists compatible ones
            specs.append(DrafterSpec(
                name=f"draft-model:{p.name if hasattr(p, 'name') else p}", kind="model",
                description=f"separate draft checkpoint {p}",
                create=partial(DraftModelDrafter, p, str(props.get("dtype", "float32")),
                               int(props.get("max_total_tokens", 8192)), int(props.get("page_size", 16)),
                               target.runtime)))
    head_choice = str(props.get("draft_head", "none"))
    if target.path is not None and head_choice != "none" and Path(target.path).is_dir():
        from dspark.llm.speculative.head.model import find_heads
        from dspark.llm.speculative.head.drafter import FeatureHeadDrafter

        for hp in find_heads(target.path) if head_choice == "auto" else [Path(head_choice)]:
            specs.append(DrafterSpec(
                name=f"feature-head:{hp.name}", kind="model",
                description=f"feature-level draft head {hp} over the target's last hidden state",
                create=partial(FeatureHeadDrafter, hp, target.path)))
    rt = target.runtime
    if rt is not None and target.num_layers >= 2 and props.get("runs_early_exit", True):
        exits = [int(e) for e in props.get("early_exit_layers", []) or []]
        fixed = props.get("exit_layer", "auto")
        cands = sorted(set(exits) | set(range(1, max(2, target.num_layers // 2 + 1))))
        first = int(fixed) if fixed != "auto" else (exits[0] if exits else None)
        specs.append(DrafterSpec(
            name="self-draft", kind="self",
            description="the target's first layers + its LM head (early exit"
                        + (f", trained at layer {exits})" if exits else ")"),
            create=partial(SelfDrafter, rt, first, cands if fixed == "auto" else [int(fixed)])))
    return specs or None
