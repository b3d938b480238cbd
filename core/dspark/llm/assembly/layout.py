"""An engine's :class:`~dspark.llm.outputs.EngineLayout`: what runs the model and where, read from its parts."""

from __future__ import annotations

from typing import Any

from dspark.host.log import get_logger
from dspark.llm.outputs import EngineLayout

log = get_logger("dspark.llm.layout")


def describe(engine: Any) -> EngineLayout:
    """Read from what the engine built: its decoder target (the one running now, after any failover), layer
    placement, dense offload, drafters and its plugin host (made on first need: an import per plugin, no
    device probing)."""
    placement = getattr(engine, "placement", None)
    used: list[str] = ["torch"]
    if placement is not None:
        pieces = [placement.embed, *placement.layers, placement.head]
        devices = sorted({p.device_id for p in pieces}, key=lambda d: (d != "cpu", d))
        used += [p.plugin for p in pieces]
        target = f"torch on {'+'.join(devices)} (layers placed by the placer)"
    else:
        devices = ["cpu"]
        target = "torch on cpu"
        current = getattr(getattr(engine, "runner", None), "current", None)  # a plugin's compiled decoder
        if current is not None and current.plugin:
            used.append(current.plugin)
            devices = [current.device_id]
            choice = getattr(engine, "decoder_choice", None)
            target = f"{current.label} ({current.runtime})" + (f", {choice.reason}" if choice is not None else "")
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
                        drafters=drafters, placement=placement, mlp=mlp)
