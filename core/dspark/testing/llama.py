"""The shipped default model, ``stdlib-llama``, written out as an ONNX graph with its trained weights.

A trained model's activations are what kernels meet in production: here the
residual stream grows layer by layer to values in the hundreds and attention
puts nearly all its weight on single tokens. Random weights keep everything
near unit scale, so this builds the Llama decoder of
``core/dspark/assets/models/stdlib-llama`` op by op in plain ONNX ops
(Hugging Face's ``LlamaForCausalLM`` computation: RMSNorm as
Pow/ReduceMean/Sqrt, rotary embeddings by Slice/Neg/Concat, grouped-query
attention by Expand, a causal mask by Where) from the checkpoint's weights, upcast from
bfloat16 to float32. Nothing is downloaded; the prompt is tokenized with the
model's own tokenizer. The sequence length is fixed by the prompt: the rotary
tables and the mask are initializers, so every shape in the graph is static.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NAME = "stdlib-llama"
ASSET = Path(__file__).resolve().parents[1] / "assets" / "models" / NAME
PROMPT = "def quick_sort(arr):\n    if len(arr) <= 1:\n        return arr\n"


@dataclass(frozen=True)
class _Config:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    eps: float
    theta: float
    tied: bool

    @classmethod
    def read(cls, path: Path) -> _Config:
        c: dict[str, Any] = json.loads((path / "config.json").read_text())
        rope = c.get("rope_parameters") or {}  # transformers >= 5 nests it; older configs keep rope_theta on top
        return cls(hidden=c["hidden_size"], heads=c["num_attention_heads"],
                   kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
                   head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                   layers=c["num_hidden_layers"], eps=float(c.get("rms_norm_eps", 1e-6)),
                   theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                   tied=bool(c.get("tie_word_embeddings", False)))


def _weights(path: Path) -> dict[str, np.ndarray]:
    # Through torch: numpy has no bfloat16, and safetensors' numpy loader refuses it.
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k).float().numpy() for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)


def prompt_ids(prompt: str = PROMPT, path: Path = ASSET) -> np.ndarray:
    """The prompt's token ids, (1, seq) int64, from the model's own tokenizer."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(prompt).ids
    return np.array([ids], dtype=np.int64)


class _Builder:
    """Nodes and initializers of the graph; each node is named after its (single) output."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray | float | list[int]) -> str:
        arr = np.asarray(value)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        self.inits.append(numpy_helper.from_array(arr, name))
        return name

    def __call__(self, op_type: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op_type, inputs, [output], name=output, **attrs))
        return output


def _rms_norm(b: _Builder, x: str, weight: str, prefix: str) -> str:
    sq = b("Pow", [x, "two"], f"{prefix}.pow")
    var = b("ReduceMean", [sq], f"{prefix}.var", axes=[-1], keepdims=1)
    rstd = b("Reciprocal", [b("Sqrt", [b("Add", [var, "eps"], f"{prefix}.var_eps")], f"{prefix}.std")],
             f"{prefix}.rstd")
    return b("Mul", [weight, b("Mul", [x, rstd], f"{prefix}.normed")], f"{prefix}.out")


def _heads(b: _Builder, x: str, n: int, cfg: _Config, prefix: str) -> str:
    """(1, seq, n * head_dim) -> (1, n, seq, head_dim)."""
    split = b("Reshape", [x, b.const(f"{prefix}.shape", [1, -1, n, cfg.head_dim])], f"{prefix}.split")
    return b("Transpose", [split], f"{prefix}.heads", perm=[0, 2, 1, 3])


def _rope(b: _Builder, x: str, prefix: str) -> str:
    # x * cos + rotate_half(x) * sin, rotate_half(x) = concat(-x[..., half:], x[..., :half]).
    lo = b("Slice", [x, "zero", "half_dim", "last"], f"{prefix}.lo")
    hi = b("Slice", [x, "half_dim", "big", "last"], f"{prefix}.hi")
    rot = b("Concat", [b("Neg", [hi], f"{prefix}.neg_hi"), lo], f"{prefix}.rot", axis=-1)
    return b("Add", [b("Mul", [x, "cos"], f"{prefix}.xcos"), b("Mul", [rot, "sin"], f"{prefix}.rsin")],
             f"{prefix}.out")


def _repeat_kv(b: _Builder, x: str, cfg: _Config, seq: int, prefix: str) -> str:
    """(1, kv, seq, d) -> (1, heads, seq, d): each key/value head serves heads // kv query heads in turn."""
    if cfg.kv_heads == cfg.heads:
        return x
    rep = cfg.heads // cfg.kv_heads
    x5 = b("Unsqueeze", [x, b.const(f"{prefix}.axis", [2])], f"{prefix}.x5")
    wide = b("Expand", [x5, b.const(f"{prefix}.to", [1, cfg.kv_heads, rep, seq, cfg.head_dim])], f"{prefix}.wide")
    return b("Reshape", [wide, b.const(f"{prefix}.shape", [1, cfg.heads, seq, cfg.head_dim])], f"{prefix}.out")


def _linear(b: _Builder, x: str, w: dict[str, np.ndarray], name: str, out: str) -> str:
    # torch stores (out, in); the exporter's MatMul takes the transpose as its initializer.
    return b("MatMul", [x, b.const(name, np.ascontiguousarray(w[name].T))], out)


