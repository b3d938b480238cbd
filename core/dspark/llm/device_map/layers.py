"""Which layers go on which device: the placer over the model's chain of pieces.

The one routine that puts an LLM's layers on devices (:func:`map_layers`), whoever runs them: the torch
runner's layers over the devices torch drives here (``devices=``, :mod:`.torch_layers`), and compiled
decoders' layer ranges when no single device holds the model (:mod:`.chain`). It turns a model config into
a chain :class:`~dspark.graph.model.Graph` (embedding -> decoder layer 0 .. N-1 -> final norm + lm_head)
and asks the normal placer (:func:`dspark.placement.placer.plan`) for an assignment, so the plugins' bids,
the transfer of the hidden state between devices and each device's memory budget decide where every layer
runs: on a box whose GPU cannot hold all layers and their KV cache, the layers that do not fit run on the
CPU (llama.cpp's ``-ngl``, but chosen by cost).

Each piece is expressed in ONNX ops that every runtime bids on, sized so a
bid (roofline or calibrated) sees the piece's real work:

* a decoder layer is ``MatMul(h[tokens, hidden], W[k, hidden, hidden])`` +
  ``ReduceSum(axis 0)``: ``k = ceil(layer params / hidden^2)``, so the proxy
  weight has the layer's parameter bytes and the MatMul its projection FLOPs
  (attention FLOPs over the representative context are added to ``Op.flops``);
  the edge to the next layer is the real hidden state ``[tokens, hidden]``;
* the embedding is a ``Gather`` from the ``[vocab, hidden]`` table;
* the head selects the rows whose logits are wanted (``Gather``) and runs a
  ``Gemm`` against the ``[vocab, hidden]`` lm_head (the embedding for tied models).

Proxy weights are zero-stride numpy views (no memory), but ``nbytes`` reports
the real size. ``tokens`` is a representative step: ``decode_batch`` decodes
plus one ``prefill_chunk``; ``rows`` the logits rows of that step.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark.graph.model import Graph, Op, TensorSpec
from dspark.llm.device_map.pieces import DeviceMap, Piece
from dspark.types import Bid

if TYPE_CHECKING:
    from dspark.host.inventory import Inventory
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.runner.types import ModelConfig
    from dspark.placement.placer import BidTable
    from dspark.types import Device

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _layer_params(c: ModelConfig) -> int:
    h, d = c.hidden_size, c.head_dim
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * d
    n = h * qkv + c.num_attention_heads * d * h + 3 * h * c.intermediate_size + 2 * h
    return n + (qkv if c.attention_bias else 0)


class _ProxyWeight(np.ndarray):
    """A zero-stride, all-zero weight: no memory, but ``nbytes`` is the real size of its shape.

    ``tobytes`` returns at most 4 KiB: graph fingerprints hash only a weight's head, and a
    full copy of a 7B model's proxies per fingerprint would cost seconds. Runtimes that
    compile it (calibrated bids) still materialize it, once per signature and device.
    """

    def tobytes(self, order: Any = "C") -> bytes:  # type: ignore[override]
        return bytes(min(int(self.nbytes), 4096))


def _proxy(shape: tuple[int, ...], np_dtype: Any) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype=np_dtype), shape).view(_ProxyWeight)


def build_layer_graph(config: ModelConfig, *, max_model_len: int, max_total_tokens: int, dtype: str,
                      decode_batch: int = 8, prefill_chunk: int = 128,
                      layer_bytes: tuple[int, int] | None = None) -> Graph:
    """The chain graph of the model's pieces; see the module docstring. ``layer_bytes``: one layer's
    (weight, KV) bytes where the runtimes hold them otherwise than at ``dtype`` (compiled decoders' bids)."""
    c = config
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    if dtype not in _ITEMSIZE:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(_ITEMSIZE)}")
    item = _ITEMSIZE[dtype]
    # bf16 is not a numpy dtype: the graph uses float16, which has the same bytes, so the
    # runtimes can also time the proxies.
    gdt = "float32" if dtype == "float32" else "float16"
    npdt = np.float32 if gdt == "float32" else np.float16
    h, V = c.hidden_size, c.vocab_size
    P = _layer_params(c)
    k = max(1, math.ceil(P / (h * h)))
    # KV: every layer keeps K and V for max_total_tokens on the device it runs on. The cache is
    # allocated whole at start-up, so it is resident memory like the weights: it goes into the
    # op's param_bytes, which is what the placer checks against each device's budget
    # (MEMORY_HEADROOM x free). It is not in the proxy weight: that one sizes the compute.
    kv_bytes = 2 * c.num_key_value_heads * c.head_dim * item * max_total_tokens
    resident = P * item + kv_bytes if layer_bytes is None else sum(layer_bytes)
    ctx = max(1, min(max_model_len, max_total_tokens) // 2)  # representative attended length
    tokens = decode_batch + prefill_chunk
    rows = decode_batch + 1
    attn_flops = 4.0 * c.num_attention_heads * c.head_dim * ctx  # QK^T and PV per query token
    tensors: dict[str, TensorSpec] = {}

    def t(name: str, shape: tuple[int | str, ...], dt: str = gdt) -> str:
        tensors[name] = TensorSpec(name=name, dtype=dt, shape=shape)  # type: ignore[arg-type]
        return name

    inits: dict[str, np.ndarray] = {"embed.weight": _proxy((V, h), npdt), "sum.axes": np.array([0], np.int64)}
    head_w = "embed.weight" if c.tie_word_embeddings else "lm_head.weight"
    inits[head_w] = _proxy((V, h), npdt)
    ops = [Op(name="embed", op_type="Gather", inputs=["embed.weight", t("token_ids", ("tokens",), "int64")],
              outputs=[t("h_embed", ("tokens", h))], attrs={"axis": 0}, param_bytes=V * h * item,
              flops=float(tokens * h))]
    prev = "h_embed"
    for i in range(c.num_hidden_layers):
        w = f"layer{i}.weight"
        inits[w] = _proxy((k, h, h), npdt)
        ops.append(Op(name=f"layer{i}", op_type="MatMul", inputs=[prev, w],
                      outputs=[t(f"layer{i}.partial", (k, "tokens", h))],
                      flops=2.0 * tokens * P + attn_flops * tokens, param_bytes=resident))
        ops.append(Op(name=f"layer{i}.sum", op_type="ReduceSum", inputs=[f"layer{i}.partial", "sum.axes"],
                      outputs=[t(f"h{i}", ("tokens", h))], attrs={"keepdims": 0}, flops=float(k * tokens * h)))
        prev = f"h{i}"
    ops.append(Op(name="head.rows", op_type="Gather", inputs=[prev, t("logit_rows", ("rows",), "int64")],
                  outputs=[t("h_rows", ("rows", h))], attrs={"axis": 0}, flops=float(rows * h)))
    ops.append(Op(name="head", op_type="Gemm", inputs=["h_rows", head_w], outputs=[t("logits", ("rows", V))],
                  attrs={"transB": 1}, flops=2.0 * rows * h * V + 4.0 * rows * h,
                  # Tied: a second copy of the table where the head runs (counted even when it
                  # shares the embedding's device, which over-reserves by one table).
                  param_bytes=(V * h + h) * item))
    for name, arr in inits.items():  # weight specs too: calibrating runtimes generate valid indices from them
        t(name, tuple(arr.shape), "int64" if arr.dtype == np.int64 else gdt)
    return Graph(name=f"{c.model_type}-{c.num_hidden_layers}L-placement", ops=ops, tensors=tensors,
                 inputs=["token_ids", "logit_rows"], outputs=["logits"], initializers=inits,
                 dim_hints={"tokens": tokens, "rows": rows})


def _roofline_bids(graph: Graph, targets: list[Device], dtype: str) -> BidTable:
    """Every op's roofline cost on every target (compiled decoders' devices)."""
    from dspark.placement.placer import BidTable, target_key
    from dspark.sdk.cost import roofline

    dt = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    table = BidTable(targets=targets)
    for op in graph.ops:
        sub = graph.subgraph([op.name])
        table.op_bids[op.name] = {
            target_key(d): Bid(plugin=d.plugin, device_id=d.id, runtime=d.runtime, source="roofline",
                               latency_s=roofline(sub, d, dt), peak_memory_bytes=op.param_bytes, precision=dt)
            for d in targets}
    return table


def map_layers(config: ModelConfig, host: PluginHost, inv: Inventory, *, max_model_len: int,
               max_total_tokens: int, dtype: str, decode_batch: int = 8, prefill_chunk: int = 128,
               devices: Collection[str] | None = None, time_limit_s: float = 20.0,
               layer_bytes: tuple[int, int] | None = None, runs: dict[str, str] | None = None) -> DeviceMap:
    """Ask the placer where the embedding, each decoder layer and the head run.

    :param devices: restrict the targets to these device ids (the engine passes the ones torch can
        drive here, or the devices whose plugins bid on the decoder); None = every device the inventory has.
    :param layer_bytes: one layer's (weight, KV) bytes, where not the config's at ``dtype``.
    :param runs: device id -> who executes its layers (default ``"torch"``). A plugin named here runs its
        layers in its compiled decoder, whose whole-model bid is its promise: it is not asked to bid on the
        proxy ops (a runtime cannot compile a proxy), so each op's cost on its device is the roofline over
        the device's probed figures (``dspark.sdk.cost.roofline``).
    """
    from dspark.placement.placer import collect_op_bids, plan

    graph = build_layer_graph(config, max_model_len=max_model_len, max_total_tokens=max_total_tokens,
                              dtype=dtype, decode_batch=decode_batch, prefill_chunk=prefill_chunk,
                              layer_bytes=layer_bytes)
    targets = inv.drivers()
    if devices is not None:
        targets = [d for d in targets if d.id in set(devices)]
        if not targets:
            raise ValueError(f"no inventory device among {sorted(devices)}; have {[d.id for d in inv.devices]}")
    decoders = {d: r for d, r in (runs or {}).items() if r != "torch"}
    if decoders:
        targets = [d for d in targets if decoders.get(d.id) == d.plugin]
        table = _roofline_bids(graph, targets, dtype)
    else:
        table = collect_op_bids(host, inv, graph, targets=targets)
    p = plan(graph, host, inv, table=table, time_limit_s=time_limit_s)
    where = {op: part for part in p.partitions for op in part.ops}

    def piece(name: str, op: str, weight_bytes: int, kv_bytes: int = 0) -> Piece:
        part = where[op]
        return Piece(name=name, device_id=part.target.device_id, plugin=part.target.plugin,
                     runtime=part.target.runtime, weight_bytes=weight_bytes, kv_bytes=kv_bytes)

    item = _ITEMSIZE[{"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)]
    w_layer, kv_layer = layer_bytes or (_layer_params(config) * item,
                                        2 * config.num_key_value_heads * config.head_dim * item * max_total_tokens)
    layers = [piece(f"layer{i}", f"layer{i}", w_layer, kv_layer) for i in range(config.num_hidden_layers)]
    V, h = config.vocab_size, config.hidden_size
    placed = DeviceMap(embed=piece("embed", "embed", V * h * item), layers=layers,
                       head=piece("head", "head", (V * h + h) * item), plan=p, graph=graph)
    placed.runs = {d: (runs or {}).get(d, "torch") for d in placed.devices}
    return placed
