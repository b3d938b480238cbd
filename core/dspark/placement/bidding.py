"""Collecting bids, compiling and quantizing through the owning plugin."""

from __future__ import annotations

from dspark.graph.model import Subgraph
from dspark.host.inventory import Inventory
from dspark.host.plugin_manager import PluginHost
from dspark.types import Bid, Device, Executable, QuantSpec


def collect_bids(host: PluginHost, inventory: Inventory, subgraph: Subgraph) -> list[tuple[Device, Bid]]:
    """Every bid for ``subgraph``: each plugin is asked about its own devices only."""
    bids: list[tuple[Device, Bid]] = []
    for device in inventory.drivers():
        bid = host.call(device.plugin, "dspark_bid", subgraph=subgraph, device=device)
        if bid is not None:
            bids.append((device, bid))
    return bids


def compile_on(host: PluginHost, device: Device, subgraph: Subgraph) -> Executable:
    """Compile with the plugin that owns ``device``; a refusal after a bid is an error.

    Every failure is charged to the plugin (a refusal too), so the plugin is
    not asked about this subgraph signature on this device again.
    """
    plugin = device.plugin
    why = host.faults.refusal(plugin, subgraph.signature(), device.id) if host.faults.any(plugin) else None
    before = host.fault_count(plugin)
    exe = None if why else host.call(plugin, "dspark_compile", subgraph=subgraph, device=device)
    if exe is None:
        record = host.records.get(plugin)
        if why is None and host.fault_count(plugin) > before and (fault := host.last_fault(plugin)) is not None:
            why = fault.reason
        elif why is None and record is not None and plugin not in host.active():
            why = f"plugin is {record.status.value}: {record.reason}"
        elif why is None:
            why = "dspark_compile returned None after bidding"
            host.charge(plugin, "dspark_compile", why, subgraph=subgraph, device=device.id)
        raise RuntimeError(f"plugin {plugin!r} could not compile {len(subgraph.ops)} op(s) for {device.id}: {why}")
    return exe


def quantized_variants(host: PluginHost, inventory: Inventory, subgraph: Subgraph,
                       spec: QuantSpec) -> list[tuple[Device, Subgraph]]:
    """Quantized variants of ``subgraph`` from every plugin with a kernel for ``spec``."""
    variants: list[tuple[Device, Subgraph]] = []
    for device in inventory.drivers():
        variant = host.call(device.plugin, "dspark_quantize", subgraph=subgraph, device=device, spec=spec)
        if variant is not None:
            variants.append((device, variant))
    return variants
