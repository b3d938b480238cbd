"""The ops of dspark's one decoder definition (:func:`dspark.sdk.family.forward`) as OpenVINO nodes.

``forward`` runs once per compiled range and these ops build its graph, in the
patterns OpenVINO's CPU plugin fuses: embedding ``Gather``, RMSNorm as
``RMSFusion`` recognises it, projections as ``MatMul`` on ``[out, in]`` weights
(``transpose_b``, the fully-connected layout) or the weight-compression pattern
for int8/int4, rotate-half RoPE written with ``Slice`` and a multiply by -1 (one
fused RoPE node), one ``PagedAttentionExtension`` per layer (the node OpenVINO
GenAI's graphs use; its KV inputs ``key_cache.N``/``value_cache.N`` the caller
allocates), and the head over only the rows in ``logit_rows``. Inputs follow
:class:`dspark.sdk.decoder.StepBatch`. A model whose attention scores are
soft-capped (which the paged operation cannot do) attends in the graph over the
past it gathers instead (:mod:`.gathered`), and returns each layer's new K/V as
outputs ``key_new.N``/``value_new.N``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark.sdk.decoder import BlockPart, BlockWeight, Unpacked
from dspark.sdk.family import Attention, forward, stored_weights

if TYPE_CHECKING:
    import openvino as ov

    from dspark.sdk.decoder import DecoderSpec
    from dspark.sdk import MappedWeights
    from dspark.types import QuantSpec

_HALF = {"bfloat16": "bf16", "float16": "f16"}  # numpy dtype name of a stored weight -> OpenVINO type
_TYPES = {**_HALF, "float32": "f32"}
LAYOUT = 2  # the weights' layout in the graph (a store's cache key): bump when it changes (2: GGUF blocks mapped)
_DECOMPRESSION = "decompression_0"  # rt_info key OpenVINO's Decompression attribute is stored under
PA_INPUTS = ("past_lens", "subsequence_begins", "block_indices", "block_indices_begins")
I64 = np.int64


class OpenVINOOps:
    """:class:`dspark.sdk.family.DecoderOps` that build an OpenVINO graph (``openvino.opset13`` nodes)."""

    # PagedAttentionExtension has no soft-cap input: a soft-capped model attends over the gathered past.
    variants = frozenset({"activation.gelu", "activation.gelu_tanh", "attention.window", "attention.softcap",
                          "rope.partial", "softcap", "linear.int8", "linear.int4", "embed.int8", "linear.blocks"})
    # GGUF types whose blocks it holds as compressed weights (linear.blocks); float parts run as stored
    block_types = frozenset({"Q8_0", "Q5_0", "Q6_K", "Q4_0", "Q4_K"})

    def __init__(self, spec: DecoderSpec, store: MappedWeights | None = None) -> None:
        import openvino as ov
        import openvino.opset13 as ops

        self.ov, self.o, self.spec = ov, ops, spec
        self.store = store  # the weights' constants read from its mapped file (held once: dspark.sdk.mapped)
        self.params: list[Any] = []
        self._inputs: dict[str, Any] = {}
        self._tables: dict[int, tuple[Any, Any]] = {}
        self.gathered = spec.attn_softcap is not None  # attention over the gathered past (.gathered)
        self.kv_out: list[tuple[str, Any]] = []  # gathered: (output name, node) of each layer's new K and V
        self.windows: set[int | None] = set()  # gathered: the window sizes whose masks the graph takes

    # -- graph inputs ---------------------------------------------------------------------------

    def param(self, name: str, shape: list[int], t: Any) -> Any:
        if name not in self._inputs:
            p = self.o.parameter(self.ov.PartialShape(shape), t, name=name)
            p.output(0).get_tensor().set_names({name})
            self.params.append(p)
            self._inputs[name] = p
        return self._inputs[name]

    def const(self, a: Any, dtype: Any = np.float32) -> Any:
        return self.o.constant(np.asarray(a, dtype=dtype))

    def _stored(self, a: np.ndarray) -> Any:
        """A weight as a constant of its own precision (``spec.weights(stored=True)``): with a store, over the
        store's mapping of it; else OpenVINO's own copy, so that the engine may drop its tensors."""
        kind = _TYPES.get(a.dtype.name)
        if kind is None:
            return self.const(a)
        a = np.ascontiguousarray(a) if self.store is None else self.store.add(a)
        bits = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
        return self.ov.op.Constant(self.ov.Tensor(bits, list(a.shape), getattr(self.ov.Type, kind)),
                                   shared_memory=self.store is not None)

    def weight(self, a: np.ndarray) -> Any:
        """A projection's weight as the MatMul takes it (float32): a half-precision one is kept so and
        widened by a Convert marked as weight decompression, the pattern of OpenVINO's own half-precision
        IR, which its CPU plugin packs for its kernels as they are; unmarked, the compile folds the
        Convert and keeps a float32 copy beside the packed one."""
        c = self._stored(a)
        if a.dtype.name not in _HALF:
            return c
        widened = self.o.convert(c, "f32")
        widened.get_rt_info()[_DECOMPRESSION] = ""  # the key of ov::mark_as_decompression; its value is unused
        return widened

    def _positions(self) -> Any:
        return self.param("position_ids", [-1], self.ov.Type.i64)

    def _pa(self) -> dict[str, Any]:
        pa = {n: self.param(n, [-1], self.ov.Type.i32) for n in PA_INPUTS}
        pa["max_context_len"] = self.param("max_context_len", [], self.ov.Type.i32)
        return pa

    # -- the ops --------------------------------------------------------------------------------

    def tokens(self, table: np.ndarray, quant: QuantSpec | None) -> Any:
        ids = self.param("input_ids", [-1], self.ov.Type.i64)
        self._positions()  # every range takes positions, in the same order as before
        if isinstance(table, BlockWeight):  # a GGUF file's table as stored: its rows gathered, then decompressed
            return self._block_rows(table.parts[0], ids)
        if quant is None:
            rows = self.o.gather(self._stored(table), ids, self.const(0, I64))
            return rows if table.dtype.name not in _HALF else self.o.convert(rows, "f32")  # the rows widened
        from dspark.sdk import quantize_weight

        qe = quantize_weight(np.asarray(table.T, dtype=np.float32), quant)  # [hidden, vocab], scales [1, vocab]
        rows = self.o.gather(self._int_constant(np.ascontiguousarray(qe.data.T), self.ov.Type.i8), ids,
                             self.const(0, I64))
        scale = self.o.gather(self._scales(np.ascontiguousarray(qe.scales.T)), ids, self.const(0, I64))
        return self.o.multiply(self.o.convert(rows, "f32"), scale)

    def hidden_in(self) -> Any:
        self._positions()
        return self.param("hidden", [-1, self.spec.hidden_size], self.ov.Type.f32)

    def scale(self, x: Any, factor: float) -> Any:
        return self.o.multiply(x, self.const(factor))

    def rms_norm(self, x: Any, weight: np.ndarray, eps: float) -> Any:
        # x / sqrt(mean(x^2) + eps) * w, the shape OpenVINO fuses into its RMS kernel.
        o = self.o
        var = o.reduce_mean(o.power(x, self.const(2.0)), self.const([-1], I64), keep_dims=True)
        return o.multiply(o.divide(x, o.sqrt(o.add(var, self.const(eps)))), self.const(weight))

    def _int_constant(self, values: np.ndarray, kind: Any) -> Any:
        """An integer weight constant of ``kind`` (u4, i4, u8, i8) from one value a byte; 4-bit kinds packed here
        two a byte, low nibble first, as OpenVINO stores them (its ``constant(..., dtype=u4)`` goes through a
        Python list of every value: most of a 0.5B file's load). With a store, over its mapping (the pages
        dropped once OpenVINO has packed them), as the float weights are."""
        ov = self.ov
        four = kind in (ov.Type.u4, ov.Type.i4)
        one_byte = np.uint8 if kind in (ov.Type.u4, ov.Type.u8) else np.int8
        flat = np.ascontiguousarray(values, dtype=one_byte).reshape(-1)
        if four:
            flat = flat.view(np.uint8)
            if flat.size % 2:
                flat = np.concatenate([flat, np.zeros(1, np.uint8)])
            flat = (flat[0::2] & 15) | (flat[1::2] << 4)
        shape = ov.Shape(list(values.shape))
        if self.store is not None:
            return ov.op.Constant(ov.Tensor(self.store.add(flat), shape, kind), shared_memory=True)
        tensor = ov.Tensor(kind, shape)  # owns its bytes: read again after compile_model
        tensor.data[:] = flat.view(tensor.data.dtype).reshape(tensor.data.shape)
        return self.o.constant(tensor)

    def _scales(self, a: np.ndarray) -> Any:
        """A float32 constant of a compressed weight's scales or zero points (a GGUF file's blocks, a quantization
        plan's): over the store's mapping where there is one, as the weight's integers are (a 4-bit weight's
        scales are a quarter of its bytes)."""
        return self._stored(np.asarray(a, dtype=np.float32)) if self.store is not None else self.const(a)

    def _compressed(self, w: np.ndarray, q: QuantSpec) -> Any:
        """``w`` [in, out] quantized as the canonical rounding does (dspark.sdk.quant), as the weight-compression
        pattern OpenVINO's CPU plugin runs natively: int8/int4 constant -> Convert -> Multiply(scales), [out, in]."""
        from dspark.sdk import quantize_weight, unpack_int4

        o, ov = self.o, self.ov
        qw = quantize_weight(np.asarray(w, dtype=np.float32), q)
        k, n = qw.shape
        vals = unpack_int4(qw.data, k) if qw.bits == 4 else qw.data  # int8 [K, N]
        g, groups = qw.group_size, qw.scales.shape[0]
        kind = ov.Type.i8 if qw.bits == 8 else ov.Type.i4
        if groups == 1:
            c = self._int_constant(np.ascontiguousarray(vals.T), kind)
            return o.multiply(o.convert(c, "f32"), self._scales(np.ascontiguousarray(qw.scales.T)))
        padded = np.zeros((groups * g, n), dtype=np.int8)
        padded[:k] = vals
        blocks = np.ascontiguousarray(padded.reshape(groups, g, n).transpose(2, 0, 1))  # [out, groups, g]
        deq = o.multiply(o.convert(self._int_constant(blocks, kind), "f32"),
                         self._scales(np.ascontiguousarray(qw.scales.T)[:, :, None]))
        flat = o.reshape(deq, self.const([n, groups * g], I64), False)
        if groups * g != k:
            flat = o.slice(flat, self.const([0], I64), self.const([k], I64), self.const([1], I64),
                           self.const([1], I64))
        return flat

    def _block_rows(self, part: BlockPart, ids: Any) -> Any:
        """Rows ``ids`` of a GGUF table ``[vocab, hidden]``: integers, scales and zero points gathered by row, so
        the table stays in the file's precision (4-bit values as u8: OpenVINO gathers bytes)."""
        o, ov = self.o, self.ov
        axis = self.const(0, I64)
        if part.is_float:
            return o.convert(o.gather(self._stored(np.ascontiguousarray(part.values())), ids, axis), "f32")
        u = part.unpack()
        rows = o.convert(o.gather(self._int_constant(u.q, ov.Type.i8 if u.bits == 8 else ov.Type.u8), ids, axis),
                         "f32")
        if u.zero is not None:
            rows = o.subtract(rows, self.const(u.zero) if u.zero.ndim == 0
                              else o.gather(self._scales(u.zero), ids, axis))
        rows = o.multiply(rows, o.gather(self._scales(u.scale), ids, axis))
        return o.reshape(rows, self.const([-1, part.cols], I64), False)

    def _block_matmul(self, x: Any, parts: list[BlockPart]) -> Any:
        """``x @ W.T`` for parts of one block type. A float zero point per group (Q4_K's minimum) keeps OpenVINO
        from quantizing the activations (its dynamic quantization takes integer zero points only), so such a
        weight runs as ``x @ (scale * q).T - (x summed per group) @ (zero * scale).T``: the same values, the
        4-bit integers without a zero point."""
        us = [p.unpack() for p in parts] if not parts[0].is_float else []
        if not us or us[0].zero is None or us[0].zero.ndim == 0:
            return self.o.matmul(x, self._blocks(parts, us), transpose_a=False, transpose_b=True)
        o = self.o
        low = np.concatenate([u.zero * u.scale for u in us])  # type: ignore[operator]
        n, groups, g = low.shape[0], low.shape[1], parts[0].group
        y = o.matmul(x, self._blocks(parts, [replace(u, zero=None) for u in us]), transpose_a=False, transpose_b=True)
        sums = o.reduce_sum(o.reshape(x, self.const([-1, groups, g], I64), False), self.const([2], I64), False)
        return o.subtract(y, o.matmul(sums, self._scales(low.reshape(n, groups)), transpose_a=False,
                                      transpose_b=True))

    def _blocks(self, parts: list[BlockPart], us: list[Unpacked] | None = None) -> Any:
        """Parts of one GGUF block type (or one float part) as one weight ``[out, in]``: the blocks unpacked
        (one tensor at a time) into OpenVINO's weight-compression pattern, u4 or i8 constant -> Convert ->
        Subtract(zero) -> Multiply(scale) -> Reshape, which its CPU plugin runs as a compressed
        FullyConnected; no float copy of the weight is made."""
        o, ov = self.o, self.ov
        if parts[0].is_float:
            return self.weight(np.ascontiguousarray(parts[0].values()))
        us = us or [p.unpack() for p in parts]
        q = us[0].q if len(us) == 1 else np.concatenate([u.q for u in us])
        n, groups, g = q.shape
        c = self._int_constant(q, ov.Type.i8 if us[0].bits == 8 else ov.Type.u4)
        w = o.convert(c, "f32")
        zeros = [u.zero for u in us]
        if zeros[0] is not None:
            zero = zeros[0] if zeros[0].ndim == 0 else np.concatenate(zeros)  # type: ignore[arg-type]
            w = o.subtract(w, self.const(zero) if zero.ndim == 0 else self._scales(zero))
        w = o.multiply(w, self._scales(us[0].scale if len(us) == 1 else np.concatenate([u.scale for u in us])))
        return o.reshape(w, self.const([n, groups * g], I64), False)

    def linear(self, x: Any, weight: np.ndarray | BlockWeight, bias: np.ndarray | None, quant: QuantSpec | None,
               name: str) -> Any:
        # [out, in] (the fully-connected layout OpenVINO's CPU plugin packs), or compressed per quant.
        if isinstance(weight, BlockWeight):  # a GGUF file's tensors: one MatMul per run of parts of one type
            runs: list[list[BlockPart]] = []
            for p in weight.parts:
                if runs and p.ggml_type == runs[-1][0].ggml_type and not p.is_float:
                    runs[-1].append(p)
                else:
                    runs.append([p])
            ys = [self._block_matmul(x, r) for r in runs]
            y = ys[0] if len(ys) == 1 else self.o.concat(ys, -1)
        else:
            w = self.weight(np.ascontiguousarray(weight.T)) if quant is None else self._compressed(weight, quant)
            y = self.o.matmul(x, w, transpose_a=False, transpose_b=True)
        return y if bias is None else self.o.add(y, self.const(bias))

    def split(self, x: Any, sizes: list[int]) -> list[Any]:
        if len(set(sizes)) == 1:  # an even split, as the gate/up MLP fusion matches it
            return list(self.o.split(x, self.const(-1, I64), len(sizes)).outputs())
        return list(self.o.variadic_split(x, self.const(-1, I64), self.const(sizes, I64)).outputs())

    def heads(self, x: Any, num: int, dim: int) -> Any:
        return self.o.reshape(x, self.const([-1, num, dim], I64), False)

    def _table(self, index: int) -> tuple[Any, Any]:
        """cos and sin [T, 1, rotary] of the rows' positions, gathered once per table and shared by the layers."""
        if index not in self._tables:
            cos_t, sin_t = self.spec.rope_at(index, self.spec.rope_table_rows)
            pos, axis0 = self._positions(), self.const(0, I64)
            cos = self.o.unsqueeze(self.o.gather(self.const(cos_t), pos, axis0), self.const(1, I64))
            sin = self.o.unsqueeze(self.o.gather(self.const(sin_t), pos, axis0), self.const(1, I64))
            self._tables[index] = (cos, sin)
        return self._tables[index]

    def _cut(self, x: Any, start: int, stop: int) -> Any:
        return self.o.slice(x, self.const([start], I64), self.const([stop], I64), self.const([1], I64),
                            self.const([2], I64))

    def rope(self, x: Any, table: int) -> Any:
        # x * cos + rotate_half(x) * sin, written with Slice and a multiply by -1: the form OpenVINO's RoPE
        # fusion matches (one fused node instead of six ops).
        cos, sin = self._table(table)
        d = x.get_output_partial_shape(0)[2].get_length()
        rd = self.spec.rotary
        part = x if rd == d else self._cut(x, 0, rd)
        half = rd // 2
        rot = self.o.concat([self.o.multiply(self._cut(part, half, rd), self.const(-1.0)), self._cut(part, 0, half)],
                            -1)
        out = self.o.add(self.o.multiply(part, cos), self.o.multiply(rot, sin))
        return out if rd == d else self.o.concat([out, self._cut(x, rd, d)], -1)

    def attention(self, q: Any, k: Any, v: Any, spec: Attention) -> Any:
        return self._gathered(q, k, v, spec) if self.gathered else self._paged(q, k, v, spec)

    def _gathered(self, q: Any, k: Any, v: Any, spec: Attention) -> Any:
        """softmax(softcap(q . [past; k] * scale) + mask) . [past; v] per head, the past gathered from the
        layer's host blocks at ``past_slots``; grouped-query heads share their KV head."""
        from dspark_plugins_cpu.decoder.gathered import mask_name

        o, i64 = self.o, I64
        H, KVH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        slots = self.param("past_slots", [-1], self.ov.Type.i64)
        self.windows.add(spec.window)
        mask = self.param(mask_name(spec.window), [-1, -1], self.ov.Type.f32)
        both = []
        for kind, new in (("key", k), ("value", v)):
            cache = self.param(f"{kind}_cache.{spec.layer}", [-1, -1, KVH, D], self.ov.Type.f32)
            past = o.gather(o.reshape(cache, self.const([-1, KVH, D], i64), False), slots, self.const(0, i64))
            self.kv_out.append((f"{kind}_new.{spec.layer}", new))
            rows = o.concat([past, new], 0)  # [K, KVH, D]
            if H != KVH:  # each KV head repeated for its group of query heads
                rows = o.reshape(o.tile(o.unsqueeze(rows, self.const(2, i64)), self.const([1, 1, H // KVH, 1], i64)),
                                 self.const([-1, H, D], i64), False)
            both.append(o.transpose(rows, self.const([1, 0, 2], i64)))  # [H, K, D]
        keys, values = both
        scores = o.multiply(o.matmul(o.transpose(q, self.const([1, 0, 2], i64)), keys, False, True),
                            self.const(spec.scale))  # [H, T, K]
        if spec.softcap is not None:
            scores = self.softcap(scores, spec.softcap)
        probs = o.softmax(o.add(scores, mask), -1)
        out = o.transpose(o.matmul(probs, values, False, False), self.const([1, 0, 2], i64))  # [T, H, D]
        return o.reshape(out, self.const([-1, H * D], i64), False)

    def _paged(self, q: Any, k: Any, v: Any, spec: Attention) -> Any:
        """The 28-input PagedAttentionExtension of OpenVINO 2026.4, with the optional inputs empty as
        ``paged_attention_transformation`` leaves them (checked against a transformed export)."""
        from openvino._pyopenvino.op import _PagedAttentionExtension

        H, KVH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
        flat = [self.o.reshape(t, self.const([-1, n * D], I64), False) for t, n in ((q, H), (k, KVH), (v, KVH))]
        kc = self.param(f"key_cache.{spec.layer}", [-1, -1, -1, -1], self.ov.Type.dynamic)
        vc = self.param(f"value_cache.{spec.layer}", [-1, -1, -1, -1], self.ov.Type.dynamic)
        pa = self._pa()
        i32, f32 = np.int32, np.float32
        empty_i, empty_f = self.const(np.zeros(0, i32), i32), self.const(np.zeros(0, f32))
        args = [*flat, kc, vc, *(pa[n] for n in PA_INPUTS),
                self.const(spec.scale), self.const(spec.window or 0, i32), empty_f, pa["max_context_len"],
                empty_i, empty_i, empty_i, empty_f, empty_f, self.const(0, i32), self.const(0, i32),
                self.const(np.zeros((0, 0, 0, 0), f32)), self.const(0, i32), empty_i, empty_i, empty_i, empty_i,
                self.const(np.zeros(0, np.uint8), np.uint8), empty_i]
        node = _PagedAttentionExtension([a.output(0) if hasattr(a, "output") else a for a in args])
        # The CPU plugin sizes its cache layout from these (the transformation sets them the same way).
        for key, value in (("num_k_heads", KVH), ("k_head_size", D), ("num_v_heads", KVH), ("v_head_size", D)):
            node.get_rt_info()[key] = value
        return node.output(0)

    def activation(self, x: Any, kind: str) -> Any:
        if kind == "silu":
            return self.o.swish(x)
        return self.o.gelu(x, approximation_mode="tanh" if kind == "gelu_tanh" else "erf")

    def mul(self, a: Any, b: Any) -> Any:
        return self.o.multiply(a, b)

    def add(self, a: Any, b: Any) -> Any:
        return self.o.add(a, b)

    def logit_rows(self, x: Any) -> Any:
        return self.o.gather(x, self.param("logit_rows", [-1], self.ov.Type.i64), self.const(0, I64))

    def softcap(self, x: Any, cap: float) -> Any:
        return self.o.multiply(self.o.tanh(self.o.divide(x, self.const(cap))), self.const(cap))


def build(spec: DecoderSpec, layers: tuple[int, int], *, head: bool, ops: OpenVINOOps | None = None,
          store: MappedWeights | None = None) -> ov.Model:
    """Layers ``[a, b)`` of the model as an OpenVINO model; ``head``: end in the final norm and head over
    ``logit_rows`` (the last layer of the model, or an early exit), else return the hidden state.
    ``store``: the float weights' constants over its mapped file instead of copies of their own."""
    ops = ops or OpenVINOOps(spec, store)
    out = forward(spec, ops, layers, head=head, weights=stored_weights(spec))
    res = ops.o.result(out)
    res.output(0).get_tensor().set_names({"logits" if head else "hidden"})
    results = [res]
    for name, node in ops.kv_out:  # gathered attention: the step's K/V, for the caller to store
        r = ops.o.result(node)
        r.output(0).get_tensor().set_names({name})
        results.append(r)
    return ops.ov.Model(results, ops.params, f"{spec.name}-layers-{layers[0]}-{layers[1]}")
