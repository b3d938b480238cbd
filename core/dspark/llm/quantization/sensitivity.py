"""Calibration: each layer's sensitivity, activation outliers, and the plan under ``max_drop``.

The measure is the one the budget is stated in: relative increase of
calibration perplexity when one layer alone is fake-quantized (canonical
rounding, :mod:`dspark.llm.quantization.fake`), everything else float. The plan
then starts from the lowest precision everywhere (``sensitive_layers`` stay
float) and, like NNCF's accuracy control, moves the layer that hurt most
alone up one precision (int4 -> int8 -> float) until the whole mix is within
the budget.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dspark.llm.runner.model import EMBED, HEAD
from dspark.host.log import get_logger
from dspark.llm.config import QuantizationConfig
from dspark.llm.quantization.data import calibration_windows
from dspark.llm.quantization.evaluate import nll_sum
from dspark.llm.quantization.fake import fake_linear, quantize_rows_int8
from dspark.llm.runner.quant_plan import LADDER, LayerPlan, Precision, QuantPlan

if TYPE_CHECKING:
    from dspark.llm.runner.model import ModelRunner

log = get_logger("dspark.llm.quantization")

Progress = Callable[[str, int, int], None]


def matches(name: str, patterns: list[str]) -> str | None:
    """The first pattern naming ``name``: fnmatch when it has wildcards, else a substring."""
    for p in patterns:
        if any(c in p for c in "*?[") and fnmatch.fnmatchcase(name, p):
            return p
        if p in name:
            return p
    return None


def check_patterns(runner: ModelRunner, patterns: list[str]) -> None:
    names = runner.linear_names() + [EMBED]
    for p in patterns:
        if any(matches(n, [p]) for n in names):
            continue
        raise ValueError(f"quantization_config.sensitive_layers: {p!r} matches no layer of this model "
                         f"(layers look like {names[0]!r}, {HEAD!r}, {EMBED!r})")


class _Installer:
    """Puts fake-quantized layers on a float runner and takes them off again."""

    def __init__(self, runner: ModelRunner, cfg: QuantizationConfig) -> None:
        self.runner, self.cfg = runner, cfg
        self._embed_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def put(self, name: str, precision: Precision, act_int8: bool) -> None:
        r = self.runner
        if name == EMBED:
            if precision != "float":
                if self._embed_rows is None:
                    self._embed_rows = quantize_rows_int8(r.embed)
                r.embed_q = self._embed_rows  # _lookup prefers it; the float table stays for restoring
            return
        if precision == "float":
            r.set_linear(name, None)
            return
        bits = 8 if precision == "int8" else 4
        group = None if bits == 8 else self.cfg.group_size
        r.set_linear(name, fake_linear(r.weight_t(name), bits, group, act_int8 and bits == 8))

    def reset(self, name: str) -> None:
        if name == EMBED:
            self.runner.embed_q = None
        else:
            self.runner.set_linear(name, None)


def _baseline(runner: ModelRunner, windows: list[list[int]]) -> tuple[float, int, dict[str, float]]:
    """One float pass: summed NLL, token count, and per projection input p99 over tokens of max|x| / rms(x)."""
    stats: dict[str, list[torch.Tensor]] = {}
    names = runner.linear_names()

    def recorder(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        w = runner.weight_t(name)

        def fn(x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            rms = xf.pow(2).mean(-1).sqrt().clamp_min(1e-12)
            stats.setdefault(name, []).append(xf.abs().amax(-1) / rms)
            return x @ w

        return fn

    for n in names:
        runner.set_linear(n, recorder(n))
    try:
        nll, _, ntok = nll_sum(runner, windows)
    finally:
        for n in names:
            runner.set_linear(n, None)
    return nll, ntok, {n: float(torch.quantile(torch.cat(v), 0.99)) for n, v in stats.items()}


def _layer_bytes(runner: ModelRunner, name: str, p: Precision, group: int) -> int:
    shape = (runner.cfg.vocab_size, runner.cfg.hidden_size) if name == EMBED else tuple(runner.weight_t(name).shape)
    lp = LayerPlan(name=name, kind="embedding" if name == EMBED else "linear", shape=shape, precision=p,
                   group_size=group if p == "int4" else None)
    return lp.weight_bytes(4)


def _spend_size_budget(runner: ModelRunner, names: list[str], prec: dict[str, Precision],
                       rungs: dict[str, list[Precision]], forced: dict[str, str], moved: dict[str, str],
                       sensitivity: Callable[[str, Precision], float], cfg: QuantizationConfig) -> None:
    """Move layers up while bytes allow, the most measured harm per added byte first."""
    g = cfg.group_size
    tied = runner.cfg.tie_word_embeddings
    floats = sum(_layer_bytes(runner, n, "float", g) for n in names)
    if tied:
        floats -= _layer_bytes(runner, EMBED, "float", g)
    limit = cfg.max_weight_ratio * floats if cfg.max_weight_ratio is not None else float(floats)
    def size() -> int:
        total = sum(_layer_bytes(runner, n, prec[n], g) for n in names)
        if tied and prec.get(EMBED) == "int8" and prec.get(HEAD) == "int8":
            total -= _layer_bytes(runner, EMBED, "int8", g)  # one shared matrix
        return total

    while True:
        used = size()
        best, best_gain = None, 0.0
        for n in names:
            if prec[n] == "float" or n in forced:
                continue
            up = rungs[n][rungs[n].index(prec[n]) + 1]
            before = prec[n]
            prec[n] = up
            extra = size() - used
            prec[n] = before
            harm = sensitivity(n, prec[n])
            gain = harm / max(extra, 1)
            if harm > 0 and used + extra <= limit and gain > best_gain:
                best, best_gain = n, gain
        if best is None:
            return
        up = rungs[best][rungs[best].index(prec[best]) + 1]
        moved[best] = (f"moved up from {prec[best]} with spare size: {100 * sensitivity(best, prec[best]):+.2f}% "
                       f"alone, the most per added byte within {cfg.max_weight_ratio:g}x float32")
        prec[best] = up


def build_plan(runner: ModelRunner, model_path: str | Path, cfg: QuantizationConfig, *,
               progress: Progress | None = None, float_dtype: str = "float32") -> QuantPlan:
    """Measure and plan. ``runner`` must be float (no kernels installed); it is left as it was."""
    if not cfg.enabled:
        raise ValueError("quantization_config.method is 'none': nothing to plan")
    check_patterns(runner, cfg.sensitive_layers)
    eos = runner.cfg.eos_token_ids
    windows = calibration_windows(model_path, data_path=cfg.calibration_data_path, seq_len=cfg.calibration_seq_len,
                                  samples=cfg.calibration_samples, eos_id=eos[0] if eos else None)
    names = runner.linear_names() + [EMBED]
    low: Precision = "int8" if cfg.weight_bits == 8 else "int4"
    mixed = cfg.method == "auto_mixed_precision"
    rungs: dict[str, list[Precision]] = {}
    for n in names:
        start = "int8" if n == EMBED else low  # a gather has no int4 kernel here
        rungs[n] = list(LADDER[LADDER.index(start):])
    inst = _Installer(runner, cfg)
    step = 0
    total_steps = 2 + (len(names) if mixed else 0)

    def tick(what: str) -> None:
        nonlocal step
        step += 1
        if progress is not None:
            progress(what, step, total_steps)

    base_nll, ntok, outlier = _baseline(runner, windows)
    tick("float baseline and activation statistics")
    act8 = {n: cfg.activations == "dynamic_int8" and outlier.get(n, 0.0) <= cfg.outlier_threshold for n in names}

    def rel(nll: float) -> float:
        return math.exp((nll - base_nll) / ntok) - 1.0

    sens: dict[str, dict[str, float]] = {n: {} for n in names}

    def sensitivity(n: str, p: Precision) -> float:
        """Measured on first need: a layer's higher rungs only if accuracy control moves it there."""
        if p not in sens[n]:
            inst.put(n, p, act8[n])
            try:
                sens[n][p] = round(rel(nll_sum(runner, windows)[0]), 6)  # as the plan file stores it
            finally:
                inst.reset(n)
        return sens[n][p]

    if mixed:
        for n in names:
            sensitivity(n, rungs[n][0])
            tick(f"{n} at {rungs[n][0]}")

    forced = {n: m for n in names if (m := matches(n, cfg.sensitive_layers))}
    prec: dict[str, Precision] = {n: ("float" if n in forced else rungs[n][0]) for n in names}
    moved: dict[str, str] = {}

    def evaluate_mix() -> float:
        for n in names:
            inst.put(n, prec[n], act8[n])
        try:
            return rel(nll_sum(runner, windows)[0])
        finally:
            for n in names:
                inst.reset(n)

    drop = evaluate_mix()
    tick("the planned mix")
    history = [drop]
    while mixed and drop > cfg.budget:
        movable = [n for n in names if prec[n] != "float"]
        if not movable:
            break
        worst = max(movable, key=lambda n: sensitivity(n, prec[n]))
        up = rungs[worst][rungs[worst].index(prec[worst]) + 1]
        moved[worst] = (f"moved up from {prec[worst]}: {100 * sens[worst][prec[worst]]:+.2f}% alone, "
                        f"the worst left while the mix was {100 * drop:+.2f}%")
        prec[worst] = up
        drop = evaluate_mix()
        history.append(drop)
    if (mixed and runner.cfg.tie_word_embeddings and prec[HEAD] == "int4" and prec[EMBED] == "int8"
            and HEAD not in forced):
        # One matrix serves both: int8 shared with the embedding is smaller than a separate int4 head.
        prec[HEAD] = "int8"
        moved[HEAD] = "int8, shared with the tied int8 embedding (smaller than a separate int4 copy)"
        drop = evaluate_mix()
        history.append(drop)
    if mixed and cfg.max_weight_ratio is not None:
        _spend_size_budget(runner, names, prec, rungs, forced, moved, sensitivity, cfg)
        drop = evaluate_mix()
        history.append(drop)
    layers: list[LayerPlan] = []
    for n in names:
        p = prec[n]
        if n in forced:
            why = f"sensitive_layers: {forced[n]!r}"
        elif n in moved:
            why = moved[n]
        elif not mixed:
            why = f"uniform {p}"
        else:
            why = f"{100 * sens[n].get(p, 0.0):+.2f}% alone; the mix is within budget"
        if p == "int8" and n != EMBED and not act8[n]:
            why += ("; float activations (input outliers "
                    f"{outlier.get(n, 0.0):.1f} > {cfg.outlier_threshold:g})" if cfg.activations == "dynamic_int8"
                    else "; float activations (config)")
        shape = (runner.cfg.vocab_size, runner.cfg.hidden_size) if n == EMBED else tuple(runner.weight_t(n).shape)
        layers.append(LayerPlan(
            name=n, kind="embedding" if n == EMBED else "linear", shape=shape, precision=p,
            group_size=cfg.group_size if p == "int4" else None,
            activations="dynamic_int8" if p == "int8" and n != EMBED and act8[n] else "float",
            sensitivity={k: round(v, 6) for k, v in sens[n].items()},
            act_outlier=None if n == EMBED else round(outlier.get(n, 0.0), 3), reason=why))
    plan = QuantPlan(
        scheme=cfg.scheme, weight_bits=cfg.weight_bits, group_size=cfg.group_size, budget=cfg.budget,
        float_dtype=float_dtype, tied_embeddings=runner.cfg.tie_word_embeddings, layers=layers,
        calibration={"windows": len(windows), "seq_len": cfg.calibration_seq_len, "tokens": ntok,
                     "source": str(cfg.calibration_data_path or "default: stdlib files not held out"),
                     "float_ppl": round(math.exp(base_nll / ntok), 4),
                     "planned_ppl": round(math.exp(base_nll / ntok) * (1 + drop), 4), "drop": round(drop, 6),
                     "accuracy_control_steps": len(history) - 1})
    log.info("quantization.plan", scheme=plan.scheme, counts=plan.counts(), drop=round(drop, 5),
             budget=cfg.budget, bytes_ratio=round(plan.weight_bytes() / plan.float_bytes(), 4))
    return plan
