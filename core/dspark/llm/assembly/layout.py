"""An engine's :class:`~dspark.llm.outputs.EngineLayout`: what runs the model and where, read from its parts."""

from __future__ import annotations

from typing import Any

from dspark.host.log import get_logger
from dspark.llm.outputs import EngineLayout

log = get_logger("dspark.llm.layout")


def device_map(engine: Any) -> Any:
    """The engine's :class:`~dspark.llm.device_map.DeviceMap` now (after any failover)."""
    from dspark.llm.device_map.pieces import DeviceMap

    placed = getattr(engine, "device_map", None)  # devices=: the torch runner's layers, mapped by the placer
    if placed is not None:
        return placed
    runner = getattr(engine, "runner", None)
    n = runner.cfg.num_hidden_layers if runner is not None else 0
    current = getattr(runner, "current", None)  # the decoder target running now
    if current is not None and current.device_map is not None:  # compiled decoders on layer ranges
        return current.device_map
    if current is not None and current.plugin:  # one compiled decoder holds the model
        return DeviceMap.whole(n, current.device_id, current.plugin, current.runtime)
    return DeviceMap.whole(n, "cpu", "torch", "torch")


def describe(engine: Any) -> EngineLayout:
    """Read from what the engine built: its decoder target (the one running now, after any failover), its device
    map, dense offload, drafters and its plugin host (made on first need: an import per plugin, no device
    probing)."""
    placed = device_map(engine)
    devices = placed.devices
    used: list[str] = ["torch", *placed.runs.values()]
    current = getattr(getattr(engine, "runner", None), "current", None)
    if getattr(engine, "device_map", None) is not None:
        used += [p.plugin for p in [placed.embed, *placed.layers, placed.head]]
        target = f"torch on {'+'.join(devices)} (layers mapped by the placer: {placed.describe()})"
    elif current is not None and not current.is_reference:
        choice = getattr(engine, "decoder_choice", None)
        target = f"{current.label} ({current.runtime})" + (f", {choice.reason}" if choice is not None else "")
    else:
        target = "torch on cpu"
    decision = getattr(engine, "dense_offload_decision", None)
    mlp = None
    if getattr(engine, "dense_offload", None) is not None and decision is not None and decision.plugin:
        mlp = (decision.plugin, decision.device_id)
        used.append(decision.plugin)
        if decision.device_id not in devices:
            devices.append(decision.device_id)
        target += f", prefill MLP on {decision.plugin}@{decision.device_id}"
    dtype = str(getattr(getattr(engine, "runner", None), "dtype", "")).replace("torch.", "")
    if dtype:
        target += f" ({dtype})"
    if getattr(engine, "quant_plan", None) is not None:
        target += ", quantized"
    spec = getattr(engine, "spec", None)
    drafters = None
    if spec is not None:
        handles = getattr(spec, "handles", []) or []
        drafters = [getattr(h, "name", str(h)) for h in handles]
        used += [str(h.plugin) for h in handles if getattr(h, "plugin", None)]
    plugins: list[str] = []
    try:
        plugins = list(engine.plugin_host.active())  # the engine's one host (placement, quantization, drafters)
    except Exception as e:  # a broken plugin install must not stop a server: say so and go on
        log.warning("could not list the plugins", error=repr(e))
    return EngineLayout(target=target, devices=devices, plugins=plugins, plugins_used=list(dict.fromkeys(used)),
                        drafters=drafters, device_map=placed, mlp=mlp)
