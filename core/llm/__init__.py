"""LLM serving: checkpoint loading, paged KV cache, our own runner, continuous batching."""

from __future__ import annotations

from dspark.llm.api import LLM, AsyncLLMEngine, default_model_path
from dspark.llm.config import EngineConfig
from dspark.llm.engine import EngineStats, LLMEngine, RequestOutput, Usage
from dspark.llm.kv_cache import PagedKVCache, PageAllocator
from dspark.llm.loader import CheckpointError, ModelConfig, load_checkpoint
from dspark.llm.model import ModelRunner, SeqChunk
from dspark.llm.sampling import SamplingParams

__all__ = [
    "LLM", "AsyncLLMEngine", "CheckpointError", "EngineConfig", "EngineStats", "LLMEngine", "ModelConfig",
    "ModelRunner", "PageAllocator", "PagedKVCache", "RequestOutput", "SamplingParams", "SeqChunk", "Usage",
    "default_model_path", "load_checkpoint",
]
