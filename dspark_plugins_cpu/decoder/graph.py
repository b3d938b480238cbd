"""A decoder (or a range of its layers) as an OpenVINO model on the paged-attention operation.

The graph is built by hand from the spec's weights, op by op, so it needs no
exporter and no transformers: embedding ``Gather``, RMSNorm in the pattern
OpenVINO's ``RMSFusion`` recognises, fused QKV ``MatMul`` (weights ``[out, in]``,
``transpose_b``), RoPE from cos/sin tables gathered by position, one
``PagedAttentionExtension`` per layer (the node OpenVINO GenAI's graphs use,
whose KV cache inputs ``key_cache.N``/``value_cache.N`` the caller allocates),
SwiGLU MLP, and the final norm and head over only the rows whose logits are
wanted (``logit_rows``). Inputs follow :class:`dspark.sdk.decoder.StepBatch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import openvino as ov

    from dspark.sdk.decoder import DecoderSpec, LayerWeights
    from dspark.types import QuantSpec

# Features this graph implements (dspark.sdk.decoder.FEATURES); a spec needing others is declined.
SUPPORTED = frozenset({"qkv_bias", "o_bias", "qk_norm"})
PA_INPUTS = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins")


def _const(ops: Any, a: np.ndarray | float | int, dtype: Any = np.float32) -> Any:
    return ops.constant(np.asarray(a, dtype=dtype))


def _rms(ops: Any, x: Any, w: np.ndarray, eps: float) -> Any:
    # x / sqrt(mean(x^2) + eps) * w, the shape OpenVINO fuses into its RMS kernel.
    var = ops.reduce_mean(ops.power(x, _const(ops, 2.0)), _const(ops, [-1], np.int64), keep_dims=True)
    norm = ops.divide(x, ops.sqrt(ops.add(var, _const(ops, eps))))
    return ops.multiply(norm, _const(ops, w))


def _compressed(ops: Any, w: np.ndarray, q: QuantSpec) -> Any:
    """``w`` [in, out] quantized as the canonical rounding does (dspark.sdk.quant), as the weight-compression
    pattern OpenVINO's CPU plugin runs natively: int8/int4 constant -> Convert -> Multiply(scales), [out, in]."""
    import openvino as ov

    from dspark.sdk import quantize_weight, unpack_int4

    qw = quantize_weight(np.asarray(w, dtype=np.float32), q)
    k, n = qw.shape
    vals = unpack_int4(qw.data, k) if qw.bits == 4 else qw.data  # int8 [K, N]
    g = qw.group_size
    groups = qw.scales.shape[0]
    if groups == 1:
        c = ops.constant(np.ascontiguousarray(vals.T), dtype=ov.Type.i8 if qw.bits == 8 else ov.Type.i4)
        return ops.multiply(ops.convert(c, "f32"), _const(ops, np.ascontiguousarray(qw.scales.T)))
    padded = np.zeros((groups * g, n), dtype=np.int8)
    padded[:k] = vals
    blocks = np.ascontiguousarray(padded.reshape(groups, g, n).transpose(2, 0, 1))  # [out, groups, g]
    c = ops.constant(blocks, dtype=ov.Type.i8 if qw.bits == 8 else ov.Type.i4)
    deq = ops.multiply(ops.convert(c, "f32"), _const(ops, np.ascontiguousarray(qw.scales.T)[:, :, None]))
    flat = ops.reshape(deq, _const(ops, [n, groups * g], np.int64), False)
    if groups * g != k:
        flat = ops.slice(flat, _const(ops, [0], np.int64), _const(ops, [k], np.int64), _const(ops, [1], np.int64),
                         _const(ops, [1], np.int64))
    return flat


