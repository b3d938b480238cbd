"""Device profiles: plan for a box you do not have (capacity planning).

A YAML file declares devices with their figures and the runtimes that drive
them. Each declared plugin name becomes a real plugin object registered on a
fresh :class:`~dspark.host.plugin_manager.PluginHost` (autoload off, no
built-ins): it reports the declared devices from ``dspark_probe_devices`` and
bids :func:`dspark.sdk.cost.roofline` with the declared figures from
``dspark_bid``, so the normal inventory and placer code runs unchanged.
Profiles cannot execute anything: they implement no ``dspark_compile``.

Sizes and rates may be numbers or strings with SI/binary prefixes, e.g.
``4 GiB``, ``68 GB/s``, ``20 TFLOPS``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from dspark.sdk.cost import DEFAULT_OP_OVERHEAD_S, roofline
from dspark.graph.model import Subgraph
from dspark.hookspecs import hookimpl
from dspark.host.inventory import Inventory, probe
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.types import Bid, Device, DeviceKind, DType
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_QUANTITY = re.compile(r"^\s*([0-9.]+(?:[eE][-+]?\d+)?)\s*(Ki|Mi|Gi|Ti|[kKMGTP])?\s*(B|B/s|FLOPS|FLOP/s|OPS|/s)?\s*$")


def _quantity(value: Any) -> Any:
    """'4 GiB' -> 4294967296.0; numbers pass through; anything else is left for pydantic to reject."""
    if isinstance(value, str):
        m = _QUANTITY.match(value)
        if m:
            return float(m.group(1)) * _PREFIX[m.group(2) or ""]
    return value


def _int_quantity(value: Any) -> Any:
    v = _quantity(value)
    return int(v) if isinstance(v, float) and v.is_integer() else v


Bytes = Annotated[int, BeforeValidator(_int_quantity), Field(ge=0)]
Rate = Annotated[float, BeforeValidator(_quantity), Field(gt=0)]


class ProfileError(ValueError):
    """A profile that does not load or validate; the message names the file and the field path."""


class RuntimeDecl(BaseModel):
    """One runtime (plugin) driving a declared device."""

    model_config = ConfigDict(extra="forbid")

    plugin: str = Field(min_length=1, description="Plugin name the plan will show, e.g. 'cpu' or 'npu'.")
    runtime: str = Field("", description="Runtime label, e.g. 'openvino/GPU'; defaults to '<plugin>/<device id>'.")
    call_overhead_s: float = Field(2e-5, ge=0, description="Paid once per partition call (dispatch).")
    op_overhead_s: float = Field(DEFAULT_OP_OVERHEAD_S, ge=0, description="Paid per op.")
    precision: DType | None = Field(None, description="Compute precision; default: float32 if declared, "
                                                      "else the fastest float dtype the device declares.")
    unsupported_ops: list[str] = Field(default_factory=list, description="ONNX op types it abstains on.")


class DeviceDecl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    kind: DeviceKind
    name: str = Field(min_length=1)
    memory_total_bytes: Bytes | None = None
    memory_free_bytes: Bytes | None = None
    peak_flops: dict[DType, Rate] = Field(min_length=1)
    memory_bandwidth_bytes_per_s: Rate | None = None
    host_link_bandwidth_bytes_per_s: Rate | None = None
    runtimes: list[RuntimeDecl] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> DeviceDecl:
        Device(id=self.id, kind=self.kind, name=self.name, runtime="x")  # reuse the id rule
        if self.memory_free_bytes is None:
            self.memory_free_bytes = self.memory_total_bytes
        elif self.memory_total_bytes is not None and self.memory_free_bytes > self.memory_total_bytes:
            raise ValueError("memory_free_bytes exceeds memory_total_bytes")
        for r in self.runtimes:
            if r.precision is not None and r.precision not in self.peak_flops:
                raise ValueError(f"runtime {r.plugin!r} computes in {r.precision}, "
                                 f"which peak_flops does not declare")
        return self

    def precision_for(self, rt: RuntimeDecl) -> DType:
        if rt.precision is not None:
            return rt.precision
        if "float32" in self.peak_flops:
            return "float32"
        floats = {k: v for k, v in self.peak_flops.items() if k.startswith(("float", "bfloat"))}
        pool = floats or self.peak_flops
        return max(pool, key=pool.__getitem__)


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "profile"
    description: str = ""
    devices: list[DeviceDecl] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> Profile:
        seen: set[tuple[str, str]] = set()
        for d in self.devices:
            for r in d.runtimes:
                if (d.id, r.plugin) in seen:
                    raise ValueError(f"plugin {r.plugin!r} declared twice for device {d.id!r}")
                seen.add((d.id, r.plugin))
        return self


def parse_profile(path: str | Path) -> Profile:
    """Read and validate a profile; :class:`ProfileError` names the file and each bad field's path."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{p}: profile file not found") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{p}: not valid YAML: {exc}") from None
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(x) for x in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()]
        raise ProfileError(f"{p}: invalid device profile:\n" + "\n".join(lines)) from None


