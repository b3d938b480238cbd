"""Optimized model directories: what ``dspark convert`` writes and the engine loads.

Layout (all JSON with sorted keys and no timestamps, so converting the same
input twice gives byte-identical files)::

    config.json, tokenizer*.json, ...   copied from the source checkpoint
    model.safetensors                   float tensors under their checkpoint names (source dtype), and
                                        for each quantized layer NAME: NAME.qweight (int8 [in, out], or
                                        int4 packed two per byte along `in`, low nibble first) and
                                        NAME.scales (float32 [groups, out]); the embedding as int8 rows
                                        with one scale per row. Fused projections keep vLLM's names
                                        (self_attn.qkv_proj = q, k, v stacked; mlp.gate_up_proj).
    dspark_quant_plan.json              the plan: per layer sensitivity, precision, why
    dspark_draft.json                   the draft spec; draft/ holds the draft checkpoint when there is one
    dspark_device_plan.json             where the placer puts each piece on the converting machine
    dspark_meta.json                    format, versions, the source's and calibration file's hashes

The stored integers are the canonical layout of :mod:`dspark.sdk.quant`; at load
each plugin repacks them for its own kernels (re-quantizing the dequantized
weights reproduces them exactly: symmetric absmax rounding is idempotent).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dspark.host.log import get_logger
from dspark.llm.quantization.apply import spec_for
from dspark.llm.config import QuantizationConfig
from dspark.llm.runner.layout import EMBED, HEAD
from dspark.llm.runner.loader import (
    PLAN_FILE, WEIGHTS_FILE, is_optimized, load_checkpoint, load_config, source_parts,
)
from dspark.llm.runner.model import ModelRunner
from dspark.llm.runner.quant_plan import QuantPlan
from dspark.sdk.quant import quantize_weight

__all__ = ["DEVICE_FILE", "DRAFT_FILE", "FORMAT", "META_FILE", "PLAN_FILE", "WEIGHTS_FILE", "ConvertError", "convert",
           "is_optimized", "source_hash"]

log = get_logger("dspark.llm.quantization")

FORMAT = "dspark-optimized/1"
DRAFT_FILE, DEVICE_FILE, META_FILE = "dspark_draft.json", "dspark_device_plan.json", "dspark_meta.json"
_SKIP_COPY = {"model.safetensors.index.json"}

Progress = Callable[[str, int, int], None]


class ConvertError(ValueError):
    """Bad converter input; the message names the file, flag or field."""


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_hash(root: Path) -> str:
    """One hash over every file of a checkpoint directory (relative names and contents, sorted)."""
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + _sha256(f).encode() + b"\n")
    return h.hexdigest()


# -- conversion ------------------------------------------------------------------------------------


def _check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        if out.is_dir() and not any(out.iterdir()):
            return
        raise ConvertError(f"--output-path {out}: already exists (pass --overwrite to replace it)")
    if not out.parent.exists():
        raise ConvertError(f"--output-path {out}: parent directory {out.parent} does not exist")


def _draft_spec(source: Path, spec: str, tmp: Path) -> dict[str, Any]:
    from dspark.llm.speculative.drafters import compatibility_problem, find_draft_models

    if spec == "none":
        return {"draft_model": "none", "strategy": "deepspec",
                "note": "no separate draft model; self-drafting and n-gram drafters remain"}
    if spec == "auto":
        found = find_draft_models(source)
        if not found:
            return {"draft_model": "none", "strategy": "deepspec",
                    "note": f"auto: no draft checkpoint found for {source.name}; self-drafting and n-gram remain"}
        draft = found[0]
    else:
        draft = Path(spec)
        if not (draft / "config.json").exists():
            raise ConvertError(f"--speculative-draft-model-spec {spec}: no checkpoint (config.json) there")
        problem = compatibility_problem(source, draft)
        if problem:
            raise ConvertError(f"--speculative-draft-model-spec {spec}: cannot draft for {source.name}: {problem}")
    shutil.copytree(draft, tmp / "draft", ignore=shutil.ignore_patterns("__pycache__"))
    return {"draft_model": "draft", "source_name": draft.name, "source_sha256": source_hash(draft),
            "strategy": "deepspec", "chosen_by": spec}


def _device_plan(runner: ModelRunner, devices: str) -> dict[str, Any]:
    from dspark.llm.device_map.layers import map_layers
    from dspark.llm.device_map.torch_layers import host_and_inventory

    host, inv = host_and_inventory(devices)
    lp = map_layers(runner.cfg, host, inv, max_model_len=runner.cfg.max_position_embeddings,
                    max_total_tokens=8192, dtype="float32", decode_batch=8, prefill_chunk=128)
    return {"devices": devices, "embed": lp.embed.device_id, "head": lp.head.device_id,
            "layers": [p.device_id for p in lp.layers],
            "note": "the placer's choice on the converting machine; the engine re-plans where it loads"}


def _quantized_tensors(runner: ModelRunner, plan: QuantPlan) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for lp in plan.layers:
        if lp.precision == "float" or (lp.kind == "embedding" and plan.shares_tied_int8()):
            continue  # a shared tied matrix is stored once, as lm_head
        if lp.kind == "embedding":
            from dspark.llm.quantization.fake import quantize_rows_int8

            q, s = quantize_rows_int8(runner.embed)
        else:
            qw = quantize_weight(runner.weight_t(lp.name).detach().float().numpy(), spec_for(lp))
            q, s = torch.from_numpy(np.ascontiguousarray(qw.data)), torch.from_numpy(np.ascontiguousarray(qw.scales))
        out[f"{lp.name}.qweight"], out[f"{lp.name}.scales"] = q.contiguous(), s.contiguous()
    return out


def convert(model_path: str | Path, output_path: str | Path, *,
            quantization: str | dict[str, Any] | QuantizationConfig = "int8_mixed",
            draft_spec: str = "auto", calibration_data_path: str | Path | None = None, devices: str = "auto",
            overwrite: bool = False, progress: Progress | None = None, plan: QuantPlan | None = None) -> QuantPlan:
    """Write an optimized directory; on any error nothing is left at ``output_path``. ``model_path`` may be a
    GGUF file (_convert_gguf); ``plan``: a ready plan to write instead of calibrating one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from dspark.llm.gguf import is_gguf
    from dspark.llm.quantization.data import load_jsonl
    from dspark.llm.quantization.sensitivity import build_plan

    src, out = Path(model_path), Path(output_path)
    if isinstance(quantization, QuantizationConfig):
        qcfg = quantization
    else:
        qcfg = QuantizationConfig.model_validate(quantization if isinstance(quantization, dict) else
                                                 {"method": quantization})
    if is_gguf(src):
        return _convert_gguf(src, out, qcfg, draft_spec=draft_spec, calibration_data_path=calibration_data_path,
                             devices=devices, overwrite=overwrite, progress=progress)
    load_config(src)  # a clear CheckpointError for a missing directory or config.json, before any work
    if is_optimized(src):
        raise ConvertError(f"--model-path {src}: already an optimized directory; convert the original checkpoint")
    if calibration_data_path is not None:
        qcfg = qcfg.model_copy(update={"calibration_data_path": Path(calibration_data_path)})
    if qcfg.calibration_data_path is not None:
        load_jsonl(qcfg.calibration_data_path)  # bad lines fail now, naming the line, before anything is written
    if draft_spec not in ("auto", "none") and not Path(draft_spec).exists():
        raise ConvertError(f"--speculative-draft-model-spec {draft_spec}: expected auto, none or a checkpoint directory")
    _check_output(out, overwrite)

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        # Calibrate in float32 whatever the checkpoint's dtype: the plan must not depend on the host.
        cfg, weights = load_checkpoint(src, "float32")
        runner = ModelRunner(cfg, weights, torch.float32)
        if plan is not None:
            pass  # a GGUF file's own types
        elif qcfg.enabled:
            plan = build_plan(runner, src, qcfg, progress=progress)
        else:
            from dspark.llm.runner.quant_plan import LayerPlan

            plan = QuantPlan(scheme="none", weight_bits=8, group_size=qcfg.group_size, budget=0.0, layers=[
                LayerPlan(name=n, kind="linear", shape=tuple(runner.weight_t(n).shape), precision="float",
                          reason="scheme none") for n in runner.linear_names()])
        quantized = {lp.name for lp in plan.layers if lp.precision != "float"}
        drop = {t for n in quantized for t, _ in source_parts(cfg, n)}
        tensors: dict[str, torch.Tensor] = {}
        float_head = cfg.tie_word_embeddings and EMBED in quantized and HEAD not in quantized
        for f in sorted(p for p in src.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                    if name == f"{EMBED}.weight" and float_head:
                        # The head stays float while the embedding goes int8: store the float head apart.
                        tensors[f"{HEAD}.weight"] = sf.get_tensor(name).contiguous()
                    if name not in drop:
                        tensors[name] = sf.get_tensor(name).contiguous()
        tensors.update(_quantized_tensors(runner, plan))
        # One metadata key only: safetensors writes a map in hash order, so two keys would not be byte-stable.
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for f in sorted(src.iterdir()):
            if f.is_file() and f.suffix != ".safetensors" and f.name not in _SKIP_COPY:
                shutil.copy2(f, tmp / f.name)
        (tmp / PLAN_FILE).write_text(plan.to_json())
        (tmp / DRAFT_FILE).write_text(_json(_draft_spec(src, draft_spec, tmp)))
        (tmp / DEVICE_FILE).write_text(_json(_device_plan(runner, devices)))
        (tmp / META_FILE).write_text(_json(_meta(src, qcfg, plan, tmp)))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("convert.done", source=str(src), output=str(out), scheme=plan.scheme, counts=plan.counts())
    return plan


def _convert_gguf(src: Path, out: Path, qcfg: QuantizationConfig, **kw: Any) -> QuantPlan:
    """A GGUF file, written as a checkpoint first (float tensors as stored, quantized ones dequantized).
    ``--quantization none`` keeps the file's own types (its Q8_0 projections as int8 with 32-value groups, exact;
    dspark.llm.gguf.plan); any other scheme is calibrated on the dequantized weights, as for any checkpoint."""
    from dspark.llm.gguf import write_checkpoint

    _check_output(out, bool(kw.get("overwrite")))
    work = out.parent / f".{out.name}.gguf-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    try:
        g = write_checkpoint(src, work / src.stem)
        if qcfg.enabled:
            log.info("convert.gguf_requantized", source=str(src), scheme=qcfg.scheme,
                     reason="the file's types were dequantized; the requested scheme is calibrated on those weights")
        return convert(work / src.stem, out, quantization=qcfg, plan=None if qcfg.enabled else g.plan, **kw)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _meta(src: Path, qcfg: QuantizationConfig, plan: QuantPlan, tmp: Path) -> dict[str, Any]:
    import importlib.metadata as md

    from dspark.hookspecs import API_VERSION

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    calib = qcfg.calibration_data_path
    return {
        "format": FORMAT, "dspark": version("dspark"), "plugin_api": API_VERSION,
        "versions": {d: version(d) for d in ("torch", "openvino", "onnxruntime-gpu", "onnxruntime", "safetensors")},
        "source": {"name": src.name, "sha256": source_hash(src)},
        "quantization": {**json.loads(qcfg.model_dump_json()), "calibration_data_path": None if calib is None
                         else Path(calib).name},
        "calibration_sha256": None if calib is None else _sha256(Path(calib)),
        "weights_sha256": _sha256(tmp / WEIGHTS_FILE),
        "plan": {"scheme": plan.scheme, "counts": plan.counts(), "weight_bytes": plan.weight_bytes(),
                 "float32_bytes": plan.float_bytes()},
    }
