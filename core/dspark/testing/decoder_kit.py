"""Decoder conformance (plugin API 1.10): tiny checkpoints of every family, specs built from them, the check.

- :data:`FAMILIES` and :func:`tiny_checkpoint`: a small random checkpoint of each
  family dspark loads, written by transformers itself (no downloads), each
  variant turning on what its family adds over Llama: sliding windows shorter
  than the prompts, soft-caps small enough to bite, q/k norms, RoPE scalings,
  partial rotary, layers without RoPE, tied and untied heads.
- :func:`decoder_spec`: the :class:`~dspark.sdk.decoder.DecoderSpec` the engine
  would hand a plugin for a checkpoint (what ``dspark_decoder_bid`` receives).
- :func:`check_decoder`: the engine's probe scenario (two prompts, one in two
  chunks; batched decode; a verified draft and its rollback; a sequence freed
  and another started) on a compiled decoder against the torch runner.
- :func:`engine_tokens`: greedy tokens of a few prompts through the whole engine (batching,
  chunked prefill) on a named decoder, to compare with ``decoder="torch"``.
- :func:`check_decoders`: every family on every device of a plugin. A declined
  bid passes as a skip with its reason; a bid whose decoder does not compile or
  whose logits differ is a failure: a bid is a promise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark.testing.report import CheckResult

if TYPE_CHECKING:
    from dspark.sdk.decoder import CompiledDecoder, DecoderSpec, SequenceDecoder
    from dspark.testing.kit import ConformanceKit

__all__ = ["FAMILIES", "WINDOW", "check_decoder", "check_decoders", "decoder_spec", "engine_tokens", "random_checkpoint",
           "tiny_checkpoint"]

WINDOW = 8  # sliding windows: the check's prompts run past it
TOLERANCE = 1e-3  # float32 logits: rounding only
COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    initializer_range=0.1)
_LONGROPE = dict(rope_type="longrope", short_factor=[1.0, 1.1, 1.3, 1.7], long_factor=[1.5, 2.5, 4.0, 7.0])

# variant -> (transformers class prefix, config overrides).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "llama3": ("Llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                              "rope_theta": 10000.0})),
    "qwen2": ("Qwen2", dict(num_key_value_heads=1)),
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
    # Mistral's window covers every layer.
    "mistral_sliding": ("Mistral", dict(sliding_window=WINDOW)),
    # Dynamic NTK grows past max_position_embeddings; only the runner goes there (the engine stops at it).
    "llama_dynamic": ("Llama", dict(max_position_embeddings=32, rope_parameters={
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})),
}
# The variants :func:`check_decoders` runs: one or two per family (the rest are the loader's tests).
DECODER_VARIANTS = ("llama", "qwen2", "qwen3_sliding_yarn", "smollm3", "phi4_mini", "phi3_longrope", "gemma2",
                    "gemma3", "mistral_sliding")


def random_checkpoint(out: Path, prefix: str, seed: int = 0, **config: Any) -> Path:
    """A transformers ``{prefix}ForCausalLM`` with random weights, saved to ``out``; norm weights and biases
    get noise, so that every norm (Gemma's ``(1 + w)`` too) and bias really acts."""
    import torch
    import transformers

    cfg_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    return out


def tiny_checkpoint(out: Path, variant: str, seed: int = 0, **overrides: Any) -> Path:
    """A random checkpoint of ``variant`` (a key of :data:`FAMILIES`) saved to ``out`` by transformers."""
    prefix, kw = FAMILIES[variant]
    return random_checkpoint(out, prefix, seed, **{**COMMON, **kw, **overrides})


def _runner(path: Path | str, dtype: str) -> Any:
    from dspark.llm.runner.model import ModelRunner

    return ModelRunner.from_pretrained(str(path), dtype)


def decoder_spec(path: Path | str, dtype: str = "float32", *, layers: tuple[int, int] | None = None,
                 max_num_tokens: int = 512, max_num_seqs: int = 256) -> DecoderSpec:
    """The spec the engine hands ``dspark_decoder_bid`` for the checkpoint at ``path`` (float weights)."""
    from dspark.llm.decoding.spec import make_spec

    return make_spec(_runner(path, dtype), Path(path), layers=layers, max_num_tokens=max_num_tokens,
                     max_num_seqs=max_num_seqs)


def check_decoder(decoder: CompiledDecoder | SequenceDecoder, path: Path | str, dtype: str = "float32",
                  seed: int = 0) -> tuple[bool, str]:
    """The probe scenario on ``decoder`` against the torch runner of the checkpoint at ``path``:
    (passed, what was seen). float32 must agree to rounding and on every argmax."""
    from dspark.llm.decoding.conformance import compare

    # Prompts past every variant's window (8-12); the second, prefilled in two chunks, crosses the tiny
    # variants' LongRoPE switch (32) in its second chunk, so the decoder runs both modes and the recompute.
    r = compare(decoder, _runner(path, dtype), seed=seed, prompt_lens=(11, 37), decode_steps=3, draft=4,
                num_blocks=32)
    seen = f"max |logit diff| {r.max_abs_diff:.2e}, {r.argmax_flips}/{r.rows} argmax flips"
    tol, flips = (TOLERANCE, 0) if dtype == "float32" else (1.0, max(1, r.rows // 10))
    return r.max_abs_diff <= tol and r.argmax_flips <= flips, seen


PROMPTS = ([5, 9, 13, 2, 7] * 4, [11, 3, 8], list(range(30, 60)))  # repeats, a short one, one past the windows


def engine_tokens(path: Path | str, decoder: str, *, prompts: tuple[list[int], ...] = PROMPTS, max_tokens: int = 12,
                  plugin_host: Any = None, **engine: Any) -> tuple[list[list[int]], Any]:
    """(greedy tokens of each prompt, the engine) with ``decoder`` ('torch', 'PLUGIN[@DEVICE]') in float32;
    ``engine``: more :class:`~dspark.llm.config.EngineConfig` fields (``max_num_batched_tokens`` for chunks)."""
    from dspark.llm.engine import LLMEngine
    from dspark.llm.sampling import SamplingParams

    engine = {"max_batch_size": 4, **engine}
    e = LLMEngine.from_model(path, dtype="float32", decoder=decoder, plugin_host=plugin_host, **engine)
    for i, p in enumerate(prompts):
        e.add_request(str(i), list(p), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while e.has_unfinished():
        out.update({o.request_id: o.token_ids for o in e.step() if o.finished})
    return [out[str(i)] for i in range(len(prompts))], e


def check_decoders(kit: ConformanceKit, variants: tuple[str, ...] = DECODER_VARIANTS,
                   workdir: Path | None = None) -> list[CheckResult]:
    """Every variant on every device of the kit's plugin: declines are skips, broken promises failures."""
    if not kit.host.implements(kit.name, "dspark_decoder_bid"):
        return [CheckResult("decoder", skipped=True, detail="dspark_decoder_bid not implemented")]
    if not kit.devices:
        return kit._skips("decoder")
    out: list[CheckResult] = []
    root = Path(workdir or tempfile.mkdtemp(prefix="dspark-decoder-kit-"))
    for variant in variants:
        path = root / variant
        if not (path / "config.json").exists():
            tiny_checkpoint(path, variant)
        spec = decoder_spec(path)
        for device in kit.devices:
            label = kit._label(device)
            bid, problem = kit.call("dspark_decoder_bid", decoder=spec, device=device)
            if problem:
                out.append(CheckResult("decoder bid", variant, label, ok=False, detail=problem))
                continue
            if bid is None or bid.declined:
                out.append(CheckResult("decoder", variant, label, skipped=True,
                                       detail=f"declined: {bid.declined}" if bid is not None else "abstained"))
                continue
            compiled, problem = kit.call("dspark_compile_decoder", decoder=spec, device=device)
            if compiled is None:
                out.append(CheckResult("decoder", variant, label, ok=False, detail="bid, then dspark_compile_decoder "
                                       + (f"failed: {problem}" if problem else "returned None (a broken promise)")))
                continue
            try:
                ok, seen = check_decoder(compiled, path)
            except Exception as exc:  # whatever the plugin's decoder raises is a finding
                ok, seen = False, f"{type(exc).__name__}: {exc}"
            out.append(CheckResult("decoder", variant, label, ok=ok, detail=seen))
    return out
