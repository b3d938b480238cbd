"""Calibration entries: their keys, the disk cache they live in, and which ones this process used.

Entries live in :mod:`dspark.host.cache` (namespace ``calibration``), keyed by
the subgraph's signature, the dim hints it uses, the device (id and name), the
runtime (name and version) and :func:`dspark.host.hostinfo.fingerprint`. Each
entry this process loaded or measured for a bid is also remembered in memory
under what the executor can name without the plugin's runtime key (plugin,
device id, signature, dims), so that :mod:`.observe` finds the entry a plan's
run times are to be compared with.
"""

from __future__ import annotations

import contextlib
import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from dspark.graph.model import Graph, Subgraph
from dspark.host import cache, hostinfo
from dspark.sdk.calibration import config
from dspark.types import Device

# (plugin, device id, subgraph signature, dims as JSON): how a run names a calibrated subgraph.
Identity = tuple[str, str, str, str]


def _symbols(subgraph: Subgraph) -> set[str]:
    names = set(subgraph.inputs) | {t for op in subgraph.ops for t in op.inputs + op.outputs if t}
    return {d for t in names if (spec := subgraph.graph.tensors.get(t)) for d in spec.shape if isinstance(d, str)}


def dims(subgraph: Subgraph) -> dict[str, int]:
    """The value of each symbolic dim ``subgraph`` uses, from the dim hints (1 without a hint)."""
    hints = subgraph.graph.dim_hints
    return {s: hints.get(s, 1) for s in sorted(_symbols(subgraph))}


def device_key(device: Device, runtime_key: str) -> dict[str, Any]:
    return {"v": config.VERSION, "device": device.id, "device_name": device.name, "runtime": runtime_key,
            "host": hostinfo.fingerprint()}


def cache_key(subgraph: Subgraph, device: Device, runtime_key: str, *, cold: bool | str = False) -> dict[str, Any]:
    """Everything a calibrated latency depends on (weight values are assumed not to matter).
    ``cold``: how caches were flushed (False: a warm loop)."""
    key = {"sig": subgraph.signature(), "dims": dims(subgraph), **device_key(device, runtime_key)}
    if cold:  # only then: warm keys stay what they were
        key["cold"] = cold
    return key


def shape_family_key(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` (from :func:`cache_key`) for every size of the same subgraph: where the ratio of a timed
    run to the roofline is kept, for sizes too slow to time during planning."""
    return {**{k: v for k, v in key.items() if k != "dims"}, "family": "roofline-ratio-v1"}


_seen: set[str] = set()


def first_sight(key: dict[str, Any]) -> bool:
    """Whether this process meets the entry of ``key`` for the first time."""
    k = json.dumps(key, sort_keys=True, default=str)
    with _lock:
        if k in _seen:
            return False
        _seen.add(k)
        return True


def remember_ratio(key: dict[str, Any], dims_: dict[str, int], roofline_s: float, latency_s: float) -> None:
    """Keep ``latency_s / roofline_s`` for the subgraph's shape family, from its largest size timed so far
    (the closest to the sizes it will stand in for)."""
    fam = shape_family_key(key)
    old = load(fam)
    if old is not None and float(old.get("roofline_s", 0.0)) > roofline_s:
        return
    save(fam, {"ratio": latency_s / roofline_s, "roofline_s": roofline_s, "dims": dims_})


def identity(subgraph: Subgraph, device: Device) -> Identity:
    return (device.plugin, device.id, subgraph.signature(), json.dumps(dims(subgraph), sort_keys=True))


def load(key: dict[str, Any]) -> dict[str, Any] | None:
    value = cache.load(config.NAMESPACE, key)
    return value if isinstance(value, dict) else None


def save(key: dict[str, Any], value: dict[str, Any]) -> None:
    cache.store(config.NAMESPACE, key, value)


@dataclass(frozen=True)
class Used:
    """A calibrated entry a bid of this process was made from."""

    key: dict[str, Any]
    latency_s: float
    cold: bool
    subgraph: str  # op types, for logs


_used: dict[Identity, Used] = {}
_devices: set[tuple[str, str]] = set()  # (plugin, device id) of every entry remembered
# One-op subgraphs by (plugin, device id, id(graph), op name): a run names the ops of a partition
# without computing a signature per op. The weak reference tells a reused id apart.
_ops: dict[tuple[str, str, int, str], tuple[weakref.ref[Graph], Identity]] = {}
_lock = threading.Lock()


def remember(subgraph: Subgraph, device: Device, key: dict[str, Any], latency_s: float) -> None:
    ops = ",".join(op.op_type for op in subgraph.ops[:4]) + (",..." if len(subgraph.ops) > 4 else "")
    with _lock:
        ident = identity(subgraph, device)
        _used[ident] = Used(key, latency_s, bool(key.get("cold")), ops)
        _devices.add((device.plugin, device.id))
        if len(subgraph.ops) == 1:
            with contextlib.suppress(TypeError):  # a graph type without weak references: no index
                _ops[(device.plugin, device.id, id(subgraph.graph), subgraph.ops[0].name)] = \
                    (weakref.ref(subgraph.graph), ident)


def lookup(ident: Identity) -> Used | None:
    return _used.get(ident)


def op_identity(graph: Graph, op: str, device: Device) -> Identity | None:
    """The identity under which op ``op`` of ``graph`` alone was calibrated for ``device``, if it was."""
    found = _ops.get((device.plugin, device.id, id(graph), op))
    return found[1] if found is not None and found[0]() is graph else None


def has_any(plugin: str, device_id: str) -> bool:
    """Whether this process used any calibrated entry of ``plugin`` on ``device_id``."""
    return (plugin, device_id) in _devices


def replace(ident: Identity, used: Used, value: dict[str, Any]) -> Used:
    """Store ``value`` (with a latency) as ``used``'s entry; the new :class:`Used`."""
    save(used.key, value)
    new = Used(used.key, float(value["latency_s"]), used.cold, used.subgraph)
    with _lock:
        _used[ident] = new
    return new


def drop(ident: Identity, used: Used) -> None:
    """Delete ``used``'s entry: the next bid measures it again."""
    cache.delete(config.NAMESPACE, used.key)
    with _lock:
        if _used.get(ident) is used:
            del _used[ident]


def forget() -> None:
    """Forget which entries this process used (after the cache was cleared)."""
    with _lock:
        _used.clear()
        _devices.clear()
        _ops.clear()


def clear() -> int:
    """Delete every calibration entry on disk and forget the ones in use; the number deleted."""
    forget()
    return cache.clear(config.NAMESPACE)