def _linear(ops: Any, x: Any, w: np.ndarray, bias: np.ndarray | None = None, q: QuantSpec | None = None) -> Any:
    """x @ w with w [in, out] stored as [out, in] (the fully-connected layout OpenVINO's CPU plugin packs),
    or compressed per ``q``."""
    weight = _const(ops, np.ascontiguousarray(w.T)) if q is None else _compressed(ops, w, q)
    y = ops.matmul(x, weight, transpose_a=False, transpose_b=True)
    return y if bias is None else ops.add(y, _const(ops, bias))


def _rope(ops: Any, x: Any, cos: Any, sin: Any) -> Any:
    """x [T, heads, D] rotated: x * cos + rotate_half(x) * sin, cos/sin [T, 1, D]. Written with Slice and a
    multiply by -1, the form OpenVINO's RoPE fusion matches: one fused RoPE node instead of six ops."""
    half = x.get_output_partial_shape(0)[2].get_length() // 2
    i64 = np.int64
    x1 = ops.slice(x, _const(ops, [0], i64), _const(ops, [half], i64), _const(ops, [1], i64), _const(ops, [2], i64))
    x2 = ops.slice(x, _const(ops, [half], i64), _const(ops, [2 * half], i64), _const(ops, [1], i64),
                   _const(ops, [2], i64))
    rot = ops.concat([ops.multiply(x2, _const(ops, -1.0)), x1], -1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rot, sin))


def _paged_attention(ops: Any, q: Any, k: Any, v: Any, kc: Any, vc: Any, pa: dict[str, Any], scale: float,
                     kv_heads: int, head_dim: int) -> Any:
    """The 28-input PagedAttentionExtension of OpenVINO 2026.4, with the optional inputs empty as
    ``paged_attention_transformation`` leaves them (checked against a transformed export)."""
    from openvino._pyopenvino.op import _PagedAttentionExtension

    i32, f32 = np.int32, np.float32
    empty_i, empty_f = _const(ops, np.zeros(0, i32), i32), _const(ops, np.zeros(0, f32))
    args = [q, k, v, kc, vc, *(pa[n] for n in PA_INPUTS),
            _const(ops, scale), _const(ops, 0, i32), empty_f, pa["max_context_len"],
            empty_i, empty_i, empty_i, empty_f, empty_f, _const(ops, 0, i32), _const(ops, 0, i32),
            _const(ops, np.zeros((0, 0, 0, 0), f32)), _const(ops, 0, i32), empty_i, empty_i, empty_i, empty_i,
            _const(ops, np.zeros(0, np.uint8), np.uint8), empty_i]
    node = _PagedAttentionExtension([a.output(0) if hasattr(a, "output") else a for a in args])
    # The CPU plugin sizes its cache layout from these (the transformation sets them the same way).
    for key, value in (("num_k_heads", kv_heads), ("k_head_size", head_dim), ("num_v_heads", kv_heads),
                       ("v_head_size", head_dim)):
        node.get_rt_info()[key] = value
    return node.output(0)


def _layer(ops: Any, spec: DecoderSpec, n: int, L: LayerWeights, x: Any, cos: Any, sin: Any, kc: Any, vc: Any,
           pa: dict[str, Any]) -> Any:
    H, KVH, D, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
    quant = spec.quantization or {}

    def qs(name: str) -> QuantSpec | None:
        return quant.get(f"model.layers.{n}.{name}")

    h = _rms(ops, x, L.in_norm, eps)
    qkv = _linear(ops, h, L.qkv, L.qkv_bias, qs("self_attn.qkv_proj"))
    q, k, v = ops.variadic_split(qkv, _const(ops, -1, np.int64),
                                 _const(ops, [H * D, KVH * D, KVH * D], np.int64)).outputs()
    q = ops.reshape(q, _const(ops, [-1, H, D], np.int64), False)
    k = ops.reshape(k, _const(ops, [-1, KVH, D], np.int64), False)
    if L.q_norm is not None and L.k_norm is not None:
        q, k = _rms(ops, q, L.q_norm, eps), _rms(ops, k, L.k_norm, eps)
    q = ops.reshape(_rope(ops, q, cos, sin), _const(ops, [-1, H * D], np.int64), False)
    k = ops.reshape(_rope(ops, k, cos, sin), _const(ops, [-1, KVH * D], np.int64), False)
    attn = _paged_attention(ops, q, k, v, kc, vc, pa, D ** -0.5, KVH, D)
    x = ops.add(x, _linear(ops, attn, L.o, L.o_bias, qs("self_attn.o_proj")))
    h = _rms(ops, x, L.post_norm, eps)
    gate, up = ops.split(_linear(ops, h, L.gate_up, None, qs("mlp.gate_up_proj")), _const(ops, -1, np.int64),
                         2).outputs()
    return ops.add(x, _linear(ops, ops.multiply(ops.swish(gate), up), L.down, None, qs("mlp.down_proj")))