class ProfileBidder:
    """The in-process plugin for one declared plugin name: declared devices, roofline bids."""

    DSPARK_API_VERSION = "1.0"

    def __init__(self, plugin: str, entries: list[tuple[DeviceDecl, RuntimeDecl]]) -> None:
        self.plugin = plugin
        self.entries = {d.id: (d, r) for d, r in entries}

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        del refresh  # nothing is measured
        out = []
        for d, r in self.entries.values():
            out.append(Device(
                id=d.id, kind=d.kind, name=d.name, runtime=r.runtime or f"{r.plugin}/{d.id}",
                memory_total_bytes=d.memory_total_bytes, memory_free_bytes=d.memory_free_bytes,
                peak_flops={str(k): v for k, v in d.peak_flops.items()}, memory_bandwidth_bytes_per_s=d.memory_bandwidth_bytes_per_s,
                host_link_bandwidth_bytes_per_s=d.host_link_bandwidth_bytes_per_s,
                dtypes=sorted(d.peak_flops), properties={"profile": True},
            ))
        return out

    @hookimpl
    def dspark_bid(self, subgraph: Subgraph, device: Device) -> Bid | None:
        d, r = self.entries[device.id]
        if any(op.op_type in r.unsupported_ops for op in subgraph.ops):
            return None
        precision = d.precision_for(r)
        latency = roofline(subgraph, device, precision, op_overhead_s=r.op_overhead_s,
                           call_overhead_s=r.call_overhead_s)
        scale = {"float16": 0.5, "bfloat16": 0.5, "int8": 0.25, "int4": 0.125}.get(precision, 1.0)
        return Bid(device_id=device.id, runtime=device.runtime, latency_s=latency, precision=precision,
                   peak_memory_bytes=int(subgraph.param_bytes * scale) + subgraph.io_bytes(),
                   fixed_overhead_s=r.call_overhead_s, source="roofline", note="from device profile")


def profile_host(profile: Profile | str | Path) -> tuple[PluginHost, Inventory]:
    """A plugin host holding only the profile's bidders, and the inventory they report."""
    prof = profile if isinstance(profile, Profile) else parse_profile(profile)
    host = PluginHost(PluginSettings(autoload=False))
    by_plugin: dict[str, list[tuple[DeviceDecl, RuntimeDecl]]] = {}
    for d in prof.devices:
        for r in d.runtimes:
            by_plugin.setdefault(r.plugin, []).append((d, r))
    for name, entries in by_plugin.items():
        host.register(ProfileBidder(name, entries), name, version=f"profile:{prof.name}")
    return host, probe(host)


def load_profile(path: str | Path) -> Inventory:
    """The inventory a profile declares (planning needs :func:`profile_host` for the bidders too)."""
    return profile_host(path)[1]
