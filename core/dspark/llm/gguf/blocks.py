"""A quantized GGUF file's weights as stored, in the decoder spec's layout (``DecoderSpec.blocks()``, API 1.14).

Projections come as :class:`dspark.types.blocks.BlockWeight` (q, k, v stacked for
``qkv``; gate and up for ``gate_up``), each part a view of the file's memory map
in its own type; the embedding table (a runtime gathers its rows) and a tied head
as one such part too, unless the file stores it as floats; norms and biases as
float32 arrays. A Llama's q/k rows keep llama.cpp's interleaved order on disk and
carry the permutation back to Hugging Face's (``tensors.unpermute``) as a row order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dspark.llm.gguf.metadata import GGUFError
from dspark.llm.gguf.tensors import hf_name, permuted_heads, read_tensor, unpermute
from dspark.types.blocks import BlockPart, BlockWeight
from dspark.types.decoder import DecoderWeights, LayerWeights


def _part(t: Any, order: np.ndarray | None) -> BlockPart:
    rows, cols = (int(d) for d in reversed(t.shape.tolist()))
    raw = t.data
    if t.tensor_type.name in ("F32", "F16"):
        raw = np.asarray(raw).reshape(rows, cols)
    elif t.tensor_type.name == "BF16":
        import ml_dtypes

        raw = np.asarray(raw).view(ml_dtypes.bfloat16).reshape(rows, cols)
    return BlockPart(t.name, t.tensor_type.name, raw, rows, cols, order)


def stored_weights(path: str | Path) -> DecoderWeights:
    """The file's weights in :class:`DecoderWeights`' layout, block-quantized projections as stored."""
    from dspark.llm.gguf.metadata import open_reader, read_metadata, to_config
    from dspark.llm.gguf.tensors import ROPE_FREQS, shapes

    p = Path(path)
    reader = open_reader(p, share=False)  # its pages are read (unpacked): gone with the weights, not kept shared
    raw = to_config(read_metadata(reader), shapes(reader), p,
                    next((read_tensor(t, p) for t in reader.tensors if t.name == ROPE_FREQS), None))
    by_name = {name: t for t in reader.tensors if (name := hf_name(t.name)) is not None}

    def order(name: str, rows: int) -> np.ndarray | None:
        heads = permuted_heads(raw["model_type"], name, raw["num_attention_heads"], raw["num_key_value_heads"])
        return None if heads is None else unpermute(np.arange(rows), heads)

    def tensor(name: str) -> Any:
        if name not in by_name:
            raise GGUFError(f"{p}: tensor for {name} is missing")
        return by_name[name]

    def vec(name: str) -> np.ndarray | None:
        t = by_name.get(name)
        if t is None:
            return None
        v = np.asarray(read_tensor(t, p), dtype=np.float32)
        o = order(name, len(v))
        return v if o is None else v[o]

    def proj(*names: str) -> BlockWeight:
        parts = []
        for n in names:
            t = tensor(n)
            parts.append(_part(t, order(n, int(t.shape.tolist()[-1]))))
        return BlockWeight(tuple(parts))

    def cat(*names: str) -> np.ndarray | None:
        vs = [vec(n) for n in names]
        return None if any(v is None for v in vs) else np.concatenate(vs)  # type: ignore[arg-type]

    layers = []
    for i in range(int(raw["num_hidden_layers"])):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        layers.append(LayerWeights(
            in_norm=vec(f"model.layers.{i}.input_layernorm.weight"),  # type: ignore[arg-type]
            post_norm=vec(f"model.layers.{i}.post_attention_layernorm.weight"),  # type: ignore[arg-type]
            qkv=proj(f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),  # type: ignore[arg-type]
            o=proj(f"{a}.o_proj.weight"),  # type: ignore[arg-type]
            gate_up=proj(f"{m}.gate_proj.weight", f"{m}.up_proj.weight"),  # type: ignore[arg-type]
            down=proj(f"{m}.down_proj.weight"),  # type: ignore[arg-type]
            qkv_bias=cat(f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"),
            o_bias=vec(f"{a}.o_proj.bias"), q_norm=vec(f"{a}.q_norm.weight"), k_norm=vec(f"{a}.k_norm.weight")))
    table = proj("model.embed_tokens.weight")
    embed: Any = table if not table.parts[0].is_float else np.asarray(table.parts[0].values(), dtype=np.float32)
    tied = table if isinstance(embed, BlockWeight) else embed.T
    head: Any = proj("lm_head.weight") if "lm_head.weight" in by_name else tied
    return DecoderWeights(embed=embed, norm=vec("model.norm.weight"), head=head,  # type: ignore[arg-type]
                          layers=layers)
