"""A probe's device list kept in the disk cache (plugin API 1.16).

Importing a runtime and asking it for its devices is most of what ``dspark devices`` and an engine's start
would pay for a plugin whose runtime then runs nothing; a plugin keys its list by what the list depends on,
read without importing the runtime (its installed version, the device nodes, the host's CPU), and reuses it
while that is unchanged. The figures that change from one moment to the next (free memory, load) are read
again on every use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dspark.host import cache, hostinfo
from dspark.types import Device, Unavailable


def cached_devices(namespace: str, key: Any,
                   relive: Callable[[Device], None] | None = None) -> list[Device | Unavailable] | None:
    """The list :func:`store_devices` kept under ``key``, each CPU device's memory, load and bandwidth read now
    and ``relive`` applied to every other device (its own live figures); None on a miss or for a list written
    by an older layout of the records."""
    hit = cache.load(namespace, key)
    if hit is None:
        return None
    try:
        return [_relive(entry, relive) for entry in hit]
    except (ValueError, TypeError, KeyError):
        return None


def store_devices(namespace: str, key: Any, found: Sequence[Device | Unavailable]) -> None:
    """Keep a probe's list under ``key`` (see :func:`cached_devices`)."""
    cache.store(namespace, key, [d.model_dump(mode="json") for d in found])


def _relive(entry: dict[str, Any], relive: Callable[[Device], None] | None) -> Device | Unavailable:
    if "what" in entry:
        return Unavailable.model_validate(entry)
    device = Device.model_validate(entry)
    if device.kind == "cpu":
        device.memory_total_bytes, device.memory_free_bytes = hostinfo.memory()
        device.utilization = hostinfo.cpu_utilization()
        device.memory_bandwidth_bytes_per_s = hostinfo.memory_bandwidth(False)
    elif relive is not None:
        relive(device)
    return device
