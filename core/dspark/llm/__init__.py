"""LLM serving: checkpoint loading, paged KV cache, our own runner, continuous batching.

Names are imported lazily so that ``dspark.llm.config`` (validated by the
server before anything else) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dspark.llm.api import LLM, AsyncLLMEngine, default_model_path, optimize_model
    from dspark.llm.config import EngineConfig
    from dspark.llm.engine import EngineStats, LLMEngine, RequestOutput, Usage
    from dspark.llm.runner.kv_cache import PageAllocator, PagedKVCache
    from dspark.llm.runner.loader import CheckpointError, ModelConfig, load_checkpoint
    from dspark.llm.runner.model import ModelRunner, SeqChunk
    from dspark.llm.logits import TokenLogprobs
    from dspark.llm.sampling import GuidedSpec, SamplingParams

_WHERE = {
    "LLM": "api", "AsyncLLMEngine": "api", "default_model_path": "api", "optimize_model": "api", "EngineConfig": "config",
    "EngineStats": "engine", "LLMEngine": "engine", "RequestOutput": "engine", "Usage": "engine",
    "PageAllocator": "runner.kv_cache", "PagedKVCache": "runner.kv_cache", "CheckpointError": "runner.loader",
    "ModelConfig": "runner.loader", "load_checkpoint": "runner.loader", "ModelRunner": "runner.model", "SeqChunk": "runner.model",
    "SamplingParams": "sampling", "GuidedSpec": "sampling", "TokenLogprobs": "logits",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"dspark.llm.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dspark.llm' has no attribute {name!r}")