def _layer(b: _Builder, x: str, i: int, w: dict[str, np.ndarray], cfg: _Config, seq: int) -> str:
    p = f"model.layers.{i}"
    h = _rms_norm(b, x, b.const(f"{p}.input_layernorm.weight", w[f"{p}.input_layernorm.weight"]), f"l{i}.ln1")
    q = _heads(b, _linear(b, h, w, f"{p}.self_attn.q_proj.weight", f"l{i}.q"), cfg.heads, cfg, f"l{i}.q")
    k = _heads(b, _linear(b, h, w, f"{p}.self_attn.k_proj.weight", f"l{i}.k"), cfg.kv_heads, cfg, f"l{i}.k")
    v = _heads(b, _linear(b, h, w, f"{p}.self_attn.v_proj.weight", f"l{i}.v"), cfg.kv_heads, cfg, f"l{i}.v")
    q, k = _rope(b, q, f"l{i}.q_rope"), _rope(b, k, f"l{i}.k_rope")
    k, v = _repeat_kv(b, k, cfg, seq, f"l{i}.k_rep"), _repeat_kv(b, v, cfg, seq, f"l{i}.v_rep")
    scores = b("Mul", [b("MatMul", [q, b("Transpose", [k], f"l{i}.kt", perm=[0, 1, 3, 2])], f"l{i}.qk"), "scale"],
               f"l{i}.scores")
    masked = b("Where", ["causal", scores, "neg_inf"], f"l{i}.masked")
    attn = b("MatMul", [b("Softmax", [masked], f"l{i}.probs", axis=-1), v], f"l{i}.attn")
    merged = b("Reshape", [b("Transpose", [attn], f"l{i}.attn_t", perm=[0, 2, 1, 3]), "merge_shape"], f"l{i}.merged")
    r1 = b("Add", [x, _linear(b, merged, w, f"{p}.self_attn.o_proj.weight", f"l{i}.o")], f"l{i}.resid1")
    h2 = _rms_norm(b, r1, b.const(f"{p}.post_attention_layernorm.weight", w[f"{p}.post_attention_layernorm.weight"]),
                   f"l{i}.ln2")
    gate = _linear(b, h2, w, f"{p}.mlp.gate_proj.weight", f"l{i}.gate")
    silu = b("Mul", [gate, b("Sigmoid", [gate], f"l{i}.gate_sig")], f"l{i}.silu")
    up = b("Mul", [silu, _linear(b, h2, w, f"{p}.mlp.up_proj.weight", f"l{i}.up")], f"l{i}.gated")
    return b("Add", [r1, _linear(b, up, w, f"{p}.mlp.down_proj.weight", f"l{i}.down")], f"l{i}.resid2")


def _shared(b: _Builder, cfg: _Config, seq: int) -> None:
    """The constants every layer reads: rotary tables, the causal mask, scalars and index vectors."""
    inv_freq = 1.0 / cfg.theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    angles = np.outer(np.arange(seq, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)  # (seq, head_dim), as transformers builds them
    b.const("cos", np.cos(angles).astype(np.float32))
    b.const("sin", np.sin(angles).astype(np.float32))
    b.const("causal", np.tril(np.ones((seq, seq), dtype=bool)))
    b.const("neg_inf", np.array(-np.inf, dtype=np.float32))
    b.const("scale", np.array(cfg.head_dim ** -0.5, dtype=np.float32))
    b.const("two", np.array(2.0, dtype=np.float32))
    b.const("eps", np.array(cfg.eps, dtype=np.float32))
    for name, value in (("zero", 0), ("half_dim", cfg.head_dim // 2), ("big", cfg.head_dim), ("last", -1)):
        b.const(name, np.array([value], dtype=np.int64))
    b.const("merge_shape", np.array([1, seq, cfg.heads * cfg.head_dim], dtype=np.int64))


def stdlib_llama_onnx(layers: int | None = None, prompt: str = PROMPT,
                      path: Path = ASSET) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """(model, inputs): the first ``layers`` decoder layers (all by default), final norm and LM head.

    Input ``input_ids`` (1, seq) int64, output ``logits`` (1, seq, vocab)
    float32; ``inputs`` holds the tokenized ``prompt``.
    """
    cfg = _Config.read(path)
    n_layers = cfg.layers if layers is None else layers
    if not 1 <= n_layers <= cfg.layers:
        raise ValueError(f"{NAME} has {cfg.layers} layers; asked for {layers}")
    w = _weights(path)
    ids = prompt_ids(prompt, path)
    seq = ids.shape[1]
    b = _Builder()
    _shared(b, cfg, seq)
    x = b("Gather", [b.const("model.embed_tokens.weight", w["model.embed_tokens.weight"]), "input_ids"], "embed", axis=0)
    for i in range(n_layers):
        x = _layer(b, x, i, w, cfg, seq)
    x = _rms_norm(b, x, b.const("model.norm.weight", w["model.norm.weight"]), "norm")
    head = "model.embed_tokens.weight" if cfg.tied or "lm_head.weight" not in w else "lm_head.weight"
    if head == "lm_head.weight":
        b.const(head, np.ascontiguousarray(w[head].T))
        logits = b("MatMul", [x, head], "logits")
    else:  # tied: the embedding table serves as the head, read transposed
        logits = b("MatMul", [x, b("Transpose", [head], "lm_head_t", perm=[1, 0])], "logits")
    vocab = w["model.embed_tokens.weight"].shape[0]
    graph = helper.make_graph(
        b.nodes, NAME, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, seq])],
        [helper.make_tensor_value_info(logits, TensorProto.FLOAT, [1, seq, vocab])], initializer=b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="dspark.testing")
    model.ir_version = 9
    return model, {"input_ids": ids}
