"""Checkpoint families: what each Hugging Face ``model_type`` means for the runner.

:func:`normalise` turns a family's config.json (transformers 4.x or 5.x layout)
into the one set of fields the runner reads: which layers slide and how far,
which RoPE each layer uses, the norms and caps around attention. Defaults are
transformers' own for fields a config leaves out, so a checkpoint means the same
here as under ``AutoModelForCausalLM``. What the fields then mean for the
tensors a checkpoint holds is :func:`dspark.llm.runner.types.expected_shapes`.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu")
FULL, SLIDING = "full_attention", "sliding_attention"
GEMMA = ("gemma2", "gemma3_text")

# transformers' defaults where a family's differ from the runner's (ModelConfig's) and a config may omit them.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "tie_word_embeddings": True},
    "gemma3_text": {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
                    "sliding_window": 4096, "tie_word_embeddings": True},
    "phi3": {"rms_norm_eps": 1e-5},
    "smollm3": {"tie_word_embeddings": True, "rope_theta": 2_000_000.0},
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or field."""


def _rope(d: dict[str, Any], params: dict[str, Any] | None, theta: float, source: str) -> dict[str, Any]:
    """One RoPE's parameters, flat: rope_type, rope_theta and the scaling's own keys."""
    p = dict(params or {})
    legacy = p.pop("type", None)  # transformers 4.x's name; rope_type wins where both are set
    p["rope_type"] = str(p.get("rope_type") or legacy or "default")
    p.setdefault("rope_theta", theta)
    if p["rope_theta"] is None:
        p["rope_theta"] = theta
    if p["rope_type"] in ("llama3", "yarn", "longrope"):
        # As transformers' standardize_rope_params: a top-level value (Phi-3 keeps it there) wins.
        top = d.get("original_max_position_embeddings")
        p["original_max_position_embeddings"] = top or p.get("original_max_position_embeddings") \
            or d.get("max_position_embeddings")
    if p["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(f"{source}: rope scaling type {p['rope_type']!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return p


def _ropes(mt: str, d: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the RoPE of full-attention layers, Gemma 3's separate one for sliding layers or None)."""
    rp = d.get("rope_parameters")
    theta = d.get("rope_theta") or 10000.0
    if mt == "gemma3_text":
        # transformers 5 nests one dict per layer type; 4.x has rope_theta (global), rope_local_base_freq and a
        # rope_scaling that applies to the global layers only.
        nested = rp if isinstance(rp, dict) and (FULL in rp or SLIDING in rp) else {}
        full = nested.get(FULL) or d.get("rope_scaling") or {}
        local = nested.get(SLIDING) or {}
        return (_rope(d, full, d.get("rope_theta") or 1_000_000.0, source),
                _rope(d, local, d.get("rope_local_base_freq") or 10_000.0, source))
    params = dict(rp if isinstance(rp, dict) and rp else d.get("rope_scaling") or {})
    if mt == "phi3" and (params.get("rope_type") or params.get("type")) in ("su", "yarn"):
        params["rope_type"] = "longrope"  # Phi3Config's own renaming: its "su" and "yarn" are LongRoPE
    return _rope(d, params, theta, source), None


def _layer_types(mt: str, d: dict[str, Any], n: int, source: str) -> tuple[list[str], int | None, list[bool]]:
    """(per layer full/sliding, the sliding window or None, per layer whether RoPE applies)."""
    window = d.get("sliding_window")
    given = d.get("layer_types")
    rope_on = [True] * n
    if mt == "llama":
        window, given = None, None
    elif mt in ("mistral", "phi3"):
        given = [SLIDING if window else FULL] * n  # one mask for every layer, as their models build it
    elif mt in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            window = None
        if given is None:
            start = d.get("max_window_layers", 28)
            given = [SLIDING if window is not None and i >= start else FULL for i in range(n)]
    elif mt == "gemma2" and given is None:
        given = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    elif mt == "gemma3_text" and given is None:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        given = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    elif mt == "smollm3":
        nope = d.get("no_rope_layers")
        if nope is None:
            every = int(d.get("no_rope_layer_interval", 4))
            nope = [int((i + 1) % every != 0) for i in range(n)]
        if len(nope) != n:
            raise CheckpointError(f"{source}: no_rope_layers has {len(nope)} entries for {n} layers")
        rope_on = [bool(x) for x in nope]
        if not d.get("use_sliding_window", False):
            window = None
        if given is None:
            given = [SLIDING if window is not None and not rope_on[i] else FULL for i in range(n)]
    given = list(given or [FULL] * n)
    if len(given) != n:
        raise CheckpointError(f"{source}: layer_types has {len(given)} entries for {n} layers")
    odd = sorted({t for t in given if t not in (FULL, SLIDING)})
    if odd:
        raise CheckpointError(f"{source}: layer_types {odd} are not supported; supported: {FULL}, {SLIDING}")
    if window is not None and int(window) <= 0:
        raise CheckpointError(f"{source}: sliding_window must be positive, got {window}")
    return given, None if window is None else int(window), rope_on


def normalise(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A family's config.json as the fields of ModelConfig (not yet validated)."""
    mt = raw.get("model_type")
    if mt == "gemma3":
        raise CheckpointError(f"{source}: model_type 'gemma3' is the multimodal Gemma 3 (image and text); only its "
                              "text model loads here: a Gemma3ForCausalLM checkpoint, model_type 'gemma3_text'")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{source}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    d = {**_DEFAULTS.get(str(mt), {}), **raw}
    if d.get("num_key_value_heads") is None:
        d["num_key_value_heads"] = d.get("num_attention_heads")
    if d.get("head_dim") is None and d.get("hidden_size") and d.get("num_attention_heads"):
        d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    full, local = _ropes(mt, d, source)
    d["rope_theta"] = full["rope_theta"]
    d["rope_scaling"] = {k: v for k, v in full.items() if k != "rope_theta"}
    d["local_rope"] = local
    d["partial_rotary_factor"] = float(full.get("partial_rotary_factor") or d.get("partial_rotary_factor") or 1.0)
    n = int(d.get("num_hidden_layers") or 0)
    types, window, rope_on = _layer_types(mt, d, n, source)
    d["layer_types"], d["sliding_window"], d["rope_layers"] = tuple(types), window, tuple(rope_on)
    if d.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias is true; {mt} MLPs with biases are not supported")
    if d.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention is true (an encoder); only causal decoders "
                              "are supported")
    act = d.get("hidden_activation") if mt in GEMMA else d.get("hidden_act")
    d["hidden_act"] = act or ("gelu_pytorch_tanh" if mt in GEMMA else "silu")
    if d["hidden_act"] not in ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden activation {d['hidden_act']!r} is not supported; "
                              f"supported: {', '.join(ACTIVATIONS)}")
    # Biases: Qwen2 always has q/k/v biases and never an o_proj one; Mistral and Phi-3 have none; the rest
    # put attention_bias on all four projections.
    if mt == "qwen2":
        d["attention_bias"], d["o_bias"] = True, False
    elif mt in ("mistral", "phi3"):
        d["attention_bias"], d["o_bias"] = False, False
    else:
        d["o_bias"] = bool(d.get("attention_bias", False))
    d["qk_norm"] = mt in ("qwen3", "gemma3_text")
    d["gemma"] = mt in GEMMA
    d["fused_projections"] = mt == "phi3"
    if mt not in GEMMA:
        d["query_pre_attn_scalar"] = None
        d["attn_logit_softcapping"] = d["final_logit_softcapping"] = None
    elif mt == "gemma3_text":
        d["attn_logit_softcapping"] = None  # Gemma 3's attention never applies it, whatever the config says
    return d
