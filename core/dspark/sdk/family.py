"""Every model family's decoder, written once over a small set of ops a plugin supplies (plugin API 1.10).

:func:`forward` is the one definition of a decoder step: embedding, then per layer
RMSNorm, fused QKV, q/k norms, RoPE (partial, per-layer tables, or none), paged
attention (scale, sliding window, soft-cap), the output projection, Gemma's
sandwich norms, the gated MLP (SwiGLU or GeGLU), and at the end the final norm
and head over the rows whose logits are wanted, soft-capped where the family
caps them. What a family changes is data on the :class:`~dspark.sdk.decoder.DecoderSpec`
(its per-layer windows and RoPE tables, scales, caps, activation), not code.

A plugin implements :class:`DecoderOps` and calls ``forward(spec, ops, ...)``:

- a graph runtime's ops build nodes (OpenVINO, ONNX): ``forward`` runs once at
  compile time and returns the graph's output;
- an eager runtime's ops compute (numpy, torch): ``forward`` runs every step
  and returns the logits.

The definition never branches on a tensor's values, so both work. An op a
runtime lacks, or a variant of one (``attention.softcap``, ``rope.partial``,
``linear.int4``, ...), is left out of the ops' :attr:`DecoderOps.variants`;
:func:`decline` then names it and what needs it, and the plugin declines the
spec with that reason. This is the llama.cpp design (``llm_build_*`` per family
over ggml's ops, one backend per device), with one builder for every family.

Tensors are rows: ``[T, hidden]`` for the step's ``T`` new tokens of every
sequence, ``[T, heads, head_dim]`` between :meth:`DecoderOps.heads` and
:meth:`DecoderOps.attention`. Weights are the spec's float32 arrays
(:class:`~dspark.sdk.decoder.LayerWeights`: ``y = x @ W``, fused ``qkv`` columns q then
k then v, ``gate_up`` columns gate then up); Gemma's ``(1 + w)`` norms are folded in.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from dspark.types import QuantSpec
from dspark.types.decoder import FEATURES, DecoderSpec, DecoderWeights, LayerWeights

__all__ = ["ACTIVATIONS", "VARIANTS", "Attention", "DecoderOps", "decline", "forward", "requirements"]

T = TypeVar("T")

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")

# Op variants a definition may need beyond the plain ops, with what they mean. An ops class lists the ones
# it implements in ``variants``; a spec needing another is declined, naming it.
VARIANTS: dict[str, str] = {
    "activation.gelu": "exact GELU in the gated MLP (GeGLU)",
    "activation.gelu_tanh": "tanh-approximated GELU in the gated MLP (GeGLU)",
    "attention.window": "attention over only each row's last N positions (sliding window)",
    "attention.softcap": "tanh soft-capping of attention scores",
    "rope.partial": "RoPE over only the first dims of each head",
    "softcap": "tanh soft-capping of the final logits",
    "linear.int8": "int8 weights (dspark.sdk.quant's rounding) in a projection",
    "linear.int4": "int4 weights (dspark.sdk.quant's rounding) in a projection",
    "embed.int8": "an int8 embedding table with a scale per row",
    "linear.blocks": "a projection held in a GGUF file's own blocks (dspark.sdk.decoder.BlockWeight, API 1.14)",
}
# Features the definition itself does not express: a spec with one is declined by every ops class.
_OUTSIDE: dict[str, str] = {}


@dataclass(frozen=True)
class Attention:
    """One layer's attention: what :meth:`DecoderOps.attention` computes."""

    layer: int  # the model's layer index: which KV cache the new rows are written to and read from
    num_heads: int
    num_kv_heads: int  # grouped-query: query head h reads KV head h // (num_heads // num_kv_heads)
    head_dim: int
    scale: float  # scores = q . k * scale
    window: int | None  # a row at position p sees positions p - window + 1 .. p; None = 0 .. p
    softcap: float | None  # scores -> tanh(scores / softcap) * softcap, before the causal mask and softmax


