"""What an engine is assembled from, built in order: the model loaded, quantized, its layers placed, its
decoder chosen, the KV cache sized, the tokenizer, and the speculative decoder when on.

:func:`build_parts` does the work ``LLMEngine.from_model`` asks for; ``LLMEngine(parts)`` only assembles
(vLLM's ``EngineCore`` gets its executor the same way). The plugin host and the device inventory are made
on first need (:class:`Devices`), so a start that runs the torch runner alone never loads plugins.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dspark.host import hook_threads, progress
from dspark.llm.config import EngineConfig
from dspark.llm.gguf import load_runner
from dspark.llm.inputs import InputProcessor
from dspark.llm.runner.loader import load_config

if TYPE_CHECKING:
    from dspark.host.inventory import Inventory
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.decoding.setup import StartContext
    from dspark.llm.runner.kv_cache import PagedKVCache
    from dspark.llm.speculative.decoder import SpecDecoder

__all__ = ["Devices", "EngineParts", "build_parts"]


class Devices:
    """The engine's one plugin host (the caller's, or every installed plugin) and its device inventory, each
    made on first need; one of each serves placement, quantization, dense offload, decoders and drafters."""

    def __init__(self, host: PluginHost | None = None) -> None:
        self._host, self._inventory = host, None

    @property
    def host(self) -> PluginHost:
        if self._host is None:
            from dspark.host.plugin_manager import PluginHost

            self._host = PluginHost().load()
        return self._host

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            from dspark.host.inventory import probe

            self._inventory = probe(self.host)
        return self._inventory


@dataclass
class EngineParts:
    """Everything :class:`~dspark.llm.engine.LLMEngine` holds besides its requests. ``config`` has
    ``max_model_len`` and ``max_total_tokens`` resolved; ``runner`` is the model executor (the torch
    runner or a plugin's decoder), ``cache`` its paged KV cache."""

    model_path: Path
    config: EngineConfig
    runner: Any
    cache: PagedKVCache
    tokenizer: Any
    inputs: InputProcessor
    devices: Devices
    gguf: Any = None  # dspark.llm.gguf.GGUFModel for a GGUF file
    device_map: Any = None  # dspark.llm.device_map.DeviceMap when config.devices spread the torch runner's layers
    quant_plan: Any = None  # dspark.llm.quantization.QuantPlan when the model runs quantized
    # Who runs each quantized projection (KernelChoice); the build's own list, so a torch runner loaded
    # later (a quantized GGUF file's deferred weights) adds its kernels here too.
    quant_kernels: list[Any] = field(default_factory=list)
    dense_offload: Any = None
    dense_offload_decision: Any = None
    packed_linear: Any = None
    decoder_choice: Any = None  # dspark.llm.decoding.choose.DecoderChoice, None when only torch may run
    spec: SpecDecoder | None = None
    # The sampling generator of requests without a seed, shared with the speculative decoder.
    default_gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    load_seconds: float = 0.0


def _check_max_len(max_model_len: int, max_pos: int) -> None:
    if max_model_len > max_pos:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {max_pos}")


def _load_tokenizer(root: Path) -> Any:
    from tokenizers import Tokenizer

    f = root / "tokenizer.json"
    return Tokenizer.from_file(str(f)) if f.exists() else None


class _Builder:
    """One engine's build; it stays alive behind two callables the parts keep: loading the torch runner's
    weights for a start that deferred them, and placing another model's decoder (the draft model)."""

    def __init__(self, model: Path, dtype: str | torch.dtype, cfg: EngineConfig, devices: Devices) -> None:
        self.model_path, self.cfg, self.devices = model, cfg, devices
        self.device_map: Any = None
        self.quant_plan: Any = None
        self.quant_kernels: list[Any] = []
        self.dense_offload: Any = None
        self.dense_offload_decision: Any = None
        self.built: EngineParts | None = None  # the parts, once made: a later torch load updates them
        if cfg.max_model_len is not None and (model / "config.json").exists():  # before loading
            _check_max_len(cfg.max_model_len, load_config(model).max_position_embeddings)
        # A quantized GGUF file starts without the torch runner's copy of its weights: a decoder that runs the
        # file as stored (decoding/setup.py) then holds them once; the torch runner loads only if it must run.
        plugins_may_run = cfg.decoder != "torch" and cfg.devices is None and cfg.dense_offload == "off"
        progress.step(f"reading {model.name}")
        self.runner, self.gguf = load_runner(model, dtype, weightless_if_quantized=plugins_may_run)

    def parts(self, t_start: float) -> EngineParts:
        cfg, mcfg = self.cfg, self.runner.cfg
        if cfg.max_model_len is not None:
            _check_max_len(cfg.max_model_len, mcfg.max_position_embeddings)
        max_len = cfg.max_model_len or mcfg.max_position_embeddings  # sliding windows are the runner's to honour
        total = cfg.max_total_tokens or max(8192, max_len)
        self.cfg = cfg = cfg.model_copy(update={"max_model_len": max_len, "max_total_tokens": total})
        num_pages = -(-total // cfg.page_size)
        if cfg.devices is not None:  # before the cache: each layer's KV pages go where the layer runs
            from dspark.llm.device_map.torch_layers import place_engine

            auto = cfg.devices == "auto"  # else a device profile: planning only, by its own bidders
            self.device_map = place_engine(self.runner, cfg.devices, host=self.devices.host if auto else None,
                                          inv=self.devices.inventory if auto else None, max_model_len=max_len,
                                          max_total_tokens=num_pages * cfg.page_size,
                                          decode_batch=min(cfg.max_batch_size, 8),
                                          prefill_chunk=min(cfg.max_num_batched_tokens, 128))
        self._quantize(self.runner)
        if cfg.dense_offload != "off":
            from dspark.llm.device_map.offload import setup_dense_offload

            devs = None if self.device_map is None else [p.device_id for p in self.device_map.layers]
            self.dense_offload, self.dense_offload_decision = setup_dense_offload(
                self.runner, cfg.dense_offload, layer_devices=devs, host=self.devices.host,
                inv=self.devices.inventory)
        from dspark.llm.decoding.setup import setup_runner

        progress.step("asking the plugins for a decoder")
        started = setup_runner(self.start_context(), self.runner)  # what runs the decoder, and why
        runner = started.runner
        cache = runner.make_cache(-(-total // started.page_size), started.page_size)
        tokenizer = self.gguf.tokenizer if self.gguf is not None else _load_tokenizer(self.model_path)
        eos_ids = frozenset(mcfg.eos_token_ids)
        inputs = InputProcessor(tokenizer=tokenizer, vocab_size=mcfg.vocab_size, bos_token_id=mcfg.bos_token_id,
                                eos_ids=eos_ids, max_model_len=max_len,
                                kv_tokens=cache.allocator.num_pages * cache.page_size)
        default_gen = torch.Generator().manual_seed(0)
        spec = None
        if cfg.speculative.active:
            from dspark.llm.speculative.decoder import SpecDecoder

            spec = SpecDecoder(cfg.speculative, runner=runner, cache=cache, model_path=self.model_path,
                               max_model_len=max_len, max_batch_size=cfg.max_batch_size, eos_ids=set(eos_ids),
                               default_gen=default_gen, host=self.devices.host, place_decoder=self.place_decoder)
        # Threads the build's plugin calls left behind (a probe's torch benchmark leaves an OpenMP team on its
        # worker) would slow the steps from here on: see dspark.host.hook_threads.
        hook_threads.retire_idle()
        self.built = EngineParts(
            model_path=self.model_path, config=cfg, runner=runner, cache=cache, tokenizer=tokenizer, inputs=inputs,
            devices=self.devices, gguf=self.gguf, device_map=self.device_map, quant_plan=self.quant_plan,
            quant_kernels=self.quant_kernels, dense_offload=self.dense_offload,
            dense_offload_decision=self.dense_offload_decision, packed_linear=started.packed_linear,
            decoder_choice=started.choice, spec=spec, default_gen=default_gen,
            load_seconds=time.perf_counter() - t_start)
        return self.built

    def start_context(self) -> StartContext:
        from dspark.llm.decoding.setup import StartContext

        return StartContext(config=self.cfg, model_path=self.model_path, gguf=self.gguf,
                            quant_plan=self.quant_plan, device_map=self.device_map, dense_offload=self.dense_offload,
                            plugin_host=lambda: self.devices.host, inventory=lambda: self.devices.inventory,
                            load_torch_runner=self.load_torch_runner)

    def place_decoder(self, runner: Any, path: Path, max_total_tokens: int) -> tuple[Any, Any]:
        """(runner, choice) for another model the engine runs (the draft model), placed as its own decoder."""
        from dspark.llm.decoding.setup import place_other

        return place_other(self.start_context(), runner, path, max_total_tokens)

    def load_torch_runner(self) -> Any:
        """The torch runner with its weights, for a start that deferred them (a quantized GGUF file): the
        file's tensors read now, its Q8_0 blocks on the int8 kernels."""
        runner, self.gguf = load_runner(self.model_path, self.runner.dtype)
        self._quantize(runner)
        if self.built is not None:  # a failover after the start: the engine reads its parts
            self.built.gguf, self.built.quant_plan = self.gguf, self.quant_plan
        return runner

    def _quantize(self, runner: Any) -> None:
        from dspark.llm.runner.loader import PLAN_FILE, is_optimized

        cfg = self.cfg
        if getattr(runner, "is_weightless", False):
            return  # nothing to quantize yet: load_torch_runner() quantizes what it loads
        qc = cfg.quantization
        speed = None if qc is None else qc.speed_first
        if self.gguf is not None:  # a GGUF file runs as its types say: Q8_0 on the int8 kernels (dspark.llm.gguf)
            if qc is not None and qc.enabled:
                raise ValueError(f"quantization: {self.model_path} is a GGUF file, run as its types say; "
                                 "`dspark convert --quantization ...` it to plan another precision")
            plan, speed = self.gguf.plan, False  # int8 even where float bids faster: the file's size is the point
            if plan is None or not self.gguf.int8_layers or cfg.dense_offload != "off":  # offloaded MLP: float
                return
        elif is_optimized(self.model_path):
            if qc is not None and qc.enabled:
                raise ValueError(f"quantization: {self.model_path} is already an optimized directory (its plan is "
                                 f"{PLAN_FILE}); quantize the original checkpoint instead")
            from dspark.llm.quantization import QuantPlan

            plan = QuantPlan.read(self.model_path / PLAN_FILE)
        elif qc is not None and qc.enabled:
            from dspark.llm.quantization.sensitivity import build_plan

            # A reload (a failover to the torch runner after it let go) applies the plan the start measured.
            plan = self.quant_plan or build_plan(runner, self.model_path, qc)
        else:
            return
        if cfg.dense_offload != "off":
            raise ValueError("dense_offload and quantization cannot be combined: the offloaded MLP runs float weights")
        from dspark.llm.quantization.apply import apply_plan

        self.quant_plan = plan
        self.quant_kernels[:] = apply_plan(runner, plan, speed_first=speed, host=self.devices.host,
                                        inv=self.devices.inventory)


def build_parts(model: str | Path, *, dtype: str | torch.dtype = "auto", config: EngineConfig | None = None,
                plugin_host: PluginHost | None = None, **config_kw: Any) -> EngineParts:
    """Load, quantize and place ``model`` and choose what runs it, as ``config`` (or the engine keyword
    arguments) says; ``plugin_host``: the plugins to use, by default every installed one, loaded on first
    need."""
    if config is not None and config_kw:
        raise TypeError("pass either config= or engine keyword arguments, not both")
    t_start = time.perf_counter()
    cfg = config or EngineConfig(**config_kw)
    from dspark.llm.gguf.metadata import shared_readers

    with shared_readers():
        return _Builder(Path(model), dtype, cfg, Devices(plugin_host)).parts(t_start)
