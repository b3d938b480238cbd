"""GGUF files written here from tiny transformers checkpoints, with the ``gguf`` package's GGUFWriter.

The tensors are named, permuted and typed as llama.cpp's convert_hf_to_gguf.py
writes them (q/k rows of Llama interleaved for its RoPE, norms and biases in
F32, matrices in the requested type). gguf-py quantizes Q8_0 and Q4_0 itself;
it has no Q4_K / Q6_K quantizer, so those two are packed here, simply (absmax
scales, not llama.cpp's search), in the exact block layout its dequantizer
reads: a valid file of that type is all the tests need.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from llm_testutil import train_tokenizer

from dspark.testing import random_checkpoint

QK_K = 256
HF_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Dimensions are multiples of 256 where a matrix's rows must hold whole K-quant superblocks.
COMMON: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                          "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
                          "initializer_range": 0.1}
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama_tied": ("Llama", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    # Llama 3.1's RoPE: llama.cpp keeps only its frequency factors, as the rope_freqs tensor
    "llama3": ("Llama", {"num_attention_heads": 4, "num_key_value_heads": 2, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    # transformers reads no head size from a qwen3 GGUF and takes Qwen3Config's default, 128
    "qwen3": ("Qwen3", {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128}),
}


def make_checkpoint(out: Path, arch: str, seed: int = 0) -> Path:
    """A tiny random checkpoint of ``arch`` with the trained byte-level BPE tokenizer (llm_testutil)."""
    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    vocab = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    prefix, kw = ARCHS[arch]
    return random_checkpoint(out, prefix, seed, vocab_size=vocab, **COMMON, **kw)


# -- K-quant packing (the layouts gguf.quants.Q4_K / Q6_K.dequantize_blocks read) -----------------------------


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Rows of 256-value superblocks: 16 sub-blocks of 16 with int8 scales, 6-bit values (-32..31)."""
    x = w.astype(np.float32).reshape(-1, QK_K)
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    s = np.abs(sub).max(axis=2) / 31.0  # per sub-block scale
    d = (s.max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.rint(s / np.where(d[:, None] > 0, d[:, None], 1)), 0).clip(-128, 127)
    step = d[:, None] * sc
    q = np.where(step[:, :, None] > 0, np.rint(sub / np.where(step[:, :, None] > 0, step[:, :, None], 1)), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, QK_K)
    pos = np.arange(QK_K)
    h, r = pos // 128, pos % 128
    ql = np.zeros((n, 128), np.uint8)
    qh = np.zeros((n, 64), np.uint8)
    for p in range(QK_K):  # element p: low nibble in ql[h*64 + r%64] (shift 4*(r//64)), high bits in qh
        ql[:, h[p] * 64 + r[p] % 64] |= ((q[:, p] & 0x0F) << (4 * (r[p] // 64))).astype(np.uint8)
        qh[:, h[p] * 32 + r[p] % 32] |= ((q[:, p] >> 4) << (2 * (r[p] // 32))).astype(np.uint8)
    blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16(d)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Rows of 256-value superblocks: 8 sub-blocks of 32 with 6-bit scales and minimums, 4-bit values."""
    x = w.astype(np.float32).reshape(-1, QK_K)
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    scale = (sub.max(axis=2) - lo) / 15.0
    d = (scale.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.rint(scale / np.where(d[:, None] > 0, d[:, None], 1)), 0).clip(0, 63)
    mn = np.where(dmin[:, None] > 0, np.rint(-lo / np.where(dmin[:, None] > 0, dmin[:, None], 1)), 0).clip(0, 63)
    step, off = d[:, None] * sc, dmin[:, None] * mn
    safe = np.where(step > 0, step, 1)[:, :, None]
    q = np.where(step[:, :, None] > 0, np.rint((sub + off[:, :, None]) / safe), 0).clip(0, 15).astype(np.uint8)
    sc8, mn8 = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = sc8[:, :4] | ((sc8[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn8[:, :4] | ((mn8[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc8[:, 4:] & 0x0F) | ((mn8[:, 4:] & 0x0F) << 4)
    q = q.reshape(n, 4, 2, 32)  # sub-block j = 2 * chunk + nibble
    qs = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(n, 128)
    blocks = np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=1)
    return blocks.reshape(w.shape[0], -1)


def _encode(w: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    import gguf
    from gguf import quants

    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    if kind == "Q4_K":
        return quantize_q4_k(w), qtype
    if kind == "Q6_K":
        return quantize_q6_k(w), qtype
    try:
        return quants.quantize(w.astype(np.float32), qtype), qtype
    except NotImplementedError:  # a type gguf-py cannot write (e.g. Q8_1): zero blocks, for the error tests
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8), qtype


def llama3_rope_freqs(cfg: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter (LlamaModel.generate_extra_tensors) writes for a llama3 rope_scaling."""
    import math

    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: q/k rows interleaved for its RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    base, suffix = hf.rsplit(".", 1)
    if base in HF_TO_GGUF:
        return f"{HF_TO_GGUF[base]}.{suffix}"
    _, _, n, rest = base.split(".", 3)
    return f"blk.{n}.{LAYER[rest]}.{suffix}"


def write_gguf(ckpt: Path, out: Path, types: str | Callable[[str], str], *, chat_template: str | None = None,
               name: str = "tiny") -> Path:
    """``ckpt`` as a GGUF file; ``types``: one type for every matrix, or GGUF tensor name -> type."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((ckpt / "config.json").read_text())
    arch = cfg["model_type"]
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if (cfg.get("rope_parameters") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg))
    for hf, t in sorted(load_file(str(ckpt / "model.safetensors")).items()):
        if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        gname = gguf_name(hf)
        t = t.astype(np.float32)
        if arch == "llama" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            t = _permute(t, cfg["num_attention_heads"] if ".attn_q." in gname else cfg["num_key_value_heads"])
        kind = "F32" if t.ndim == 1 else (types if isinstance(types, str) else types(gname))
        data, qtype = _encode(t, kind)
        w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
