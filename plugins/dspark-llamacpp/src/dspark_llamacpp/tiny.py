"""A tiny random-weight Llama written as a GGUF file with the gguf package: what the AMX probe runs
(:mod:`dspark_llamacpp.amx`) and what the plugin's own tests load."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write(path: Path, *, hidden: int = 64, ff: int = 128, vocab: int = 96, layers: int = 2, heads: int = 4,
          kv_heads: int = 2, qtype: str = "F32", embd_qtype: str = "F32") -> Path:
    """A Llama of random weights (seeded) at ``path``; ``qtype``: the matrices' type, ``F32`` or one the gguf
    package quantizes (``Q8_0``, ``Q4_0``, ``BF16``, ...); ``embd_qtype``: the token embeddings' (the output
    layer is tied to them); norms stay F32."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(["t 1"])  # llama.cpp requires merges for a gpt2 vocabulary
    hd = hidden // heads

    def matrix(name: str, rows: int, cols: int, as_: gguf.GGMLQuantizationType = kind) -> None:
        a = (rng.standard_normal((rows, cols)) * 0.2).astype(np.float32)
        if as_ == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, as_), raw_dtype=as_)

    matrix("token_embd.weight", vocab, hidden, gguf.GGMLQuantizationType[embd_qtype])
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(f"blk.{i}.attn_q.weight", heads * hd, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * hd, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * hd, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * hd)
        matrix(f"blk.{i}.ffn_gate.weight", ff, hidden)
        matrix(f"blk.{i}.ffn_up.weight", ff, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
