"""Install a :class:`~dspark.quantization.plan.QuantPlan` on a runner through the plugins.

Each quantized projection becomes a one-op subgraph
(:func:`dspark.quant.linear_subgraph`). Every plugin that drives the device the
layer runs on is asked for a variant (``dspark_quantize``) and bids on it
(``dspark_bid``, at one row: decode is where weight bytes cost time); the
cheapest variant is compiled and installed. With ``prefer_speed`` (int8's
default) the float kernels bid too, so a projection too small for int8 to pay
stays float: precision and placement are chosen together. The embedding table
is a gather, quantized per row in torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dspark.llm.model import EMBED
from dspark.log import get_logger
from dspark.quant import LINEAR_INPUT, LINEAR_OUTPUT, linear_subgraph
from dspark.quantization.fake import quantize_rows_int8
from dspark.quantization.plan import LayerPlan, QuantPlan
from dspark.types import QuantSpec, torch_runner

if TYPE_CHECKING:
    from dspark.inventory import Inventory
    from dspark.llm.model import ModelRunner
    from dspark.plugin_manager import PluginHost
    from dspark.types import Device, Executable

log = get_logger("dspark.quantization")


@dataclass
class KernelChoice:
    """Who runs one projection, and the bids that decided it (ms at one row)."""

    name: str
    planned: str
    runs: str  # "int8", "int4" or "float"
    plugin: str
    runtime: str
    bids: dict[str, float] = field(default_factory=dict)
    reason: str = ""


class QuantizedLinear:
    """``x -> x @ W`` through a compiled executable; keeps the runner's dtype and device."""

    def __init__(self, exe: Executable, weight_bytes: int, plugin: str, precision: str = "float") -> None:
        self.exe = exe
        self.weight_bytes = weight_bytes
        self.plugin = plugin
        self.precision = precision
        self._torch = torch_runner(exe)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()
        if self._torch is not None:
            y = self._torch({LINEAR_INPUT: xf.contiguous()})[LINEAR_OUTPUT]
        else:
            y = torch.from_numpy(np.asarray(self.exe.run({LINEAR_INPUT: xf.detach().cpu().numpy()})[LINEAR_OUTPUT]))
            y = y.to(x.device)
        return y if y.dtype == x.dtype else y.to(x.dtype)


def spec_for(lp: LayerPlan) -> QuantSpec:
    if lp.precision == "int8":
        return QuantSpec(weight_bits=8, granularity="per_channel", activations=lp.activations)
    return QuantSpec(weight_bits=4, granularity="group", group_size=lp.group_size or 128, activations="float")


def _device_of(runner: ModelRunner, name: str) -> str:
    devs = runner.layer_devices
    if devs is None:
        return "cpu"
    if name.startswith("model.layers."):
        d = devs[int(name.split(".")[2])]
    else:
        d = runner.lm_head_t.device
    return "cpu" if d.type == "cpu" else f"{d.type}:{d.index or 0}"


def _choose(host: PluginHost, inv: Inventory, runner: ModelRunner, lp: LayerPlan,
            speed_first: bool) -> tuple[KernelChoice, Callable[[torch.Tensor], torch.Tensor] | None]:
    from dspark.bidding import compile_on

    dev_id = _device_of(runner, lp.name)
    drivers = [d for d in inv.drivers() if d.id == dev_id]
    w_t = runner.weight_t(lp.name).detach().float().cpu().numpy()
    sg = linear_subgraph(lp.name, w_t, representative_tokens=1)
    spec = spec_for(lp)
    options: list[tuple[float, Device, Any, str]] = []
    bids: dict[str, float] = {}
    for d in drivers:
        variant = host.call(d.plugin, "dspark_quantize", subgraph=sg, device=d, spec=spec)
        if variant is None:
            continue
        bid = host.call(d.plugin, "dspark_bid", subgraph=variant, device=d)
        if bid is None or bid.precision != spec.precision:
            continue
        bids[f"{d.plugin} {spec.precision}"] = round(bid.latency_s * 1e3, 4)
        options.append((bid.latency_s, d, variant, spec.precision))
    if speed_first:
        for d in drivers:
            bid = host.call(d.plugin, "dspark_bid", subgraph=sg, device=d)
            if bid is not None and bid.precision in ("float32", "float16", "bfloat16"):
                bids[f"{d.plugin} float"] = round(bid.latency_s * 1e3, 4)
                options.append((bid.latency_s, d, None, "float"))
    if not options:
        why = f"no plugin offers a {spec.precision} kernel ({spec.granularity}) on {dev_id}; kept float"
        log.warning("quantization.no_kernel", layer=lp.name, reason=why)
        return KernelChoice(lp.name, lp.precision, "float", "torch", "torch", bids, why), None
    latency, device, variant, runs = min(options, key=lambda o: o[0])
    choice = KernelChoice(lp.name, lp.precision, runs, device.plugin, device.plugin, bids)
    if variant is None:
        best_q = min((o[0] for o in options if o[3] != "float"), default=None)
        choice.reason = (f"float on {device.plugin} bids {latency * 1e3:.3f} ms, faster than any "
                         f"{spec.precision} kernel" + ("" if best_q is None else f" ({best_q * 1e3:.3f} ms)"))
        if device.plugin == "torch":
            return choice, None  # the runner's own float path is torch
        exe = compile_on(host, device, sg)
        return choice, QuantizedLinear(exe, int(w_t.nbytes), device.plugin)
    exe = compile_on(host, device, variant)
    choice.reason = f"{device.plugin} {spec.precision} bids {latency * 1e3:.3f} ms, the lowest"
    choice.runtime = getattr(variant, "quantized_by", device.plugin) or device.plugin
    return choice, QuantizedLinear(exe, lp.weight_bytes(), device.plugin, spec.precision)


def apply_plan(runner: ModelRunner, plan: QuantPlan, *, speed_first: bool | None = None,
               host: PluginHost | None = None, inv: Inventory | None = None,
               progress: Callable[[str, int, int], None] | None = None) -> list[KernelChoice]:
    """Quantize ``runner`` in place as ``plan`` says; returns who runs each quantized projection."""
    if host is None or inv is None:
        from dspark.llm.placement import host_and_inventory

        host, inv = host_and_inventory("auto")
    if runner.mlp_offload is not None:
        raise ValueError("quantization and dense_offload cannot be combined: the offloaded MLP reads float weights")
    known = set(runner.linear_names()) | {EMBED}
    unknown = [lp.name for lp in plan.layers if lp.name not in known]
    if unknown:
        raise ValueError(f"quantization plan names {unknown[0]!r}, which this model does not have")
    speed = plan.weight_bits == 8 if speed_first is None else speed_first
    todo = [lp for lp in plan.layers if lp.precision != "float"]
    choices: list[KernelChoice] = []
    for i, lp in enumerate(todo, 1):
        if lp.kind == "embedding":
            q, s = quantize_rows_int8(runner.embed)
            runner.set_embedding_int8(q, s)
            choices.append(KernelChoice(lp.name, "int8", "int8", "torch", "torch", {}, "int8 rows, gathered in torch"))
        else:
            choice, fn = _choose(host, inv, runner, lp, speed)
            if fn is not None:
                runner.set_linear(lp.name, fn, drop_float=True)
            choices.append(choice)
        if progress is not None:
            progress(lp.name, i, len(todo))
    ran: dict[str, int] = {}
    for c in choices:
        key = f"{c.runs}@{c.plugin}"
        ran[key] = ran.get(key, 0) + 1
    log.info("quantization.applied", scheme=plan.scheme, kernels=ran, weight_mb=round(runner.weight_bytes() / 1e6, 2))
    return choices
