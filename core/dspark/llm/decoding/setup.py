"""The engine's runner at start-up: packed torch weights, then the decoder target (choose.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dspark.host.log import get_logger

if TYPE_CHECKING:
    from dspark.llm.decoding.choose import DecoderChoice
    from dspark.llm.engine import LLMEngine

log = get_logger("dspark.llm.decoder")


def why_torch_only(engine: LLMEngine) -> str | None:
    """Engine settings a compiled whole decoder cannot honour, or None."""
    cfg = engine.config
    if cfg.decoder == "torch":
        return "decoder='torch'"
    if engine.placement is not None:
        return "devices= places the torch runner's layers itself"
    if engine.dense_offload is not None:
        return "dense_offload runs the torch runner's MLP elsewhere"
    return None


def _stored(engine: LLMEngine) -> bool:
    """A quantized GGUF file: only a decoder that runs it as stored may bid (its float weights are not kept)."""
    from dspark.llm.gguf import is_quantized

    return engine.gguf is not None and is_quantized(engine.gguf)


def setup_runner(engine: LLMEngine) -> tuple[Any, DecoderChoice | None, int]:
    """Pack the torch runner, choose the decoder target and set ``engine.runner``; returns the packing
    decision, the choice (None when only torch may run) and the KV page size to use."""
    from dspark.llm.runner.packed_linear import pack_runner

    cfg = engine.config
    if getattr(engine.runner, "is_weightless", False):
        return _setup_stored(engine)
    why = why_torch_only(engine)
    if why is not None:
        if cfg.decoder not in ("auto", "torch"):
            log.warning("llm.decoder.choice", chosen="torch", reason=f"{cfg.decoder} asked for, but {why}")
        return pack_runner(engine.runner, cfg.packed_linear), None, cfg.page_size  # after quantization: float ones only
    from dspark.llm.decoding.choose import choose_decoder

    # The packed copies are the torch runner's own: made when it is timed or runs (or asked for with 'on'),
    # not for a start where a compiled decoder wins and the torch runner's weights go.
    packed: list[str] = [pack_runner(engine.runner, cfg.packed_linear)] if cfg.packed_linear != "auto" else []

    def pack_reference(runner: Any) -> None:
        if not packed:
            packed.append(pack_runner(runner, cfg.packed_linear))

    plan = engine.quant_plan
    quant = None
    stored = _stored(engine)
    if plan is not None and not stored:
        from dspark.llm.quantization.apply import spec_for

        quant = {lp.name: spec_for(lp) for lp in plan.layers if lp.precision != "float"}
    engine.runner, choice = choose_decoder(engine.runner, engine.model_path, cfg, host=engine.plugin_host,
                                           inv=engine.inventory, quantization=quant, stored=stored,
                                           load_reference=engine.load_torch_runner, prepare_reference=pack_reference)
    page = getattr(engine.runner, "block_size", None) or cfg.page_size
    if getattr(engine.runner, "current", None) is None:  # the torch runner runs the model
        pack_reference(engine.runner)
    from dspark.host import hostinfo

    hostinfo.return_freed_memory()  # what was let go: the targets timed, the torch runner's weights if one won
    return packed[0] if packed else "not packed: a compiled decoder runs the model", choice, page


def place_other(engine: LLMEngine, runner: Any, path: Any, max_total_tokens: int) -> tuple[Any, DecoderChoice | None]:
    """Another model the engine runs (DeepSpec's draft model), placed as the engine's own decoder was:
    the same setting, plugins, devices and measurements."""
    if why_torch_only(engine) is not None:
        return runner, None
    from dspark.llm.decoding.choose import choose_decoder

    cfg = engine.config.model_copy(update={"max_total_tokens": max_total_tokens})
    return choose_decoder(runner, path, cfg, host=engine.plugin_host, inv=engine.inventory)


def _setup_stored(engine: LLMEngine) -> tuple[Any, DecoderChoice | None, int]:
    """A quantized GGUF file started without torch weights: a decoder that runs it as stored holds them once
    (the torch runner stays the fallback, loaded from the file if it must run); if none does, the torch
    runner loads now and the engine starts as usual."""
    from dspark.llm.decoding.choose import choose_decoder
    from dspark.llm.runner.packed_linear import pack_runner

    cfg = engine.config
    runner, choice = choose_decoder(engine.runner, engine.model_path, cfg, host=engine.plugin_host,
                                    inv=engine.inventory, stored=True, load_reference=engine.load_torch_runner)
    if runner is engine.runner:  # nothing runs the file as stored
        engine.runner = engine.load_torch_runner()
        return pack_runner(engine.runner, cfg.packed_linear), choice, cfg.page_size
    engine.runner = runner
    return None, choice, getattr(runner, "block_size", None) or cfg.page_size