class DecoderOps(Protocol, Generic[T]):
    """The ops a plugin supplies so that :func:`forward` runs on its runtime.

    ``T`` is the runtime's tensor (or graph node). Every op works on whole rows of
    the step; only :meth:`tokens`, :meth:`rope`, :meth:`attention` and
    :meth:`logit_rows` read the step's inputs (:class:`~dspark.sdk.decoder.StepBatch`:
    ``input_ids``, ``positions``, the block tables, ``logit_rows``), which the ops
    hold: a graph's ops as its parameters, an eager one's as the batch it runs.
    """

    variants: frozenset[str]  # the :data:`VARIANTS` these ops implement

    def tokens(self, table: np.ndarray, quant: QuantSpec | None) -> T:
        """The embedding rows of the step's ``input_ids``: ``table`` [vocab, hidden]; ``quant`` (variant
        ``embed.int8``): quantize ``table.T`` as :func:`dspark.sdk.quantize_weight` does, per row."""
        ...

    def hidden_in(self) -> T:
        """The step's ``hidden`` input [T, hidden] (a layer range that does not start at layer 0)."""
        ...

    def scale(self, x: T, factor: float) -> T:
        """``x * factor``."""
        ...

    def rms_norm(self, x: T, weight: np.ndarray, eps: float) -> T:
        """``x / sqrt(mean(x^2, last axis) + eps) * weight`` over the last axis ([T, hidden] or [T, heads, D])."""
        ...

    def linear(self, x: T, weight: np.ndarray, bias: np.ndarray | None, quant: QuantSpec | None, name: str) -> T:
        """``x @ weight (+ bias)``, ``weight`` [in, out] float32; ``quant``: the canonical rounding of
        ``weight`` (variants ``linear.int8`` / ``linear.int4``); or (variant ``linear.blocks``) ``weight`` a
        :class:`dspark.types.blocks.BlockWeight` of a GGUF file's tensors. ``name`` is the engine's weight name."""
        ...

    def split(self, x: T, sizes: list[int]) -> list[T]:
        """``x`` cut along its last axis into parts of these sizes."""
        ...

    def heads(self, x: T, num: int, dim: int) -> T:
        """[T, num * dim] -> [T, num, dim]."""
        ...

    def rope(self, x: T, table: int) -> T:
        """``x`` [T, heads, D] rotated by the rows ``StepBatch.rope_rows`` (the positions, or for LongRoPE's
        long mode ``position + max_position_embeddings``) of table ``table`` of ``spec.rope_at``
        (rotate-half: ``x * cos + cat(-x2, x1) * sin`` over the first ``spec.rotary`` dims, the rest
        unchanged; variant ``rope.partial`` when those are fewer than D)."""
        ...

    def attention(self, q: T, k: T, v: T, spec: Attention) -> T:
        """Write the rows' ``k`` and ``v`` [T, KVH, D] to layer ``spec.layer``'s cache at their positions, then
        each row's causal attention over its own sequence's cached positions; returns [T, H * D]."""
        ...

    def activation(self, x: T, kind: str) -> T:
        """``silu`` (x * sigmoid(x)), ``gelu_tanh`` or ``gelu``, elementwise."""
        ...

    def mul(self, a: T, b: T) -> T:
        ...

    def add(self, a: T, b: T) -> T:
        ...

    def logit_rows(self, x: T) -> T:
        """The rows of ``x`` named by the step's ``logit_rows``."""
        ...

    def softcap(self, x: T, cap: float) -> T:
        """``tanh(x / cap) * cap`` (variant ``softcap``)."""
        ...


def _quant(spec: DecoderSpec, name: str) -> QuantSpec | None:
    return (spec.quantization or {}).get(name)


def requirements(spec: DecoderSpec) -> dict[str, str]:
    """The op variants ``spec`` needs, each with what in the model needs it."""
    need: dict[str, str] = {}
    if spec.activation != "silu":
        key = "activation.gelu_tanh" if spec.activation == "gelu_tanh" else "activation.gelu"
        need[key] = f"{spec.architecture}'s {spec.activation} MLP"
    if any(w is not None for w in spec.windows):
        need["attention.window"] = f"{spec.architecture}'s sliding window of {max(w or 0 for w in spec.windows)}"
    if spec.attn_softcap is not None:
        need["attention.softcap"] = f"{spec.architecture}'s attention soft-cap {spec.attn_softcap}"
    if spec.final_softcap is not None:
        need["softcap"] = f"{spec.architecture}'s final logit soft-cap {spec.final_softcap}"
    if spec.rotary != spec.head_dim and any(r is not None for r in (spec.layer_rope or (0,))):
        need["rope.partial"] = f"RoPE over {spec.rotary} of {spec.head_dim} dims"
    if "gguf_stored" in spec.features:
        need["linear.blocks"] = "weights quantized in a GGUF file, run as stored (gguf_stored)"
    for name, q in (spec.quantization or {}).items():
        if name == "model.embed_tokens":
            need["embed.int8"] = "the quantization plan's int8 embedding"
        else:
            need.setdefault(f"linear.int{q.weight_bits}", f"the quantization plan ({name}, ...)")
    return need


def decline(spec: DecoderSpec, variants: frozenset[str] | set[str]) -> str | None:
    """Why ops implementing ``variants`` cannot run ``spec``, naming each missing op variant and what needs
    it; None when they can."""
    outside = sorted(set(spec.features) & set(_OUTSIDE))
    if outside:
        return "the decoder definition does not express " + "; ".join(
            f"{f} ({FEATURES.get(f, _OUTSIDE[f])})" for f in outside)
    missing = {k: v for k, v in requirements(spec).items() if k not in variants}
    if not missing:
        return None
    return "lacks the op variants " + "; ".join(f"{k} ({VARIANTS.get(k, k)}), for {why}"
                                               for k, why in sorted(missing.items()))


