"""A Hugging Face Llama checkpoint as a GGUF file llama.cpp loads, written from the engine's own weights.

The tensors are named, permuted and typed as llama.cpp's convert_hf_to_gguf.py writes them (q/k rows
interleaved for its RoPE, norms in F32, matrices in the engine's dtype) and the byte-level BPE
tokenizer goes in as the "gpt2" model. Only what llama.cpp's ``llama`` architecture computes the same
way is written; anything else is declined with the reason (:func:`why_not`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from dspark.sdk.decoder import DecoderSpec


def _config(spec: DecoderSpec) -> dict[str, Any]:
    p = Path(spec.path)
    f = p / "config.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def why_not(spec: DecoderSpec) -> str | None:
    """Why this checkpoint cannot be written as a llama.cpp ``llama`` GGUF, or None."""
    p = Path(spec.path)
    if not (p / "config.json").is_file():
        return f"{p} is neither a GGUF file nor a checkpoint directory with a config.json"
    if not (p / "tokenizer.json").is_file():
        return f"{p} has no tokenizer.json to write into the GGUF file"
    tok = json.loads((p / "tokenizer.json").read_text())
    if tok.get("model", {}).get("type") != "BPE":
        return f"its tokenizer is {tok.get('model', {}).get('type')!r}, only byte-level BPE is written here"
    if spec.architecture not in ("llama", "mistral"):
        return f"architecture {spec.architecture!r} is not written as a GGUF here (llama only)"
    why = spec.unsupported(set())
    if why:
        return why
    cfg = _config(spec)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        return f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not written here"
    if spec.quantization:
        return "a quantization plan: llama.cpp runs a GGUF file's own types (quantize the GGUF with llama.cpp)"
    if spec.dtype not in ("float32", "bfloat16", "float16"):
        return f"dtype {spec.dtype} has no GGUF type here"
    return None


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: q/k rows interleaved for its RoPE (HF rotates halves)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(spec: DecoderSpec, out: Path) -> Path:
    """Write ``spec`` (a checkpoint :func:`why_not` accepted) to ``out``, atomically."""
    import gguf
    from gguf import quants

    cfg = _config(spec)
    tok = json.loads((Path(spec.path) / "tokenizer.json").read_text())
    kind = {"float32": gguf.GGMLQuantizationType.F32, "bfloat16": gguf.GGMLQuantizationType.BF16,
            "float16": gguf.GGMLQuantizationType.F16}[spec.dtype]
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name(spec.name)
    w.add_context_length(spec.max_position_embeddings)
    w.add_embedding_length(spec.hidden_size)
    w.add_block_count(spec.num_layers)
    w.add_feed_forward_length(spec.intermediate_size)
    w.add_head_count(spec.num_heads)
    w.add_head_count_kv(spec.num_kv_heads)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.head_dim)
    w.add_layer_norm_rms_eps(spec.rms_norm_eps)
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_vocab_size(spec.vocab_size)
    w.add_file_type({"float32": 0, "float16": 1, "bfloat16": 32}[spec.dtype])
    # The tokenizer, as convert_hf_to_gguf writes a byte-level BPE one (padded to the model's vocabulary).
    vocab = dict(tok["model"]["vocab"])
    for t in tok.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    special = {t["id"] for t in tok.get("added_tokens", []) if t.get("special")}
    by_id = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(spec.vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])])
    for key, fn in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        v = cfg.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            fn(int(v))
    w.add_add_bos_token(False)

    def mat(name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        elif kind == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(a, kind), raw_dtype=kind)

    def vec(name: str, a: np.ndarray) -> None:
        w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))

    wt = spec.weights()
    H, K, D, inter = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    mat("token_embd.weight", wt.embed)
    vec("output_norm.weight", wt.norm)
    if not np.array_equal(wt.head.T, wt.embed):  # tied: llama.cpp reads token_embd for the output
        mat("output.weight", wt.head.T)
    for i, L in enumerate(wt.layers):
        b = f"blk.{i}"
        vec(f"{b}.attn_norm.weight", L.in_norm)
        vec(f"{b}.ffn_norm.weight", L.post_norm)
        mat(f"{b}.attn_q.weight", _permute(L.qkv[:, : H * D].T, H))
        mat(f"{b}.attn_k.weight", _permute(L.qkv[:, H * D : (H + K) * D].T, K))
        mat(f"{b}.attn_v.weight", L.qkv[:, (H + K) * D :].T)
        mat(f"{b}.attn_output.weight", L.o.T)
        mat(f"{b}.ffn_gate.weight", L.gate_up[:, :inter].T)
        mat(f"{b}.ffn_up.weight", L.gate_up[:, inter:].T)
        mat(f"{b}.ffn_down.weight", L.down.T)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out
