"""The runner's shared types: a checkpoint's config as the runner reads it (and the tensors it implies),
and what one sequence runs in a step.

A leaf of :mod:`dspark.llm.runner` (it imports only the family names): the
loader, the families, attention, RoPE and the model all read these types
without importing each other for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from dspark.llm.runner.families import SLIDING

__all__ = ["ModelConfig", "SeqChunk", "StepObservers", "Work", "expected_shapes"]


@dataclass
class SeqChunk:
    """New tokens of one sequence to run this step; their K/V land after the cached ones."""

    seq_id: str
    token_ids: list[int]
    all_logits: bool = False  # logits for every position (speculative verification), not just the last
    # With all_logits: return the final-normed hidden rows [n, hidden] instead of logits; the caller
    # runs ``ModelRunner.head`` on the rows it needs (greedy verification stops at the first mismatch).
    hidden_only: bool = False
    # The sequence's prompt length where known: RoPE that changes with the context (LongRoPE, dynamic NTK)
    # takes a prompt row's context as the whole prompt, as transformers' one-shot prefill does.
    prompt_len: int | None = None


Work = Literal["forward", "draft", "mlp"]


@dataclass
class StepObservers:
    """Who is told how long a runner's work took, as ``fn(work, seconds)``: ``"forward"`` (a whole-model
    step), ``"draft"`` (an early-exit step, for self-drafting) or ``"mlp"`` (one offloaded MLP call that a
    plugin ran). The server's metrics subscribe through ``LLMEngine.observe``; with no one subscribed a
    runner times nothing."""

    callbacks: list[Callable[[Work, float], None]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def add(self, fn: Callable[[Work, float], None]) -> None:
        self.callbacks.append(fn)

    @contextmanager
    def timed(self, work: Work) -> Iterator[None]:
        """Report the time the ``with`` body takes (also when it raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.report(work, time.perf_counter() - t0)

    def report(self, work: Work, seconds: float, times: int = 1) -> None:
        """Report ``times`` pieces of work of ``seconds`` in all (a greedy run's steps: each its share)."""
        for _ in range(times):
            for fn in self.callbacks:
                fn(work, seconds / times)


class ModelConfig(BaseModel):
    """The subset of a Hugging Face config the runner needs, normalised across families and versions
    (dspark.llm.runner.families says what each family's fields mean)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases
    o_bias: bool = False
    sliding_window: int | None = None  # the window of the layers whose layer_types entry is sliding_attention
    layer_types: tuple[str, ...] = ()  # per layer: full_attention or sliding_attention
    rope_layers: tuple[bool, ...] = ()  # per layer: whether RoPE applies (SmolLM3 leaves some without)
    local_rope: dict[str, Any] | None = None  # Gemma 3: the sliding layers' own RoPE (rope_type, rope_theta, ...)
    partial_rotary_factor: float = 1.0  # the share of head_dim that RoPE rotates (Phi-4-mini: 0.75)
    hidden_act: str = "silu"
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    # Gemma 2/3: (1 + w) RMSNorms, sqrt(hidden) embedding scale, norms on the attention and MLP outputs.
    gemma: bool = False
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 instead of head_dim ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    fused_projections: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused (Phi-3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (it attends to its last this-many positions), None = full."""
        if self.sliding_window is None or not self.layer_types or self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the runner reads, by its Hugging Face name, with its shape."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   a + "o_proj.weight": (h, q), p + "mlp.down_proj.weight": (h, i)}
        if cfg.fused_projections:
            shapes |= {a + "qkv_proj.weight": (q + 2 * kv, h), p + "mlp.gate_up_proj.weight": (2 * i, h)}
        else:
            shapes |= {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h)}
        if cfg.attention_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if cfg.o_bias:
            shapes[a + "o_proj.bias"] = (h,)
        if cfg.qk_norm:
            shapes |= {a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
        if cfg.gemma:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
    return shapes
