"""Tiny random checkpoints of every supported family, written by transformers itself (no downloads).

Each variant turns on what its family adds over Llama: sliding windows far
shorter than the prompts, soft-caps small enough to bite, q/k norms, RoPE
scalings, tied and untied heads. Norm weights get noise, so that Gemma's
(1 + w) and every q/k norm really scale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from llm_testutil import VOCAB, train_tokenizer

WINDOW = 8  # sliding windows: prompts run up to 60 tokens
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              initializer_range=0.1)
_LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.7], long_factor=[1.5, 2.5, 4.0, 7.0])

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen3: head_dim unlike hidden / heads, q/k norms; a sliding layer past max_window_layers; YaRN.
    "qwen3": ("Qwen3", dict(head_dim=32, attention_bias=True)),
    "qwen3_sliding_yarn": ("Qwen3", dict(head_dim=32, use_sliding_window=True, sliding_window=WINDOW,
                                         max_window_layers=1, tie_word_embeddings=True,
                                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                          "original_max_position_embeddings": 32})),
    # SmolLM3: every second layer without RoPE, those layers sliding.
    "smollm3": ("SmolLM3", dict(num_hidden_layers=4, no_rope_layer_interval=2, use_sliding_window=True,
                                sliding_window=WINDOW, rope_parameters={"rope_type": "default",
                                                                        "rope_theta": 10000.0})),
    # Phi-3: fused qkv_proj / gate_up_proj, LongRoPE past 32 positions, partial rotary (Phi-4-mini), a window.
    "phi3_longrope": ("Phi3", dict(original_max_position_embeddings=32, partial_rotary_factor=0.5,
                                   sliding_window=12, rope_parameters={**_LONGROPE, "rope_theta": 10000.0,
                                                                       "partial_rotary_factor": 0.5})),
    "phi4_mini": ("Phi3", dict(tie_word_embeddings=True, partial_rotary_factor=0.75, num_key_value_heads=1,
                               head_dim=16, hidden_size=64, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 10000.0,
                                                                             "partial_rotary_factor": 0.75})),
    # Gemma 2: alternating sliding / global layers, soft-capped attention and logits, query_pre_attn_scalar.
    "gemma2": ("Gemma2", dict(head_dim=16, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # Gemma 3: q/k norms, a local RoPE base for sliding layers, linear scaling on the global ones, untied head.
    "gemma3": ("Gemma3Text", dict(head_dim=16, num_hidden_layers=3, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  tie_word_embeddings=False, query_pre_attn_scalar=16,
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1_000_000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10_000.0}})),
    # Mistral's window covers every layer (it used to cap max_model_len instead).
    "mistral_sliding": ("Mistral", dict(sliding_window=WINDOW)),
    # Dynamic NTK grows past max_position_embeddings; only the runner goes there (the engine stops at it).
    "llama_dynamic": ("Llama", dict(max_position_embeddings=32, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
}


def make_family_checkpoint(out: Path, variant: str, seed: int = 0) -> Path:
    import transformers

    prefix, kw = FAMILIES[variant]
    cfg_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**COMMON, **kw})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    train_tokenizer(out)
    return out
