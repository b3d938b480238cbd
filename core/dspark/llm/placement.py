"""Where the engine's pieces run, decided by the plugin core's placer.

:func:`place_layers` turns a model config into a chain :class:`~dspark.graph.model.Graph`
(embedding -> decoder layer 0 .. N-1 -> final norm + lm_head) and asks the
normal placer (:func:`dspark.placement.placer.plan`) for an assignment, so the plugins'
bids, the transfer of the hidden state between devices and each device's
memory budget decide where every layer runs: on a box whose GPU cannot hold
all layers and their KV cache, the layers that do not fit run on the CPU
(llama.cpp's ``-ngl``, but chosen by cost).

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

:class:`DenseOffload` is the other half: the dense MLP of each layer as its own
placement problem (bids from every plugin on the real weights), run through the
winning plugin's compiled executable during prefill when it bids lower than torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark.graph.model import Graph, Op, TensorSpec
from dspark.host.log import get_logger
from dspark.placement.plan import Plan

if TYPE_CHECKING:
    import torch

    from dspark.host.inventory import Inventory
    from dspark.llm.runner.types import ModelConfig
    from dspark.llm.runner.model import ModelRunner
    from dspark.host.plugin_manager import PluginHost
    from dspark.types import Bid, Device, Executable

log = get_logger("dspark.llm.placement")

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class PiecePlacement:
    """One piece of the model (embedding, a decoder layer, the head) and where it runs."""

    name: str
    device_id: str  # the inventory's device id: "cpu", "cuda:0", "gpu:0" ...
    plugin: str  # the plugin whose bid won (informational: torch runs the layers)
    runtime: str
    weight_bytes: int
    kv_bytes: int = 0

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


@dataclass
class LayerPlacement:
    """The placer's answer for a model: per-piece devices plus the explained Plan."""

    embed: PiecePlacement
    layers: list[PiecePlacement]
    head: PiecePlacement
    plan: Plan
    graph: Graph = field(repr=False)

    @property
    def layer_devices(self) -> dict[int, str]:
        """Layer index -> device id."""
        return {i: p.device_id for i, p in enumerate(self.layers)}

    def device_bytes(self) -> dict[str, int]:
        """Bytes (weights + KV) each device must hold under this placement."""
        out: dict[str, int] = {}
        for p in [self.embed, *self.layers, self.head]:
            out[p.device_id] = out.get(p.device_id, 0) + p.memory_bytes
        return out

    def layers_on(self, device_id: str) -> list[int]:
        return [i for i, p in enumerate(self.layers) if p.device_id == device_id]

    def summary(self) -> dict[str, Any]:
        """Compact, loggable description: runs of consecutive layers per device."""
        runs: list[str] = []
        start = 0
        for i in range(1, len(self.layers) + 1):
            if i == len(self.layers) or self.layers[i].device_id != self.layers[start].device_id:
                p = self.layers[start]
                runs.append(f"layers {start}-{i - 1} on {p.device_id} ({p.plugin})")
                start = i
        return {
            "embed": f"{self.embed.device_id} ({self.embed.plugin})", "layers": runs,
            "head": f"{self.head.device_id} ({self.head.plugin})",
            "device_bytes": self.device_bytes(), "predicted_step_ms": round(self.plan.predicted_total_ms, 4),
            "gate": self.plan.gate, "solver": self.plan.solver,
        }


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
                      decode_batch: int = 8, prefill_chunk: int = 128) -> Graph:
    """The chain graph of the model's pieces; see the module docstring."""
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
                      flops=2.0 * tokens * P + attn_flops * tokens, param_bytes=P * item + kv_bytes))
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


