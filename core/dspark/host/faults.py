"""Charging a plugin's failures to the smallest thing that failed.

A failing bid, compile, quantize or executable run is charged to the
subgraph signature on its device: that plugin is not asked about that
signature on that device again. Once ``faults_per_device`` distinct
signatures have failed on one device, the plugin loses the device. Once the
plugin has failed ``faults_per_plugin`` times in all (or its probe failed, or
a hook hung) the whole plugin is failed. A hook with no subgraph (drafters)
is charged to what it was asked about (the target model). Every failure is
kept, counted, as a :class:`~dspark.types.PluginFault` on the plugin's record.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from dspark.graph.model import Subgraph
from dspark.host.settings import PluginSettings
from dspark.types import Device, FaultScope, PluginFault


def scope_of(kwargs: dict[str, Any]) -> tuple[str | None, str, str | None]:
    """(signature, op types, device id) of what a hook call was about."""
    sub = kwargs.get("subgraph")
    device = kwargs.get("device")
    dev_id = device.id if isinstance(device, Device) else None
    if isinstance(sub, Subgraph):
        return sub.signature(), describe(sub), dev_id
    target = kwargs.get("target")
    name = getattr(target, "name", None)
    if name is not None:
        return f"model:{name}", "", dev_id
    return None, "", dev_id


def describe(sub: Subgraph) -> str:
    """The subgraph's op types in order of first use, with counts: 'MatMul x8 Softmax Add x3'."""
    counts = Counter(op.op_type for op in sub.ops)
    return " ".join(t if n == 1 else f"{t} x{n}" for t, n in counts.items())


class FaultLedger:
    """Every plugin's faults, and which (plugin, device, signature) are no longer asked."""

    def __init__(self, settings: PluginSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._faults: dict[str, list[PluginFault]] = {}
        self._signatures: set[tuple[str, str | None, str]] = set()  # (plugin, device, signature)
        self._devices: set[tuple[str, str]] = set()  # (plugin, device)
        self._last: dict[str, PluginFault] = {}

    def of(self, plugin: str) -> list[PluginFault]:
        """The plugin's fault list (the same list object every time, so a record can hold it)."""
        with self._lock:
            return self._faults.setdefault(plugin, [])

    def any(self, plugin: str) -> bool:
        return bool(self._faults.get(plugin))

    def count(self, plugin: str) -> int:
        with self._lock:
            return sum(f.count for f in self._faults.get(plugin, []))

    def refusal(self, plugin: str, signature: str | None, device: str | None) -> str | None:
        """Why ``plugin`` is not asked about ``signature`` on ``device`` any more, or None."""
        with self._lock:
            if device is not None and (plugin, device) in self._devices:
                return f"device {device} lost after repeated failures"
            if signature is not None and (plugin, device, signature) in self._signatures:
                return f"subgraph {signature} failed before"
        return None

    def charge(self, plugin: str, hook: str, reason: str, *, signature: str | None = None, ops: str = "",
               device: str | None = None, fatal: bool = False) -> FaultScope:
        """Record one failure; return what it is charged to ('plugin' means: fail the whole plugin)."""
        with self._lock:
            faults = self._faults.setdefault(plugin, [])
            fault = next((f for f in faults if (f.hook, f.subgraph, f.device) == (hook, signature, device)), None)
            if fault is None:
                fault = PluginFault(plugin=plugin, hook=hook, subgraph=signature, ops=ops, device=device,
                                    reason=reason, count=1, charged_to="subgraph")
                faults.append(fault)
            else:
                fault.count += 1
                fault.reason = reason
            self._last[plugin] = fault
            total = sum(f.count for f in faults)
            scope: FaultScope
            if fatal or signature is None or total >= self.settings.faults_per_plugin:
                scope = "plugin"
            else:
                self._signatures.add((plugin, device, signature))
                failing = {f.subgraph for f in faults if f.device == device and f.subgraph is not None}
                scope = "device" if device is not None and len(failing) >= self.settings.faults_per_device \
                    else "subgraph"
                if scope == "device":
                    self._devices.add((plugin, device))  # type: ignore[arg-type]
            if scope == "plugin":
                for f in faults:
                    f.charged_to = "plugin"
            elif scope == "device":
                for f in faults:
                    if f.device == device:
                        f.charged_to = "device"
            else:
                fault.charged_to = "subgraph"
            return scope

    def last(self, plugin: str) -> PluginFault | None:
        with self._lock:
            return self._last.get(plugin)

    def forgive(self, plugin: str) -> None:
        """Forget the plugin's faults and exclusions (the conformance kit probes case by case)."""
        with self._lock:
            self._faults.get(plugin, []).clear()
            self._last.pop(plugin, None)
            self._signatures = {k for k in self._signatures if k[0] != plugin}
            self._devices = {k for k in self._devices if k[0] != plugin}
