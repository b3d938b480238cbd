"""The LLM decoder (or a range of its layers) as one ONNX graph for ONNX Runtime (plugin API 1.6).

One graph runs every layer of a group of sequences that share a query shape
``[B, S]`` (a batch of decode rows, right-padded first prompts, or one chunk
with a past); :mod:`dspark_plugins_npu.decoder` splits a step into such runs.
Attention is ``com.microsoft.GroupQueryAttention``, which the CPU execution
provider runs natively: each sequence's past K/V is gathered from the paged
cache by its block table inside the graph (``[num_blocks, block_size, KVH,
D]`` per layer, fed as inputs that share the host arrays' memory), and the
new rows' K/V (after RoPE) come out stacked ``[layers, B*S, KVH, D]`` for the
host to write into the blocks with one numpy assignment per run.

Weights are not serialized: every initializer is marked external and handed
to the session from memory (``SessionOptions.add_external_initializers``), so
the sessions of one model (early exits included) share the spec's own arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dspark.sdk import decoder as dec

OPSET = 17
MS = "com.microsoft"
IR_VERSION = 8  # what onnxruntime 1.2x-1.3x all load

# Inputs of every graph (names the host feeds).
IDS, HIDDEN_IN, COS, SIN = "input_ids", "hidden_in", "cos", "sin"
TABLE, PAST_MAX, SEQLENS, TOTAL = "block_table", "past_max", "seqlens_k", "total_sequence_length"
ROWS = "logit_rows"
# Outputs.
LOGITS, HIDDEN_OUT, K_NEW, V_NEW = "logits", "hidden_out", "k_new", "v_new"


def k_cache(i: int) -> str:
    return f"k_cache.{i}"


def v_cache(i: int) -> str:
    return f"v_cache.{i}"


@dataclass
class Built:
    """A graph and the arrays its external initializers stand for (name -> C-contiguous float32)."""

    model: Any  # onnx.ModelProto
    weights: dict[str, np.ndarray]
    num_layers: int  # layers the graph runs (its K/V outputs' first dimension)
    head: bool  # ends with the final norm and LM head (logits) rather than the hidden state


@dataclass
class _Builder:
    """Accumulates nodes and externally-held initializers; names are unique per graph."""

    nodes: list[Any] = field(default_factory=list)
    inits: list[Any] = field(default_factory=list)
    weights: dict[str, np.ndarray] = field(default_factory=dict)
    n: int = 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", skip: tuple[int, ...] = (),
           **attrs: Any) -> list[str]:
        """A node with ``n_out`` named outputs; ``skip``: optional output slots left empty among them."""
        from onnx import helper

        self.n += 1
        outs = [f"{op_type.lower()}_{self.n}_{i}" for i in range(n_out)]
        slots = list(outs)
        for i in skip:
            slots.insert(i, "")
        self.nodes.append(helper.make_node(op_type, inputs, slots, name=f"{op_type}_{self.n}", domain=domain,
                                           **attrs))
        return outs

    def op1(self, op_type: str, inputs: list[str], domain: str = "", **attrs: Any) -> str:
        return self.op(op_type, inputs, 1, domain, **attrs)[0]

    def const(self, name: str, values: list[int] | int) -> str:
        """A small int64 constant (a scalar for an int), serialized in the graph."""
        from onnx import numpy_helper

        if name not in self.weights and all(t.name != name for t in self.inits):
            self.inits.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), name))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """An external initializer: the graph names it, the session gets the array from memory."""
        from onnx import TensorProto

        a = np.asarray(array, dtype=np.float32)
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(a.shape))
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", "dspark-in-memory"), ("offset", "0"), ("length", str(a.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.inits.append(t)
        self.weights[name] = a
        return name

    def linear(self, x: str, w: np.ndarray, name: str, bias: np.ndarray | None = None) -> str:
        """x @ w (w is [in, out]). A transposed view (the engine keeps o/down as [out, in]) runs as
        Gemm with transB over the contiguous original: no copy of the weight."""
        if not w.flags.c_contiguous and w.T.flags.c_contiguous:
            ins = [x, self.weight(name, w.T)] + ([self.weight(name + ".bias", bias)] if bias is not None else [])
            return self.op1("Gemm", ins, transB=1)
        y = self.op1("MatMul", [x, self.weight(name, w)])
        return y if bias is None else self.op1("Add", [y, self.weight(name + ".bias", bias)])


def build(spec: dec.DecoderSpec, weights: dec.DecoderWeights, stop: int | None = None) -> Built:
    """The graph of ``spec.layers`` (or of its layers up to ``stop``, an early exit, then the head)."""
    from onnx import TensorProto, helper

    a, b = spec.layers
    end = b if stop is None else stop
    if not a < end <= b:
        raise ValueError(f"layers [{a}, {end}) are not a non-empty part of the range {spec.layers}")
    head = stop is not None or spec.last
    g = _Builder()
    F, I64, I32 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT32
    KVH, D, hid = spec.num_kv_heads, spec.head_dim, spec.hidden_size
    inputs = [helper.make_tensor_value_info(COS, F, ["N", D]), helper.make_tensor_value_info(SIN, F, ["N", D]),
              helper.make_tensor_value_info(TABLE, I64, ["B", "NB"]), helper.make_tensor_value_info(PAST_MAX, I64, [1]),
              helper.make_tensor_value_info(SEQLENS, I32, ["B"]), helper.make_tensor_value_info(TOTAL, I32, [])]
    if spec.first:
        inputs.insert(0, helper.make_tensor_value_info(IDS, I64, ["N"]))
        x = g.op1("Gather", [g.weight("embed", weights.embed), IDS])
    else:
        inputs.insert(0, helper.make_tensor_value_info(HIDDEN_IN, F, ["N", hid]))
        x = HIDDEN_IN
    if head:
        inputs.append(helper.make_tensor_value_info(ROWS, I64, ["R"]))
    ctx = _step_shapes(g, spec)
    ks, vs = [], []
    for li in range(a, end):
        i = li - a
        inputs += [helper.make_tensor_value_info(k_cache(i), F, ["blocks", "block_size", KVH, D]),
                   helper.make_tensor_value_info(v_cache(i), F, ["blocks", "block_size", KVH, D])]
        x, k, v = _layer(g, spec, weights.layers[li], f"l{li}", x, ctx, k_cache(i), v_cache(i))
        ks.append(g.op1("Unsqueeze", [k, g.const("axis0", [0])]))
        vs.append(g.op1("Unsqueeze", [v, g.const("axis0", [0])]))
    g.nodes.append(helper.make_node("Concat", ks, [K_NEW], axis=0) if len(ks) > 1
                   else helper.make_node("Identity", ks, [K_NEW]))
    g.nodes.append(helper.make_node("Concat", vs, [V_NEW], axis=0) if len(vs) > 1
                   else helper.make_node("Identity", vs, [V_NEW]))
    kv_out = [helper.make_tensor_value_info(n, F, [end - a, "N", KVH, D]) for n in (K_NEW, V_NEW)]
    if head:
        rows = g.op1("Gather", [x, ROWS])  # only the rows whose logits are wanted meet the head
        hn = g.op1("SimplifiedLayerNormalization", [rows, g.weight("norm", weights.norm)], axis=-1,
                   epsilon=spec.rms_norm_eps)
        g.nodes.append(helper.make_node("MatMul", [hn, g.weight("head", weights.head)], [LOGITS]))
        outputs = [helper.make_tensor_value_info(LOGITS, F, ["R", spec.vocab_size])]
    else:
        g.nodes.append(helper.make_node("Identity", [x], [HIDDEN_OUT]))
        outputs = [helper.make_tensor_value_info(HIDDEN_OUT, F, ["N", hid])]
    graph = helper.make_graph(g.nodes, f"dspark_decoder_{a}_{end}", inputs, outputs + kv_out, initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="dspark", ir_version=IR_VERSION)
    return Built(model=model, weights=g.weights, num_layers=end - a, head=head)


@dataclass(frozen=True)
class _Ctx:
    """Shapes computed once per run and shared by all layers."""

    q3: str  # [B, -1, H*D]: GQA's query layout
    kv3: str  # [B, -1, KVH*D]
    slots: str  # [B, P, 2]: (block, offset) of each sequence's past positions, P the longest past
    cos: str  # [N, 1, D]
    sin: str


def _step_shapes(g: _Builder, spec: dec.DecoderSpec) -> _Ctx:
    H, KVH, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    batch = g.op1("Shape", [SEQLENS])  # [B]
    q3 = g.op1("Concat", [batch, g.const("q_tail", [-1, H * D])], axis=0)
    kv3 = g.op1("Concat", [batch, g.const("kv_tail", [-1, KVH * D])], axis=0)
    # (block, offset) of every position the tables cover, cut to the longest past. GQA refuses a past
    # buffer P with P < total < P + new (total: the longest past + the query length), which whole
    # blocks would often be; exactly the longest past is always accepted, and copies no more.
    bs = g.op1("Shape", [k_cache(0)], start=1, end=2)  # [1]
    offs = g.op1("Range", [g.const("zero", 0), g.op1("Squeeze", [bs]), g.const("one", 1)])
    grid = g.op1("Concat", [g.op1("Shape", [TABLE]), bs], axis=0)  # [B, NB, bs]
    blk = g.op1("Expand", [g.op1("Unsqueeze", [TABLE, g.const("axis2", [2])]), grid])
    pair = g.op1("Concat", [g.op1("Unsqueeze", [blk, g.const("axis3", [3])]),
                            g.op1("Unsqueeze", [g.op1("Expand", [offs, grid]), g.const("axis3", [3])])], axis=3)
    flat = g.op1("Reshape", [pair, g.op1("Concat", [batch, g.const("pair_tail", [-1, 2])], axis=0)])
    slots = g.op1("Slice", [flat, g.const("zero1", [0]), PAST_MAX, g.const("axis1", [1])])
    cos = g.op1("Unsqueeze", [COS, g.const("axis1", [1])])
    sin = g.op1("Unsqueeze", [SIN, g.const("axis1", [1])])
    return _Ctx(q3, kv3, slots, cos, sin)


def _rope(g: _Builder, x: str, ctx: _Ctx, half: int) -> str:
    """Rotate-half RoPE on [N, heads, D], as transformers' apply_rotary_pos_emb."""
    x1, x2 = g.op("Split", [x, g.const("halves", [half, half])], 2, axis=-1)
    rot = g.op1("Concat", [g.op1("Neg", [x2]), x1], axis=-1)
    return g.op1("Add", [g.op1("Mul", [x, ctx.cos]), g.op1("Mul", [rot, ctx.sin])])


