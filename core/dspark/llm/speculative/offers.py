"""Collecting drafter offers from plugins for a target model."""

from __future__ import annotations

from dspark.host.plugin_manager import PluginHost
from dspark.types import DrafterSpec, TargetModel


def collect_drafters(host: PluginHost, target: TargetModel) -> list[DrafterSpec]:
    """Every drafter every active plugin offers for ``target``, in plugin load order."""
    offers: list[DrafterSpec] = []
    for specs in host.call_all("dspark_drafters", target=target).values():
        offers.extend(specs or [])
    return offers
