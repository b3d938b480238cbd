"""Collecting drafter offers from plugins for a target model, and what in-process drafters get of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dspark.host.plugin_manager import PluginHost
from dspark.types import DrafterSpec, TargetModel


@dataclass(frozen=True)
class TargetRuntime:
    """``TargetModel.runtime``: what a drafter in the engine's process may use of the target, and nothing
    else of the engine. ``runner`` and ``cache`` are the target's model runner and paged KV cache
    (self-speculation reuses both); ``place_decoder(runner, path, max_total_tokens)`` places another
    model's decoder as the target's was (returns the runner to use and the choice); None where the
    engine places nothing."""

    runner: Any
    cache: Any
    place_decoder: Callable[[Any, Path, int], tuple[Any, Any]] | None = None


def collect_drafters(host: PluginHost, target: TargetModel) -> list[DrafterSpec]:
    """Every drafter every active plugin offers for ``target``, in plugin load order."""
    offers: list[DrafterSpec] = []
    for specs in host.call_all("dspark_drafters", target=target).values():
        offers.extend(specs or [])
    return offers
