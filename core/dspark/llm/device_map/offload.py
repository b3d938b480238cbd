"""Dense offload: each layer's prefill MLP as its own placement problem.

The dense MLP of each layer is bid on by every plugin on the real weights and, during prefill, run through
the winning plugin's compiled executable when it bids lower than torch (the rest of the layer stays where
the device map put it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dspark.graph.model import Graph, Op, TensorSpec
from dspark.host.log import get_logger
from dspark.llm.device_map.torch_layers import host_and_inventory

if TYPE_CHECKING:
    import torch

    from dspark.host.inventory import Inventory
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.runner.model import ModelRunner
    from dspark.types import Bid, Device, Executable

log = get_logger("dspark.llm.dense_offload")


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
