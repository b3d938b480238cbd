"""The engine's runner at start-up: packed torch weights, then the decoder target (choose.py).

The engine hands over what the choice reads as a :class:`StartContext` and
takes the runner back; nothing here writes into the engine.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.host.log import get_logger

if TYPE_CHECKING:
    from dspark.host.inventory import Inventory
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.config import EngineConfig
    from dspark.llm.decoding.choose import DecoderChoice

log = get_logger("dspark.llm.decoder")


@dataclass(frozen=True)
class StartContext:
    """What choosing a decoder reads of the engine being built. The plugin host and the inventory are
    callables so that a start that runs the torch runner alone never loads plugins."""

    config: EngineConfig
    model_path: Path
    gguf: Any  # dspark.llm.gguf.GGUFModel or None
    quant_plan: Any  # dspark.llm.quantization.QuantPlan or None
    device_map: Any  # dspark.llm.device_map.DeviceMap of the torch runner's layers (devices=), or None
    dense_offload: Any
    plugin_host: Callable[[], PluginHost]
    inventory: Callable[[], Inventory]
    load_torch_runner: Callable[[], Any]


@dataclass(frozen=True)
class StartedRunner:
    """What :func:`setup_runner` decided: the runner to use, its packing, the decoder choice (None when only
    torch may run) and the KV page size."""

    runner: Any
    packed_linear: Any
    choice: DecoderChoice | None
    page_size: int


def why_torch_only(engine: StartContext) -> str | None:
    """Engine settings a compiled whole decoder cannot honour, or None."""
    cfg = engine.config
    if cfg.decoder == "torch":
        return "decoder='torch'"
    if engine.device_map is not None:
        return "devices= mapped the torch runner's layers itself"
    if engine.dense_offload is not None:
        return "dense_offload runs the torch runner's MLP elsewhere"
    return None


def _stored(engine: StartContext) -> bool:
    """A quantized GGUF file: only a decoder that runs it as stored may bid (its float weights are not kept)."""
    from dspark.llm.gguf import is_quantized

    return engine.gguf is not None and is_quantized(engine.gguf)


def setup_runner(engine: StartContext, runner: Any) -> StartedRunner:
    """Pack the torch ``runner`` and choose the decoder target: the runner the engine is to use."""
    from dspark.llm.runner.packed_linear import pack_runner

    cfg = engine.config
    if getattr(runner, "is_weightless", False):
        return _setup_stored(engine, runner)
    why = why_torch_only(engine)
    if why is not None:
        if cfg.decoder not in ("auto", "torch"):
            log.warning("llm.decoder.choice", chosen="torch", reason=f"{cfg.decoder} asked for, but {why}")
        # After quantization: float projections only.
        return StartedRunner(runner, pack_runner(runner, cfg.packed_linear), None, cfg.page_size)
    from dspark.llm.decoding.choose import choose_decoder

    # The packed copies are the torch runner's own: made when it is timed or runs (or asked for with 'on'),
    # not for a start where a compiled decoder wins and the torch runner's weights go.
    packed: list[str] = [pack_runner(runner, cfg.packed_linear)] if cfg.packed_linear != "auto" else []

    def pack_reference(reference: Any) -> None:
        if not packed:
            packed.append(pack_runner(reference, cfg.packed_linear))

    plan = engine.quant_plan
    quant = None
    stored = _stored(engine)
    if plan is not None and not stored:
        from dspark.llm.quantization.apply import spec_for

        quant = {lp.name: spec_for(lp) for lp in plan.layers if lp.precision != "float"}
    runner, choice = choose_decoder(runner, engine.model_path, cfg, host=engine.plugin_host(),
                                    inv=engine.inventory(), quantization=quant, stored=stored,
                                    load_reference=engine.load_torch_runner, prepare_reference=pack_reference)
    page = getattr(runner, "block_size", None) or cfg.page_size
    if getattr(runner, "current", None) is None:  # the torch runner runs the model
        pack_reference(runner)
    from dspark.host import hostinfo

    gc.collect()  # a runner's ops refer to it: the probe's reference (a plan's, read for the probe) is a cycle
    hostinfo.return_freed_memory()  # what was let go: the targets timed, the torch runner's weights if one won
    return StartedRunner(runner, packed[0] if packed else "not packed: a compiled decoder runs the model", choice,
                         page)


def place_other(engine: StartContext, runner: Any, path: Any,
                max_total_tokens: int) -> tuple[Any, DecoderChoice | None]:
    """Another model the engine runs (DeepSpec's draft model), placed as the engine's own decoder was:
    the same setting, plugins, devices and measurements."""
    if why_torch_only(engine) is not None:
        return runner, None
    from dspark.llm.decoding.choose import choose_decoder

    cfg = engine.config.model_copy(update={"max_total_tokens": max_total_tokens})
    return choose_decoder(runner, path, cfg, host=engine.plugin_host(), inv=engine.inventory())


def _setup_stored(engine: StartContext, weightless: Any) -> StartedRunner:
    """A quantized GGUF file started without torch weights: a decoder that runs it as stored holds them once
    (the torch runner stays the fallback, loaded from the file if it must run); if none does, the torch
    runner loads now and the engine starts as usual."""
    from dspark.llm.decoding.choose import choose_decoder
    from dspark.llm.runner.packed_linear import pack_runner

    cfg = engine.config
    runner, choice = choose_decoder(weightless, engine.model_path, cfg, host=engine.plugin_host(),
                                    inv=engine.inventory(), stored=True, load_reference=engine.load_torch_runner)
    if runner is weightless:  # nothing runs the file as stored
        runner = engine.load_torch_runner()
        return StartedRunner(runner, pack_runner(runner, cfg.packed_linear), choice, cfg.page_size)
    return StartedRunner(runner, None, choice, getattr(runner, "block_size", None) or cfg.page_size)
