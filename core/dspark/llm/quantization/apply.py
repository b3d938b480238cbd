"""Install a :class:`~dspark.llm.runner.quant_plan.QuantPlan` on a runner through the plugins.

Each quantized projection becomes a one-op subgraph
(:func:`dspark.sdk.quant.linear_subgraph`). Every plugin that drives the device the
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

from dspark.llm.runner.model import EMBED
from dspark.host.log import get_logger
from dspark.sdk.quant import LINEAR_INPUT, LINEAR_OUTPUT, linear_subgraph
from dspark.llm.quantization.fake import quantize_rows_int8
from dspark.llm.runner.quant_plan import LayerPlan, QuantPlan
from dspark.types import QuantSpec, torch_runner

if TYPE_CHECKING:
    from dspark.host.inventory import Inventory
    from dspark.llm.runner.model import ModelRunner
    from dspark.host.plugin_manager import PluginHost
    from dspark.types import Device, Executable

log = get_logger("dspark.llm.quantization")


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
        if lp.group_size:  # a GGUF file's Q8_0 blocks (dspark.llm.gguf): one scale per 32 inputs
            return QuantSpec(weight_bits=8, granularity="group", group_size=lp.group_size, activations=lp.activations)
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


PREFILL_ROWS = 128  # representative prefill chunk for the second bid
DECODE_MAX_ROWS = 16  # calls with more rows than this use the prefill kernel


def _specs(lp: LayerPlan) -> list[QuantSpec]:
    """Acceptable specs: the planned one, and for W8A8 also int8 weight-only (strictly more precise)."""
    spec = spec_for(lp)
    if spec.weight_bits == 8 and spec.activations == "dynamic_int8":
        return [spec, spec.model_copy(update={"activations": "float"})]
    return [spec]


def _options(host: PluginHost, drivers: list[Device], sg: Any, lp: LayerPlan, with_float: bool,
             bids: dict[str, float], tag: str) -> list[tuple[float, Device, Any, str]]:
    options: list[tuple[float, Device, Any, str]] = []
    for spec in _specs(lp):
        for d in drivers:
            variant = host.call(d.plugin, "dspark_quantize", subgraph=sg, device=d, spec=spec)
            if variant is None:
                continue
            bid = host.call(d.plugin, "dspark_bid", subgraph=variant, device=d)
            if bid is None or bid.precision != spec.precision:
                continue
            label = spec.precision + ("+a8" if spec.activations == "dynamic_int8" else "")
            bids[f"{d.plugin} {label} {tag}"] = round(bid.latency_s * 1e3, 4)
            options.append((bid.latency_s, d, variant, spec.precision))
    if with_float:
        for d in drivers:
            bid = host.call(d.plugin, "dspark_bid", subgraph=sg, device=d)
            if bid is not None and bid.precision in ("float32", "float16", "bfloat16"):
                bids[f"{d.plugin} float {tag}"] = round(bid.latency_s * 1e3, 4)
                options.append((bid.latency_s, d, None, "float"))
    return options


class _RowDispatch:
    """Decode-sized calls to one kernel, prefill-sized ones to another (each the cheapest at its size)."""

    def __init__(self, decode: QuantizedLinear, prefill: QuantizedLinear) -> None:
        self.decode, self.prefill = decode, prefill
        self.weight_bytes = decode.weight_bytes + prefill.weight_bytes
        self.precision = decode.precision
        self.plugin = f"{decode.plugin}/{prefill.plugin}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (self.decode if x.shape[0] <= DECODE_MAX_ROWS else self.prefill)(x)


def _choose(host: PluginHost, inv: Inventory, runner: ModelRunner, lp: LayerPlan,
            speed_first: bool) -> tuple[KernelChoice, Callable[[torch.Tensor], torch.Tensor] | None]:
    from dspark.placement.bidding import compile_on

    dev_id = _device_of(runner, lp.name)
    drivers = [d for d in inv.drivers() if d.id == dev_id]
    w_t = runner.weight_t(lp.name).detach().float().cpu().numpy()
    sg = linear_subgraph(lp.name, w_t, representative_tokens=1)
    bids: dict[str, float] = {}
    options = _options(host, drivers, sg, lp, speed_first, bids, "@1")
    if not options:
        why = f"no plugin offers a {lp.precision} kernel on {dev_id}; kept float"
        log.warning("quantization.no_kernel", layer=lp.name, reason=why)
        return KernelChoice(lp.name, lp.precision, "float", "torch", "torch", bids, why), None
    latency, device, variant, runs = min(options, key=lambda o: o[0])
    choice = KernelChoice(lp.name, lp.precision, runs, device.plugin, device.plugin, bids)
    if variant is None:
        best_q = min((o[0] for o in options if o[3] != "float"), default=None)
        choice.reason = (f"float on {device.plugin} bids {latency * 1e3:.3f} ms, faster than any "
                         f"{lp.precision} kernel" + ("" if best_q is None else f" ({best_q * 1e3:.3f} ms)"))
        if device.plugin == "torch":
            return choice, None  # the runner's own float path is torch
        return choice, QuantizedLinear(compile_on(host, device, sg), int(w_t.nbytes), device.plugin)
    decode = QuantizedLinear(compile_on(host, device, variant), lp.weight_bytes(), device.plugin, runs)
    choice.reason = f"{device.plugin} {runs} bids {latency * 1e3:.3f} ms at one row, the lowest"
    if not speed_first:
        return choice, decode  # int4: one kernel, one copy of the weights (the point is size)
    # Prefill: the kernel that wins at one row can lose badly at a prefill chunk (bf16 compute
    # without native bf16); a second quantized kernel costs one more int8 copy, still half of float.
    sg_p = linear_subgraph(lp.name, w_t, representative_tokens=PREFILL_ROWS)
    p_opts = _options(host, drivers, sg_p, lp, False, bids, f"@{PREFILL_ROWS}")
    if not p_opts:
        return choice, decode
    p_lat, p_dev, p_var, _ = min(p_opts, key=lambda o: o[0])
    same = (p_dev.plugin == device.plugin and p_var.quant_spec == variant.quant_spec)
    mine = next((o[0] for o in p_opts if o[1].plugin == device.plugin and o[2].quant_spec == variant.quant_spec), None)
    if same or (mine is not None and p_lat > 0.8 * mine):
        return choice, decode  # not worth a second copy
    prefill = QuantizedLinear(compile_on(host, p_dev, p_var), lp.weight_bytes(), p_dev.plugin, runs)
    choice.plugin = f"{device.plugin}/{p_dev.plugin}"
    choice.reason += f"; prefill (> {DECODE_MAX_ROWS} rows) on {p_dev.plugin}, {p_lat * 1e3:.3f} ms at {PREFILL_ROWS}"
    return choice, _RowDispatch(decode, prefill)


def apply_plan(runner: ModelRunner, plan: QuantPlan, *, speed_first: bool | None = None,
               host: PluginHost | None = None, inv: Inventory | None = None,
               progress: Callable[[str, int, int], None] | None = None) -> list[KernelChoice]:
    """Quantize ``runner`` in place as ``plan`` says; returns who runs each quantized projection."""
    if host is None or inv is None:
        from dspark.llm.device_map.torch_layers import host_and_inventory

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
    installed: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = []
    embed = next((lp for lp in todo if lp.kind == "embedding"), None)
    for i, lp in enumerate(todo, 1):
        if lp.kind != "embedding":
            choice, fn = _choose(host, inv, runner, lp, speed)
            if fn is not None:
                runner.set_linear(lp.name, fn)  # float weight kept until the model-level check
                installed.append((lp.name, fn))
            choices.append(choice)
        if progress is not None:
            progress(lp.name, i, len(todo))
    if speed and installed:
        q_ms, f_ms = decode_step_ms(runner, installed)
        if q_ms >= 0.97 * f_ms:
            # Per-layer bids time each kernel alone, with cold caches; the whole step is what counts.
            why = f"model check: decode {q_ms:.2f} ms/token quantized vs {f_ms:.2f} float; kept float"
            log.info("quantization.speed_check", quantized_ms=round(q_ms, 3), float_ms=round(f_ms, 3), kept="float")
            for name, _ in installed:
                runner.set_linear(name, None)
            for c in choices:
                c.runs, c.plugin, c.reason = "float", "torch", why
            if embed is not None:
                choices.append(KernelChoice(embed.name, "int8", "float", "torch", "torch", {}, why))
            installed, embed = [], None
        else:
            log.info("quantization.speed_check", quantized_ms=round(q_ms, 3), float_ms=round(f_ms, 3), kept="quantized")
    for name, fn in installed:
        runner.set_linear(name, fn, drop_float=True)
    if embed is not None:
        q, sc = quantize_rows_int8(runner.embed)
        runner.set_embedding_int8(q, sc)
        choices.append(KernelChoice(embed.name, "int8", "int8", "torch", "torch", {}, "int8 rows, gathered in torch"))
    ran: dict[str, int] = {}
    for c in choices:
        key = f"{c.runs}@{c.plugin}"
        ran[key] = ran.get(key, 0) + 1
    log.info("quantization.applied", scheme=plan.scheme, kernels=ran, weight_mb=round(runner.weight_bytes() / 1e6, 2))
    return choices


def decode_step_ms(runner: ModelRunner, installed: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]],
                   steps: int = 16, rounds: int = 3) -> tuple[float, float]:
    """Median ms per single-sequence decode step with the kernels installed, and with float weights."""
    import statistics
    import time

    from dspark.llm.runner.types import SeqChunk

    cache = runner.make_cache(-(-(32 + steps * rounds * 2 + 2) // 16) + 1, 16)
    prompt = [i % runner.cfg.vocab_size for i in range(3, 35)]
    q_times: list[float] = []
    f_times: list[float] = []
    try:
        for r in range(rounds):
            for quantized, sink in ((True, q_times), (False, f_times)):
                for name, fn in installed:
                    runner.set_linear(name, fn if quantized else None)
                sid = f"check-{r}-{quantized}"
                runner.step(cache, [SeqChunk(sid, prompt)])
                runner.step(cache, [SeqChunk(sid, [5])])  # warm
                t0 = time.perf_counter()
                for _ in range(steps):
                    runner.step(cache, [SeqChunk(sid, [7])])
                sink.append((time.perf_counter() - t0) * 1e3 / steps)
                cache.free(sid)
    finally:
        for name, fn in installed:
            runner.set_linear(name, fn)
    return statistics.median(q_times), statistics.median(f_times)