def _heads(g: _Builder, x: str, n: int, d: int, norm: np.ndarray | None, name: str, eps: float) -> str:
    """[N, n*d] -> [N, n, d], with the per-head RMSNorm (qk_norm) when the model has one."""
    y = g.op1("Reshape", [x, g.const(f"heads_{n}_{d}", [0, n, d])])
    if norm is None:
        return y
    return g.op1("SimplifiedLayerNormalization", [y, g.weight(name, norm)], axis=-1, epsilon=eps)


def _past(g: _Builder, cache: str, ctx: _Ctx) -> str:
    """The sequences' cached positions as GQA's BNSH past, gathered from the blocks."""
    return g.op1("Transpose", [g.op1("GatherND", [cache, ctx.slots])], perm=[0, 2, 1, 3])


def _layer(g: _Builder, spec: dec.DecoderSpec, w: dec.LayerWeights, p: str, x: str, ctx: _Ctx,
           kc: str, vc: str) -> tuple[str, str, str]:
    """One decoder layer on the flat rows x [N, hidden]; returns (x, new K [N, KVH, D], new V)."""
    H, KVH, D, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
    h = g.op1("SimplifiedLayerNormalization", [x, g.weight(p + ".in_norm", w.in_norm)], axis=-1, epsilon=eps)
    qkv = g.linear(h, w.qkv, p + ".qkv", w.qkv_bias)
    q, k, v = g.op("Split", [qkv, g.const(f"qkv_split_{p}", [H * D, KVH * D, KVH * D])], 3, axis=-1)
    q = _rope(g, _heads(g, q, H, D, w.q_norm, p + ".q_norm", eps), ctx, D // 2)
    k = _rope(g, _heads(g, k, KVH, D, w.k_norm, p + ".k_norm", eps), ctx, D // 2)
    v = _heads(g, v, KVH, D, None, "", eps)
    # present_key/value must be named: without them the CPU kernel attends over an unfilled buffer.
    attn = g.op("GroupQueryAttention", [
        g.op1("Reshape", [q, ctx.q3]), g.op1("Reshape", [k, ctx.kv3]), g.op1("Reshape", [v, ctx.kv3]),
        _past(g, kc, ctx), _past(g, vc, ctx), SEQLENS, TOTAL], 3, domain=MS, num_heads=H, kv_num_heads=KVH,
        scale=float(D ** -0.5))[0]
    o = g.linear(g.op1("Reshape", [attn, g.const("flat", [-1, H * D])]), w.o, p + ".o", w.o_bias)
    # Residual add and the MLP's norm in one kernel: outputs 0 (normed) and 3 (the sum).
    h2, x2 = g.op("SkipSimplifiedLayerNormalization", [o, x, g.weight(p + ".post_norm", w.post_norm)], 2,
                  domain=MS, skip=(1, 2), epsilon=eps)
    gate, up = g.op("Split", [g.linear(h2, w.gate_up, p + ".gate_up"),
                              g.const("gu_split", [spec.intermediate_size] * 2)], 2, axis=-1)
    act = g.op1("Mul", [g.op1("Mul", [gate, g.op1("Sigmoid", [gate])]), up])  # SwiGLU
    return g.op1("Add", [x2, g.linear(act, w.down, p + ".down")]), k, v
