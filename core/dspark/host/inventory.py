"""The device inventory: every device the plugins probed, merged by physical id."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from dspark.host.plugin_manager import PluginHost
from dspark.types import Device, HardwareUnavailable, PluginFault, PluginRecord, PluginStatus, Unavailable


class DeviceEntry(BaseModel):
    """One physical device and every (plugin, runtime) that can drive it."""

    id: str
    kind: str
    name: str
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    memory_bandwidth_bytes_per_s: float | None = None
    host_link_bandwidth_bytes_per_s: float | None = None
    peak_flops: dict[str, float] = Field(default_factory=dict)
    dtypes: list[str] = Field(default_factory=list)
    utilization: float | None = None
    plugins: list[str] = Field(default_factory=list)
    drivers: list[Device] = Field(default_factory=list)

    @classmethod
    def merge(cls, drivers: list[Device]) -> DeviceEntry:
        first = drivers[0]

        def best(attr: str) -> Any:
            values = [getattr(d, attr) for d in drivers if getattr(d, attr) is not None]
            return max(values) if values else None

        flops: dict[str, float] = {}
        for d in drivers:
            for dtype, f in d.peak_flops.items():
                flops[dtype] = max(flops.get(dtype, 0.0), f)
        dtypes: list[str] = []
        for d in drivers:
            dtypes += [t for t in d.dtypes if t not in dtypes]
        free = [d.memory_free_bytes for d in drivers if d.memory_free_bytes is not None]
        return cls(
            id=first.id, kind=first.kind, name=first.name,
            memory_total_bytes=best("memory_total_bytes"),
            memory_free_bytes=min(free) if free else None,
            memory_bandwidth_bytes_per_s=best("memory_bandwidth_bytes_per_s"),
            host_link_bandwidth_bytes_per_s=best("host_link_bandwidth_bytes_per_s"),
            peak_flops=flops, dtypes=dtypes, utilization=best("utilization"),
            plugins=list(dict.fromkeys(d.plugin for d in drivers)),
            drivers=drivers,
        )


class Inventory(BaseModel):
    devices: list[DeviceEntry]
    plugins: list[PluginRecord]

    def device(self, device_id: str) -> DeviceEntry:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise KeyError(f"no device {device_id!r}; have {[d.id for d in self.devices]}")

    def drivers(self) -> list[Device]:
        """Every (device, plugin) pair, the unit the placer assigns ops to."""
        return [drv for d in self.devices for drv in d.drivers]

    def faults(self) -> list[PluginFault]:
        """Every plugin's recorded failures (each plugin's record holds its own, updated as they happen)."""
        return [f for p in self.plugins for f in p.faults]

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "devices": [d.model_dump(mode="json") for d in self.devices],
            "plugins": [p.model_dump(mode="json") for p in self.plugins],
        }


def probe(host: PluginHost, refresh: bool = False) -> Inventory:
    """Ask every active plugin for its devices (concurrently) and merge them."""
    results = host.call_all("dspark_probe_devices", refresh=refresh)
    by_id: dict[str, list[Device]] = {}
    for name, result in results.items():
        record = host.records[name]
        if isinstance(result, HardwareUnavailable):
            record.status, record.reason, record.devices = PluginStatus.NO_HARDWARE, str(result), []
            continue
        if record.status == PluginStatus.FAILED:
            continue
        found = [d for d in result or [] if isinstance(d, Device)]
        record.unavailable = [u for u in result or [] if isinstance(u, Unavailable)]
        if not found:
            record.status = PluginStatus.NO_HARDWARE
            record.reason = "; ".join(f"{u.what}: {u.reason}" for u in record.unavailable) or "probe found no devices"
            continue
        record.status, record.reason = PluginStatus.ACTIVE, ""
        record.devices = [d.id for d in found]
        for device in found:
            by_id.setdefault(device.id, []).append(device)
    # Hardware plugins first, the hardware-neutral torch reference last, so a
    # device's name comes from the runtime that knows it best.
    order = {n: i for i, n in enumerate(host.records)}
    devices = []
    for drivers in by_id.values():
        drivers.sort(key=lambda d: (d.plugin == "torch", order.get(d.plugin, 0)))
        devices.append(DeviceEntry.merge(drivers))
    devices.sort(key=lambda d: (["cpu", "cuda", "gpu", "npu", "other"].index(d.kind), d.id))
    return Inventory(devices=devices, plugins=list(host.records.values()))