@dataclass(frozen=True)
class _LayerPlan:
    """What one layer's ops are called with besides tensors: computed once per spec (eager runtimes run
    the definition every step)."""

    names: tuple[str, str, str, str]  # the engine's names of qkv, o, gate_up, down
    quant: tuple[QuantSpec | None, ...]
    table: int | None
    attention: Attention


_PLANS: dict[int, list[_LayerPlan]] = {}  # id of a live spec -> its layers' plans (dropped with the spec)


def _plans(spec: DecoderSpec) -> list[_LayerPlan]:
    plans = _PLANS.get(id(spec))
    if plans is None:
        H, KVH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        scale = spec.attn_scale if spec.attn_scale is not None else D ** -0.5
        plans = []
        for n in range(spec.num_layers):
            p = f"model.layers.{n}."
            names = (p + "self_attn.qkv_proj", p + "self_attn.o_proj", p + "mlp.gate_up_proj", p + "mlp.down_proj")
            plans.append(_LayerPlan(names, tuple(_quant(spec, m) for m in names), spec.rope_of(n),
                                    Attention(n, H, KVH, D, scale, spec.window(n), spec.attn_softcap)))
        _PLANS[id(spec)] = plans
        weakref.finalize(spec, _PLANS.pop, id(spec), None)
    return plans


def _layer(spec: DecoderSpec, ops: DecoderOps[T], plan: _LayerPlan, x: T, w: LayerWeights) -> T:
    H, KVH, D, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
    qkv_name, o_name, gu_name, down_name = plan.names
    qq, qo, qgu, qd = plan.quant
    h = ops.rms_norm(x, w.in_norm, eps)
    q, k, v = ops.split(ops.linear(h, w.qkv, w.qkv_bias, qq, qkv_name), [H * D, KVH * D, KVH * D])
    q, k, v = ops.heads(q, H, D), ops.heads(k, KVH, D), ops.heads(v, KVH, D)
    if w.q_norm is not None and w.k_norm is not None:
        q, k = ops.rms_norm(q, w.q_norm, eps), ops.rms_norm(k, w.k_norm, eps)
    if plan.table is not None:
        q, k = ops.rope(q, plan.table), ops.rope(k, plan.table)
    o = ops.linear(ops.attention(q, k, v, plan.attention), w.o, w.o_bias, qo, o_name)
    if w.attn_out_norm is not None:
        o = ops.rms_norm(o, w.attn_out_norm, eps)
    x = ops.add(x, o)
    h = ops.rms_norm(x, w.post_norm, eps)
    gate, up = ops.split(ops.linear(h, w.gate_up, None, qgu, gu_name), [spec.intermediate_size] * 2)
    m = ops.linear(ops.mul(ops.activation(gate, spec.activation), up), w.down, None, qd, down_name)
    if w.mlp_out_norm is not None:
        m = ops.rms_norm(m, w.mlp_out_norm, eps)
    return ops.add(x, m)


def stored_weights(spec: DecoderSpec) -> DecoderWeights:
    """The weights a runtime that keeps the model's own precision builds from: ``spec.blocks()`` for a
    ``gguf_stored`` spec (the file's blocks), else ``spec.weights(stored=True)``."""
    if "gguf_stored" not in spec.features:
        return spec.weights(stored=True)
    blocks = spec.blocks()
    if blocks is None:
        raise ValueError(f"{spec.name}: a gguf_stored spec without blocks() (DecoderSpec.blocks_fn)")
    return blocks


def forward(spec: DecoderSpec, ops: DecoderOps[T], layers: tuple[int, int] | None = None, *,
            head: bool | None = None, weights: DecoderWeights | None = None) -> T:
    """The decoder over ``layers`` (default ``spec.layers``) on ``ops``.

    Starts from the step's tokens when the range starts at layer 0, else from its hidden state; ends in
    the final norm and head over ``logit_rows`` when ``head`` (default: the range ends at the model's
    last layer; an early exit passes ``layers=(0, exit), head=True``), else returns the hidden state.
    ``weights``: ``spec.weights()`` already read (an eager runtime reads them once, not every step).
    A ``gguf_stored`` spec reads ``spec.blocks()``: its projections are the file's blocks.
    """
    a, b = layers or spec.layers
    head = b == spec.num_layers if head is None else head
    w = weights if weights is not None else stored_weights(spec) if "gguf_stored" in spec.features \
        else spec.weights()
    if a == 0:
        x = ops.tokens(w.embed, _quant(spec, "model.embed_tokens"))
        if spec.embed_scale is not None:
            x = ops.scale(x, spec.embed_scale)
    else:
        x = ops.hidden_in()
    plans = _plans(spec)
    for n in range(a, b):
        x = _layer(spec, ops, plans[n], x, w.layers[n])
    if not head:
        return x
    y = ops.linear(ops.rms_norm(ops.logit_rows(x), w.norm, spec.rms_norm_eps), w.head, None,
                   _quant(spec, "lm_head"), "lm_head")
    return ops.softcap(y, spec.final_softcap) if spec.final_softcap is not None else y