def build(spec: DecoderSpec, layers: tuple[int, int], *, head: bool) -> ov.Model:
    """Layers ``[a, b)`` of the model; ``head``: end in the final norm and head over ``logit_rows``
    (the last layer of the model, or an early exit), else return the hidden state."""
    import openvino as ov
    import openvino.opset13 as ops

    a, b = layers
    w = spec.weights()
    params: list[Any] = []

    def param(name: str, shape: list[int], t: Any) -> Any:
        p = ops.parameter(ov.PartialShape(shape), t, name=name)
        p.output(0).get_tensor().set_names({name})
        params.append(p)
        return p

    i64, i32 = ov.Type.i64, ov.Type.i32
    if a == 0:
        ids = param("input_ids", [-1], i64)
        eq = (spec.quantization or {}).get("model.embed_tokens")
        if eq is None:
            x = ops.gather(_const(ops, w.embed), ids, _const(ops, 0, np.int64))
        else:  # int8 rows and a scale per row, gathered then scaled
            from dspark.sdk import quantize_weight

            qe = quantize_weight(np.asarray(w.embed.T, dtype=np.float32), eq)  # [hidden, vocab], scales [1, vocab]
            rows = ops.gather(ops.constant(np.ascontiguousarray(qe.data.T), dtype=ov.Type.i8), ids,
                              _const(ops, 0, np.int64))
            scale = ops.gather(_const(ops, np.ascontiguousarray(qe.scales.T)), ids, _const(ops, 0, np.int64))
            x = ops.multiply(ops.convert(rows, "f32"), scale)
    else:
        x = param("hidden", [-1, spec.hidden_size], ov.Type.f32)
    pos = param("position_ids", [-1], i64)
    pa = {n: param(n, [-1], i32) for n in PA_INPUTS}
    pa["max_context_len"] = param("max_context_len", [], i32)
    cos_t, sin_t = spec.rope(spec.max_position_embeddings)
    axis0 = _const(ops, 0, np.int64)
    cos = ops.unsqueeze(ops.gather(_const(ops, cos_t), pos, axis0), _const(ops, 1, np.int64))
    sin = ops.unsqueeze(ops.gather(_const(ops, sin_t), pos, axis0), _const(ops, 1, np.int64))
    for n in range(a, b):
        kc = param(f"key_cache.{n}", [-1, -1, -1, -1], ov.Type.dynamic)
        vc = param(f"value_cache.{n}", [-1, -1, -1, -1], ov.Type.dynamic)
        x = _layer(ops, spec, n, w.layers[n], x, cos, sin, kc, vc, pa)
    if head:
        rows = param("logit_rows", [-1], i64)
        x = _rms(ops, ops.gather(x, rows, axis0), w.norm, spec.rms_norm_eps)
        out = _linear(ops, x, w.head, None, (spec.quantization or {}).get("lm_head"))
        name = "logits"
    else:
        out, name = x, "hidden"
    res = ops.result(out)
    res.output(0).get_tensor().set_names({name})
    return ov.Model([res], params, f"{spec.name}-layers-{a}-{b}")
