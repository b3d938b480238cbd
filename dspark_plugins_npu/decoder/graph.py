"""The LLM decoder (or a range of its layers) as one ONNX graph for ONNX Runtime (plugin API 1.10).

The model is :func:`dspark.sdk.family.forward`, dspark's one decoder definition;
:class:`OnnxOps` writes its ops as ONNX nodes.

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
from dspark.sdk.family import Attention, forward

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


class OnnxOps:
    """:class:`dspark.sdk.family.DecoderOps` writing ONNX nodes into a :class:`_Builder`.

    Attention is ``com.microsoft.GroupQueryAttention`` over each sequence's past, gathered from the
    paged blocks inside the graph; the rows' new K/V (after RoPE) are kept per layer and come out
    stacked for the host to write into the blocks. cos/sin rows are inputs (``cos``/``sin``, and
    ``cos.N``/``sin.N`` for a second table), fed by the host for the rows' positions.
    """

    # Gelu/FastGelu are ONNX Runtime's contrib kernels; GQA has local_window_size and softcap attributes.
    variants = frozenset({"activation.gelu", "activation.gelu_tanh", "attention.window", "attention.softcap",
                          "rope.partial", "softcap"})

    def __init__(self, spec: dec.DecoderSpec, g: _Builder) -> None:
        from onnx import TensorProto, helper

        self.spec, self.g, self.helper, self.tp = spec, g, helper, TensorProto
        self.inputs: dict[str, Any] = {}
        self.ks: list[str] = []
        self.vs: list[str] = []
        self._ctx: _Ctx | None = None
        self._tables: dict[int, tuple[str, str]] = {}
        self._adds: dict[str, int] = {}  # output of an Add -> its node's index (fused into the norm after it)

    def input(self, name: str, elem: int, shape: list[Any]) -> str:
        if name not in self.inputs:
            self.inputs[name] = self.helper.make_tensor_value_info(name, elem, shape)
        return name

    def fconst(self, name: str, value: float) -> str:
        return self.g.weight(name, np.asarray(value, dtype=np.float32))

    def ctx(self) -> _Ctx:
        if self._ctx is None:
            F, I64, I32 = self.tp.FLOAT, self.tp.INT64, self.tp.INT32
            self.input(TABLE, I64, ["B", "NB"])
            self.input(PAST_MAX, I64, [1])
            self.input(SEQLENS, I32, ["B"])
            self.input(TOTAL, I32, [])
            self.input(k_cache(0), F, ["blocks", "block_size", self.spec.num_kv_heads, self.spec.head_dim])
            self._ctx = _step_shapes(self.g, self.spec)
        return self._ctx

    def tokens(self, table: np.ndarray, quant: Any) -> str:
        assert quant is None, "the npu decoder declines quantized plans"
        return self.g.op1("Gather", [self.g.weight("embed", table), self.input(IDS, self.tp.INT64, ["N"])])

    def hidden_in(self) -> str:
        return self.input(HIDDEN_IN, self.tp.FLOAT, ["N", self.spec.hidden_size])

    def scale(self, x: str, factor: float) -> str:
        return self.g.op1("Mul", [x, self.fconst(f"scale_{self.g.n}", factor)])

    def rms_norm(self, x: str, weight: np.ndarray, eps: float) -> str:
        w = self.g.weight(f"norm_{self.g.n}", weight)
        if x in self._adds:  # residual add and the norm after it in one kernel: outputs 0 (normed) and 3 (the sum)
            i = self._adds.pop(x)
            a, b = self.g.nodes[i].input
            normed = f"skipnorm_{i}"
            self.g.nodes[i] = self.helper.make_node("SkipSimplifiedLayerNormalization", [a, b, w], [normed, "", "", x],
                                                    name=f"SkipNorm_{i}", domain=MS, epsilon=eps)
            return normed
        return self.g.op1("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=eps)

    def linear(self, x: str, weight: np.ndarray, bias: np.ndarray | None, quant: Any, name: str) -> str:
        assert quant is None, "the npu decoder declines quantized plans"
        return self.g.linear(x, weight, name, bias)

    def split(self, x: str, sizes: list[int]) -> list[str]:
        return self.g.op("Split", [x, self.g.const(f"split_{'_'.join(map(str, sizes))}", sizes)], len(sizes), axis=-1)

    def heads(self, x: str, num: int, dim: int) -> str:
        return self.g.op1("Reshape", [x, self.g.const(f"heads_{num}_{dim}", [0, num, dim])])

    def _table(self, index: int) -> tuple[str, str]:
        if index not in self._tables:
            c, s = (COS, SIN) if index == 0 else (f"{COS}.{index}", f"{SIN}.{index}")
            r = self.spec.rotary
            for n in (c, s):
                self.input(n, self.tp.FLOAT, ["N", r])
            axis1 = self.g.const("axis1", [1])
            self._tables[index] = (self.g.op1("Unsqueeze", [c, axis1]), self.g.op1("Unsqueeze", [s, axis1]))
        return self._tables[index]

    def rope(self, x: str, table: int) -> str:
        """Rotate-half RoPE on [N, heads, D] over the first ``spec.rotary`` dims, as transformers'."""
        cos, sin = self._table(table)
        D, rd = self.spec.head_dim, self.spec.rotary
        part, rest = (x, None) if rd == D else self.g.op("Split", [x, self.g.const(f"rot_{rd}_{D}", [rd, D - rd])],
                                                         2, axis=-1)
        x1, x2 = self.g.op("Split", [part, self.g.const(f"halves_{rd}", [rd // 2, rd // 2])], 2, axis=-1)
        rot = self.g.op1("Concat", [self.g.op1("Neg", [x2]), x1], axis=-1)
        out = self.g.op1("Add", [self.g.op1("Mul", [part, cos]), self.g.op1("Mul", [rot, sin])])
        return out if rest is None else self.g.op1("Concat", [out, rest], axis=-1)

    def _past(self, cache: str) -> str:
        """The sequences' cached positions as GQA's BNSH past, gathered from the blocks."""
        return self.g.op1("Transpose", [self.g.op1("GatherND", [cache, self.ctx().slots])], perm=[0, 2, 1, 3])

    def attention(self, q: str, k: str, v: str, spec: Attention) -> str:
        ctx, g = self.ctx(), self.g
        i = spec.layer - self.spec.layers[0]
        F, KVH, D = self.tp.FLOAT, spec.num_kv_heads, spec.head_dim
        kc = self.input(k_cache(i), F, ["blocks", "block_size", KVH, D])
        vc = self.input(v_cache(i), F, ["blocks", "block_size", KVH, D])
        self.ks.append(g.op1("Unsqueeze", [k, g.const("axis0", [0])]))
        self.vs.append(g.op1("Unsqueeze", [v, g.const("axis0", [0])]))
        extra: dict[str, Any] = {}
        if spec.window is not None:  # GQA sees the row itself and the positions before it, local_window_size in all
            extra["local_window_size"] = spec.window
        if spec.softcap is not None:
            extra["softcap"] = float(spec.softcap)
        # present_key/value must be named: without them the CPU kernel attends over an unfilled buffer.
        attn = g.op("GroupQueryAttention", [
            g.op1("Reshape", [q, ctx.q3]), g.op1("Reshape", [k, ctx.kv3]), g.op1("Reshape", [v, ctx.kv3]),
            self._past(kc), self._past(vc), SEQLENS, TOTAL], 3, domain=MS, num_heads=spec.num_heads,
            kv_num_heads=KVH, scale=float(spec.scale), **extra)[0]
        return g.op1("Reshape", [attn, g.const(f"flat_{spec.num_heads * D}", [-1, spec.num_heads * D])])

    def activation(self, x: str, kind: str) -> str:
        if kind == "silu":
            return self.g.op1("Mul", [x, self.g.op1("Sigmoid", [x])])
        return self.g.op1("FastGelu" if kind == "gelu_tanh" else "Gelu", [x], domain=MS)

    def mul(self, a: str, b: str) -> str:
        return self.g.op1("Mul", [a, b])

    def add(self, a: str, b: str) -> str:
        out = self.g.op1("Add", [a, b])
        self._adds[out] = len(self.g.nodes) - 1
        return out

    def logit_rows(self, x: str) -> str:
        return self.g.op1("Gather", [x, self.input(ROWS, self.tp.INT64, ["R"])])

    def softcap(self, x: str, cap: float) -> str:
        c = self.fconst(f"cap_{self.g.n}", cap)
        return self.g.op1("Mul", [self.g.op1("Tanh", [self.g.op1("Div", [x, c])]), c])


def build(spec: dec.DecoderSpec, weights: dec.DecoderWeights, stop: int | None = None) -> Built:
    """The graph of ``spec.layers`` (or of its layers up to ``stop``, an early exit, then the head)."""
    from onnx import TensorProto, helper

    a, b = spec.layers
    end = b if stop is None else stop
    if not a < end <= b:
        raise ValueError(f"layers [{a}, {end}) are not a non-empty part of the range {spec.layers}")
    head = stop is not None or spec.last
    g = _Builder()
    ops = OnnxOps(spec, g)
    y = forward(spec, ops, (a, end), head=head, weights=weights)
    F, KVH, D = TensorProto.FLOAT, spec.num_kv_heads, spec.head_dim
    for name, parts in ((K_NEW, ops.ks), (V_NEW, ops.vs)):
        g.nodes.append(helper.make_node("Concat", parts, [name], axis=0) if len(parts) > 1
                       else helper.make_node("Identity", parts, [name]))
    kv_out = [helper.make_tensor_value_info(n, F, [end - a, "N", KVH, D]) for n in (K_NEW, V_NEW)]
    name, shape = (LOGITS, ["R", spec.vocab_size]) if head else (HIDDEN_OUT, ["N", spec.hidden_size])
    g.nodes.append(helper.make_node("Identity", [y], [name]))
    outputs = [helper.make_tensor_value_info(name, F, shape)]
    graph = helper.make_graph(g.nodes, f"dspark_decoder_{a}_{end}", list(ops.inputs.values()), outputs + kv_out,
                              initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="dspark", ir_version=IR_VERSION)
    return Built(model=model, weights=g.weights, num_layers=end - a, head=head)


@dataclass(frozen=True)
class _Ctx:
    """Shapes computed once per run and shared by all layers."""

    q3: str  # [B, -1, H*D]: GQA's query layout
    kv3: str  # [B, -1, KVH*D]
    slots: str  # [B, P, 2]: (block, offset) of each sequence's past positions, P the longest past


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
    return _Ctx(q3, kv3, slots)