def place_layers(config: ModelConfig, host: PluginHost, inv: Inventory, *, max_model_len: int,
                 max_total_tokens: int, dtype: str, decode_batch: int = 8, prefill_chunk: int = 128,
                 devices: Collection[str] | None = None, time_limit_s: float = 20.0) -> LayerPlacement:
    """Ask the placer where the embedding, each decoder layer and the head run.

    :param devices: restrict the targets to these device ids (the engine passes
        the ones torch can drive here); None = every device the inventory has.
    """
    from dspark.placement.placer import collect_op_bids, plan

    graph = build_layer_graph(config, max_model_len=max_model_len, max_total_tokens=max_total_tokens,
                              dtype=dtype, decode_batch=decode_batch, prefill_chunk=prefill_chunk)
    targets = inv.drivers()
    if devices is not None:
        targets = [d for d in targets if d.id in set(devices)]
        if not targets:
            raise ValueError(f"no inventory device among {sorted(devices)}; have {[d.id for d in inv.devices]}")
    table = collect_op_bids(host, inv, graph, targets=targets)
    p = plan(graph, host, inv, table=table, time_limit_s=time_limit_s)
    where = {op: part for part in p.partitions for op in part.ops}

    def piece(name: str, op: str, weight_bytes: int, kv_bytes: int = 0) -> PiecePlacement:
        part = where[op]
        return PiecePlacement(name=name, device_id=part.target.device_id, plugin=part.target.plugin,
                              runtime=part.target.runtime, weight_bytes=weight_bytes, kv_bytes=kv_bytes)

    item = _ITEMSIZE[{"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)]
    kv_layer = 2 * config.num_key_value_heads * config.head_dim * item * max_total_tokens
    layers = [piece(f"layer{i}", f"layer{i}", _layer_params(config) * item, kv_layer)
              for i in range(config.num_hidden_layers)]
    V, h = config.vocab_size, config.hidden_size
    return LayerPlacement(embed=piece("embed", "embed", V * h * item), layers=layers,
                          head=piece("head", "head", (V * h + h) * item), plan=p, graph=graph)


# -- the engine's side ------------------------------------------------------------------------


def torch_device_for(device_id: str, kind: str) -> str | None:
    """The torch device that runs an inventory device, or None when torch cannot drive it here."""
    if kind == "cpu":
        return "cpu"
    if device_id.startswith("cuda:"):
        import torch

        idx = int(device_id.split(":")[1])
        if torch.cuda.is_available() and idx < torch.cuda.device_count():
            return device_id
    return None


def host_and_inventory(devices: str) -> tuple[PluginHost, Inventory]:
    """``"auto"``: every installed plugin and the devices they probe; else a device-profile path."""
    if devices == "auto":
        from dspark.host.inventory import probe
        from dspark.host.plugin_manager import PluginHost

        host = PluginHost().load()
        return host, probe(host)
    from dspark.placement.profile import profile_host

    if not Path(devices).exists():
        raise FileNotFoundError(f"devices={devices!r}: expected 'auto' or a device-profile YAML file")
    return profile_host(devices)


def place_engine(runner: ModelRunner, devices: str, *, max_model_len: int, max_total_tokens: int,
                 decode_batch: int, prefill_chunk: int, host: PluginHost | None = None,
                 inv: Inventory | None = None) -> LayerPlacement:
    """Plan the runner's pieces over ``devices`` ("auto" or a profile) and move them there.
    ``host``/``inv``: the engine's plugin host and inventory, used for ``"auto"`` (else built here)."""
    import torch

    if devices != "auto" or host is None or inv is None:
        host, inv = host_and_inventory(devices)
    runnable = {d.id: td for d in inv.devices if (td := torch_device_for(d.id, d.kind)) is not None}
    dropped = [d.id for d in inv.devices if d.id not in runnable]
    if dropped:
        log.warning("llm.placement.devices_dropped", devices=dropped, reason="torch cannot drive them here")
    dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[runner.dtype]
    t0 = time.perf_counter()
    lp = place_layers(runner.cfg, host, inv, max_model_len=max_model_len, max_total_tokens=max_total_tokens,
                      dtype=dtype, decode_batch=decode_batch, prefill_chunk=prefill_chunk, devices=runnable)
    runner.place([runnable[p.device_id] for p in lp.layers], embed_device=runnable[lp.embed.device_id],
                 head_device=runnable[lp.head.device_id])
    log.info("llm.placement", source=devices, seconds=round(time.perf_counter() - t0, 3), **lp.summary())
    return lp


# -- dense offload ------------------------------------------------------------------------------


def build_mlp_graph(w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray, tokens: int,
                    name: str = "mlp") -> Graph:
    """ONNX graph of one layer's dense MLP for ``tokens`` rows: down(silu(h @ gate) * (h @ up)).

    Weights in torch's [out, in] layout, float32; SiLU as ``x * Sigmoid(x)``.
    """
    inter, hidden = w_gate.shape
    f32 = "float32"
    tensors = {n: TensorSpec(name=n, dtype=f32, shape=s) for n, s in [
        ("h", (tokens, hidden)), ("g", (tokens, inter)), ("u", (tokens, inter)), ("sg", (tokens, inter)),
        ("sl", (tokens, inter)), ("a", (tokens, inter)), ("y", (tokens, hidden))]}
    mm = 2.0 * tokens * hidden * inter
    inits = {"w_gate": np.ascontiguousarray(w_gate.T), "w_up": np.ascontiguousarray(w_up.T),
             "w_down": np.ascontiguousarray(w_down.T)}
    wb = int(w_gate.nbytes)
    ops = [
        Op(name="gate", op_type="MatMul", inputs=["h", "w_gate"], outputs=["g"], flops=mm, param_bytes=wb),
        Op(name="up", op_type="MatMul", inputs=["h", "w_up"], outputs=["u"], flops=mm, param_bytes=wb),
        Op(name="sigmoid", op_type="Sigmoid", inputs=["g"], outputs=["sg"], flops=4.0 * tokens * inter),
        Op(name="silu", op_type="Mul", inputs=["g", "sg"], outputs=["sl"], flops=float(tokens * inter)),
        Op(name="gated", op_type="Mul", inputs=["sl", "u"], outputs=["a"], flops=float(tokens * inter)),
        Op(name="down", op_type="MatMul", inputs=["a", "w_down"], outputs=["y"], flops=mm, param_bytes=wb),
    ]
    return Graph(name=name, ops=ops, tensors=tensors, inputs=["h"], outputs=["y"], initializers=inits)


@dataclass
class OffloadDecision:
    plugin: str | None  # None: torch keeps the MLP
    device_id: str
    bucket: int
    torch_ms: float | None
    best_ms: float | None
    bids: dict[str, float]  # "plugin@device" -> ms
    reason: str


class DenseOffload:
    """Runs each layer's prefill MLP through another plugin's compiled executable.

    Called by the runner, in steps that carry a prefill chunk (decode rows of the same
    step ride along; decode-only steps stay in torch), as ``offload(layer_index, h)`` with the post-attention
    normed hidden state ``h`` [tokens, hidden]; returns the MLP output, or None
    to let torch run it (more tokens than the largest bucket, or a (layer, bucket) whose
    compile or run failed: the failure is charged to the plugin for that subgraph and
    torch keeps that MLP, so one odd shape never stops the engine). Tokens are padded
    with zeros up to the smallest bucket that holds them (rows are independent
    in an MLP, so padding changes nothing); one executable per (layer, bucket),
    compiled on first use.
    """

    def __init__(self, runner: ModelRunner, host: PluginHost, inv: Inventory, device: Device,
                 buckets: tuple[int, ...] = (128, 256, 512)) -> None:
        self.runner, self.host, self.device = runner, host, device
        self.buckets = tuple(sorted(buckets))
        self._exes: dict[tuple[int, int], Executable] = {}
        self.failed: dict[tuple[int, int], str] = {}  # (layer, bucket) -> why torch runs it instead
        self.compile_s = 0.0
        self.calls = 0
        del inv

    def weights(self, li: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        L = self.runner.layers[li]
        inter = L.w_gate_up_t.shape[1] // 2
        gu = L.w_gate_up_t.t().detach().float().cpu().numpy()
        return gu[:inter], gu[inter:], L.w_down.detach().float().cpu().numpy()

    def executable(self, li: int, bucket: int) -> Executable:
        key = (li, bucket)
        if key not in self._exes:
            from dspark.placement.bidding import compile_on

            t0 = time.perf_counter()
            graph = build_mlp_graph(*self.weights(li), tokens=bucket, name=f"layer{li}.mlp.{bucket}")
            self._exes[key] = compile_on(self.host, self.device, graph.subgraph())
            self.compile_s += time.perf_counter() - t0
        return self._exes[key]

    def warm_up(self, bucket: int | None = None) -> None:
        for li in range(len(self.runner.layers)):
            self.executable(li, bucket or self.buckets[0])

    def __call__(self, li: int, h: torch.Tensor) -> torch.Tensor | None:
        import torch

        n = h.shape[0]
        bucket = next((b for b in self.buckets if b >= n), None)
        if bucket is None:
            return None
        if (li, bucket) in self.failed:
            return None
        x = h.detach().float()
        if n < bucket:
            x = torch.cat([x, x.new_zeros(bucket - n, x.shape[1])])
        try:
            exe = self.executable(li, bucket)
        except Exception as exc:  # compile_on already charged the plugin for this subgraph
            return self._fall_back(li, bucket, "compile", exc)
        try:
            y = exe.run({"h": x.numpy()})["y"]
        except Exception as exc:  # noqa: BLE001 - a plugin's executable: any error is its fault
            graph = build_mlp_graph(*self.weights(li), tokens=bucket, name=f"layer{li}.mlp.{bucket}")
            self.host.charge(self.device.plugin, "run", f"{type(exc).__name__}: {exc}",
                             subgraph=graph.subgraph(), device=self.device.id)
            return self._fall_back(li, bucket, "run", exc)
        self.calls += 1
        return torch.from_numpy(np.asarray(y)[:n]).to(h.dtype)


    def _fall_back(self, li: int, bucket: int, stage: str, exc: Exception) -> None:
        self.failed[(li, bucket)] = f"{stage}: {type(exc).__name__}: {exc}"
        log.warning("dense_offload.fallback", plugin=self.device.plugin, layer=li, bucket=bucket,
                    stage=stage, error=f"{type(exc).__name__}: {exc}")
        return None


def decide_dense_offload(runner: ModelRunner, host: PluginHost, inv: Inventory, *, mode: str,
                         device_id: str = "cpu", bucket: int = 128, margin: float = 0.2) -> OffloadDecision:
    """Collect every plugin's bid on layer 0's MLP at ``bucket`` tokens and pick who runs it.

    ``mode``: "auto" takes the lowest float32 bid of a plugin other than torch when it
    beats torch's by more than ``margin``; a plugin name forces that plugin (if it bids).
    """
    from dspark.placement.bidding import collect_bids

    graph = build_mlp_graph(*DenseOffload(runner, host, inv, inv.drivers()[0]).weights(0), tokens=bucket)
    bids: list[tuple[Device, Bid]] = [(d, b) for d, b in collect_bids(host, inv, graph.subgraph())
                                      if d.id == device_id]
    table = {f"{d.plugin}@{d.id}": round(b.latency_s * 1e3, 4) for d, b in bids}
    torch_bid = next((b for d, b in bids if d.plugin == "torch"), None)
    torch_ms = None if torch_bid is None else torch_bid.latency_s * 1e3
    others = [(d, b) for d, b in bids if d.plugin != "torch" and b.precision == "float32"]
    if mode != "auto":
        others = [(d, b) for d, b in bids if d.plugin == mode]
        if not others:
            raise ValueError(f"dense_offload={mode!r}: that plugin does not bid on the MLP on {device_id} "
                             f"(bids: {table})")
    if not others:
        return OffloadDecision(None, device_id, bucket, torch_ms, None, table, "no other plugin bids in float32")
    d, b = min(others, key=lambda x: x[1].latency_s)
    best_ms = b.latency_s * 1e3
    if mode == "auto" and torch_ms is not None and not best_ms < (1 - margin) * torch_ms:
        return OffloadDecision(None, device_id, bucket, torch_ms, best_ms, table,
                               f"{d.plugin} {best_ms:.3f} ms does not beat torch {torch_ms:.3f} ms by {margin:.0%}")
    why = "forced" if mode != "auto" else f"{d.plugin} {best_ms:.3f} ms < torch {torch_ms} ms by > {margin:.0%}"
    return OffloadDecision(d.plugin, d.id, bucket, torch_ms, best_ms, table, why)


def setup_dense_offload(runner: ModelRunner, mode: str, *, layer_devices: list[str] | None = None,
                        host: PluginHost | None = None, inv: Inventory | None = None,
                        ) -> tuple[DenseOffload | None, OffloadDecision]:
    """Decide and, when it pays (or is forced), install the offload on the runner's CPU layers."""
    act = runner.cfg.hidden_act
    if act not in ("silu", "swish"):  # the offloaded graph (build_mlp_graph) is SiLU-gated only
        why = f"the {runner.cfg.model_type} MLP uses {act}; the offloaded MLP graph is SiLU only"
        if mode != "auto":
            raise ValueError(f"dense_offload={mode!r}: {why}")
        return None, OffloadDecision(None, "cpu", 0, None, None, {}, why)
    if host is None or inv is None:
        host, inv = host_and_inventory("auto")  # it has to execute: the real plugins, never a profile
    decision = decide_dense_offload(runner, host, inv, mode=mode)
    log.info("llm.dense_offload", plugin=decision.plugin, bucket=decision.bucket, torch_ms=decision.torch_ms,
             best_ms=decision.best_ms, bids=decision.bids, reason=decision.reason)
    if decision.plugin is None:
        return None, decision
    device = next(d for d in inv.drivers() if d.plugin == decision.plugin and d.id == decision.device_id)
    off = DenseOffload(runner, host, inv, device)
    on_host = [i for i in range(len(runner.layers)) if (layer_devices or ["cpu"] * len(runner.layers))[i] == "cpu"]
    runner.mlp_offload = (lambda li, h: off(li, h) if li in on_host else None) if len(on_host) < len(
        runner.layers) else off
    return off, decision
