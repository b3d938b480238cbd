"""The engine's build (dspark.llm.assembly): build_parts makes the parts, LLMEngine(parts) only assembles them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.llm.assembly import Devices, build_parts
from dspark.llm.engine import LLMEngine
from dspark.llm.sampling import SamplingParams


def _greedy_tokens(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    engine.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out = None
    for _ in range(4 * n + 8):  # a bound, not a clock: each step moves the one request by a token at least
        for o in engine.step():
            out = o
        if not engine.has_unfinished():
            break
    assert out is not None and out.finished
    return list(out.token_ids)


def test_the_engine_assembles_what_the_build_made(checkpoint: Callable[[str], Path]) -> None:
    parts = build_parts(checkpoint("llama"), dtype="float32", decoder="torch", max_total_tokens=256)
    assert parts.config.max_total_tokens == 256 and parts.config.max_model_len is not None
    engine = LLMEngine(parts)
    assert engine.runner is parts.runner and engine.cache is parts.cache and engine.inputs is parts.inputs
    assert engine.cache.allocator.num_pages * engine.cache.page_size >= 256
    built = LLMEngine.from_model(checkpoint("llama"), dtype="float32", decoder="torch", max_total_tokens=256)
    assert _greedy_tokens(engine, [5, 6, 7, 8], 6) == _greedy_tokens(built, [5, 6, 7, 8], 6)
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_pages  # all pages back


def test_the_build_uses_the_callers_plugin_host_and_probes_once() -> None:
    host = PluginHost(PluginSettings(autoload=False)).load()
    devices = Devices(host)
    assert devices.host is host
    inv = devices.inventory
    assert devices.inventory is inv and [d.id for d in inv.devices] == ["cpu"]  # torch's CPU alone: no autoload


def test_the_build_names_bad_settings(checkpoint: Callable[[str], Path]) -> None:
    from dspark.llm.config import EngineConfig

    with pytest.raises(TypeError, match="config= or engine keyword arguments"):
        build_parts(checkpoint("llama"), config=EngineConfig(), max_batch_size=2)
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds the model's max_position_embeddings"):
        build_parts(checkpoint("llama"), dtype="float32", decoder="torch", max_model_len=100_000)
