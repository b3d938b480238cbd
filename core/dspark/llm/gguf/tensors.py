"""A GGUF file's tensors under their Hugging Face names, as float tensors.

Float tensors (F32, F16) are taken as stored; block-quantized ones are
dequantized by the ``gguf`` package (the same ``gguf.dequantize`` transformers
uses, so both see bit-identical weights). Llama's q/k rows come back in
Hugging Face's order: llama.cpp's converter interleaves them for its RoPE, and
this undoes it exactly as transformers' ``LlamaTensorProcessor`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.llm.gguf.metadata import GGUFError
from dspark.sdk.quant import dequantize, quantize_weight
from dspark.types import QuantSpec

Q8_0_BLOCK = 32
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class StoredTensor:
    """How one tensor is stored in the file."""

    gguf_name: str
    ggml_type: str  # GGMLQuantizationType name: F32, F16, Q8_0, Q4_K ...
    exact_int8: bool = False  # Q8_0 whose blocks the int8 group-32 kernels reproduce bit for bit


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for a name not read here."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL:
        return f"{_GLOBAL[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{suffix}"
    return None


def shapes(reader: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (ggml type name, numpy shape: ggml's dimensions reversed, [out, in] for a matrix)."""
    return {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors}


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its ``permute``; transformers' ``_reverse_permute_weights``)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def permuted_heads(arch: str, name: str, heads: int, kv_heads: int) -> int | None:
    """The head count whose rows llama.cpp's converter interleaved in tensor ``name`` (Hugging Face name), or
    None: Llama's q and k projections (weights and biases)."""
    if arch != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
        return None
    return heads if "q_proj" in name else kv_heads


def exact_on_int8_kernels(w: np.ndarray) -> bool:
    """Whether the int8 group-32 kernels hold ``w`` [out, in] exactly: they quantize it again from float
    (dspark.sdk.quant, symmetric absmax per block), which gives back Q8_0's integers and fp16 scales when each
    block's largest |q| is 127, as llama.cpp's and gguf-py's Q8_0 quantizers write it. Checked, not assumed."""
    w_t = np.ascontiguousarray(w.T, dtype=np.float32)
    qw = quantize_weight(w_t, QuantSpec(weight_bits=8, granularity="group", group_size=Q8_0_BLOCK))
    return bool(np.array_equal(dequantize(qw), w_t))


def read_tensor(t: Any, path: Path) -> np.ndarray:
    """One tensor as a float array in numpy's [out, in] order (float16 kept as float16)."""
    kind = t.tensor_type.name
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if kind == "F32":
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    if kind == "F16":
        return np.asarray(t.data, dtype=np.float16).reshape(shape)
    from gguf import dequantize as gguf_dequantize

    try:
        return np.asarray(gguf_dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except NotImplementedError as e:
        raise GGUFError(f"{path}: tensor {t.name} is stored as {kind}, which the gguf package cannot "
                        "dequantize") from e


def stored_types(reader: Any) -> dict[str, StoredTensor]:
    """How each tensor the runner would read is stored, from the header alone (nothing read or dequantized)."""
    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None:
            out[name] = StoredTensor(t.name, t.tensor_type.name)
    return out


def load_tensors(reader: Any, raw: dict[str, Any], path: Path,
                 tdtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, StoredTensor]]:
    """Every tensor the runner reads, by its Hugging Face name, cast to ``tdtype``; and how each was stored."""
    arch = raw["model_type"]
    weights: dict[str, torch.Tensor] = {}
    stored: dict[str, StoredTensor] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:
            continue  # read into the config's rope_scaling (metadata.llama3_rope)
        name = hf_name(t.name)
        if name is None:
            raise GGUFError(f"{path}: tensor {t.name} is not one dspark reads for the {arch} architecture")
        w = read_tensor(t, path)
        heads = permuted_heads(arch, name, raw["num_attention_heads"], raw["num_key_value_heads"])
        if heads is not None:
            w = unpermute(w, heads)
        kind = t.tensor_type.name
        exact = kind == "Q8_0" and w.ndim == 2 and exact_on_int8_kernels(w)
        stored[name] = StoredTensor(t.name, kind, exact)
        if not (w.flags.writeable and w.flags.c_contiguous):
            w = np.array(w)  # a view of the file's read-only memory map: own it, so the file can close
        weights[name] = torch.from_numpy(w).to(tdtype)
    return weights, stored
