"""The torch runner's layers over the devices torch drives here (``devices=``): mapped, then moved."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from dspark.host.log import get_logger
from dspark.llm.device_map.layers import map_layers
from dspark.llm.device_map.pieces import DeviceMap

if TYPE_CHECKING:
    from dspark.host.inventory import Inventory
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.runner.model import ModelRunner

log = get_logger("dspark.llm.device_map")


def torch_device_for(device_id: str, kind: str) -> str | None:
    """The torch device that runs an inventory device, or None when torch cannot drive it here."""
    if kind == "cpu":
        return "cpu"
    if device_id.startswith("cuda:"):
        import torch

        idx = int(device_id.split(":")[1])
        if torch.cuda.is_available() and idx < torch.cuda.device_count():
            return device_id
    return None


def host_and_inventory(devices: str) -> tuple[PluginHost, Inventory]:
    """``"auto"``: every installed plugin and the devices they probe; else a device-profile path."""
    if devices == "auto":
        from dspark.host.inventory import probe
        from dspark.host.plugin_manager import PluginHost

        host = PluginHost().load()
        return host, probe(host)
    from dspark.placement.profile import profile_host

    if not Path(devices).exists():
        raise FileNotFoundError(f"devices={devices!r}: expected 'auto' or a device-profile YAML file")
    return profile_host(devices)


def place_engine(runner: ModelRunner, devices: str, *, max_model_len: int, max_total_tokens: int,
                 decode_batch: int, prefill_chunk: int, host: PluginHost | None = None,
                 inv: Inventory | None = None) -> DeviceMap:
    """Plan the runner's pieces over ``devices`` ("auto" or a profile) and move them there.
    ``host``/``inv``: the engine's plugin host and inventory, used for ``"auto"`` (else built here)."""
    import torch

    if devices != "auto" or host is None or inv is None:
        host, inv = host_and_inventory(devices)
    runnable = {d.id: td for d in inv.devices if (td := torch_device_for(d.id, d.kind)) is not None}
    dropped = [d.id for d in inv.devices if d.id not in runnable]
    if dropped:
        log.warning("llm.device_map.devices_dropped", devices=dropped, reason="torch cannot drive them here")
    dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[runner.dtype]
    t0 = time.perf_counter()
    lp = map_layers(runner.cfg, host, inv, max_model_len=max_model_len, max_total_tokens=max_total_tokens,
                      dtype=dtype, decode_batch=decode_batch, prefill_chunk=prefill_chunk, devices=runnable)
    runner.place([runnable[p.device_id] for p in lp.layers], embed_device=runnable[lp.embed.device_id],
                 head_device=runnable[lp.head.device_id])
    log.info("llm.device_map", source=devices, seconds=round(time.perf_counter() - t0, 3), **lp.summary())
    return lp
