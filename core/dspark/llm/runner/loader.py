"""Load a local Hugging Face checkpoint of a supported family (families.py) into plain tensors.

No ``transformers`` at run time and no remote code: we read config.json and
the safetensors files ourselves, so what runs is exactly what we checked. An
optimized directory (``dspark convert``'s output) loads as the same float
tensors, dequantized by its plan.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ValidationError
from safetensors import safe_open

from dspark.llm.runner.types import ModelConfig, expected_shapes
from dspark.llm.runner.families import (
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    CheckpointError,
    normalise,
)
from dspark.llm.runner.layout import EMBED, HEAD
from dspark.llm.runner.quant_plan import QuantPlan
from dspark.sdk.quant import QuantizedWeight, dequantize

__all__ = ["SUPPORTED_MODEL_TYPES", "SUPPORTED_ROPE_TYPES", "CheckpointError", "ModelConfig", "expected_shapes",
           "load_checkpoint", "load_config", "parse_config", "read_optimized", "source_parts"]
DType = Literal["float32", "float16", "bfloat16", "fp32", "fp16", "bf16", "auto"]
# An optimized directory's plan and weights (what ``dspark convert`` writes, dspark.llm.quantization.convert).
PLAN_FILE, WEIGHTS_FILE = "dspark_quant_plan.json", "model.safetensors"

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_config(raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
    d = normalise(raw, source)
    if d.get("torch_dtype") is None and isinstance(d.get("dtype"), str):
        d["torch_dtype"] = d["dtype"]  # transformers 5 renamed the field
    eos = d.get("eos_token_id")
    d["eos_token_ids"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    d.pop("eos_token_id", None)
    try:
        cfg = ModelConfig.model_validate(d)
    except ValidationError as e:
        fields = ", ".join(".".join(str(p) for p in err["loc"]) for err in e.errors())
        raise CheckpointError(f"{source}: missing or invalid field(s): {fields}") from e
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(
            f"{source}: num_attention_heads ({cfg.num_attention_heads}) is not a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )
    return cfg


# CPU flags that mean native half-precision matmul; without them torch emulates it, several times slower than fp32.
_NATIVE_CPU_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_dtype(dtype: str | torch.dtype, cfg: ModelConfig | None = None) -> torch.dtype:
    """``auto`` = as stored, except half precision on a GPU-less host whose CPU lacks it natively: float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        stored = _DTYPES.get(cfg.torch_dtype or "float32", torch.float32) if cfg else torch.float32
        flags = _NATIVE_CPU_FLAGS.get(stored)
        if flags and not torch.cuda.is_available() and not _cpu_flags() & set(flags):
            return torch.float32
        return stored
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(sorted(_DTYPES))} or 'auto'")
    return _DTYPES[dtype]


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.exists():
        wm = json.loads(index.read_text())["weight_map"]
        files = [root / f for f in dict.fromkeys(wm.values())]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{index}: shard {f.name} is listed in weight_map but missing")
        return files
    single = root / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(root.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(
        f"{root}: no weights found (expected model.safetensors or model.safetensors.index.json; "
        "only safetensors checkpoints are loaded, never pickles)"
    )


def load_config(path: str | Path) -> ModelConfig:
    root = Path(path)
    cfg_file = root / "config.json"
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
    if not cfg_file.exists():
        raise CheckpointError(f"{cfg_file}: missing config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
    return parse_config(raw, str(cfg_file))


def load_checkpoint(
    path: str | Path, dtype: str | torch.dtype = "auto"
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and weights, check every tensor's presence and shape, cast to ``dtype``."""
    root = Path(path)
    if is_optimized(root):  # an optimized directory (dspark convert)
        cfg, weights = read_optimized(root, dtype)
        check_shapes(cfg, weights, root)
        return cfg, weights
    cfg = load_config(root)
    tdtype = resolve_dtype(dtype, cfg)
    want = expected_shapes(cfg)
    weights: dict[str, torch.Tensor] = {}
    for f in _weight_files(root):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name not in want:
                    continue  # e.g. rotary inv_freq buffers, or a tied lm_head copy
                t = sf.get_tensor(name)
                if tuple(t.shape) != want[name]:
                    raise CheckpointError(
                        f"{f.name}: tensor {name} has shape {tuple(t.shape)}, "
                        f"config.json implies {want[name]}"
                    )
                weights[name] = t.to(tdtype)
    missing = [n for n in want if n not in weights]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{root}: tensor {missing[0]} is missing from the checkpoint{more}")
    return cfg, weights


def page_releaser(path: str | Path) -> Callable[[], None] | None:
    """A call that drops the pages of the checkpoint's weight files this process maps (None: nothing to drop).
    safetensors hands out views of its mapped file, and the pages a fused or transposed copy was made from
    would stay resident beside the copy; a page read again (a tensor the runner holds as a view) comes back
    from the file."""
    from dspark.sdk.mapped import release_files

    root = Path(path)
    if not root.is_dir() or is_optimized(root):
        return None
    files: list[str | Path] = list(_weight_files(root))

    def release() -> None:
        release_files(files)  # the process's mappings read once for every shard

    return release


def check_shapes(cfg: ModelConfig, weights: dict[str, torch.Tensor], root: Path) -> None:
    """Every tensor the config implies is present with its shape (extra ones, e.g. a tied head, may be)."""
    for name, shape in expected_shapes(cfg).items():
        if name not in weights:
            raise CheckpointError(f"{root}: tensor {name} is missing from the checkpoint")
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(f"{root}: tensor {name} has shape {tuple(weights[name].shape)}, "
                                  f"config.json implies {shape}")


# -- optimized directories (what `dspark convert` writes) --------------------------------------------


def is_optimized(path: str | Path) -> bool:
    """True for a directory ``dspark convert`` wrote (it holds a quantization plan)."""
    return (Path(path) / PLAN_FILE).exists()


def source_parts(cfg: ModelConfig, name: str) -> list[tuple[str, int | None]]:
    """The checkpoint tensors a layer stacks, with their output widths (None: the whole layer)."""
    if name in (HEAD, EMBED):
        return [(f"{name}.weight", None)]
    prefix, suffix = name.rsplit(".", 2)[0], ".".join(name.rsplit(".", 2)[1:])
    d = cfg.head_dim
    parts: list[tuple[str, int | None]] = [(suffix, None)]
    if cfg.fused_projections:
        pass  # the checkpoint's own tensors (Phi-3): qkv_proj and gate_up_proj as the runner holds them
    elif suffix == "self_attn.qkv_proj":
        parts = [("self_attn.q_proj", cfg.num_attention_heads * d), ("self_attn.k_proj", cfg.num_key_value_heads * d),
                 ("self_attn.v_proj", cfg.num_key_value_heads * d)]
    elif suffix == "mlp.gate_up_proj":
        parts = [("mlp.gate_proj", cfg.intermediate_size), ("mlp.up_proj", cfg.intermediate_size)]
    return [(f"{prefix}.{p}.weight", w) for p, w in parts]


def read_optimized(root: Path, dtype: str | torch.dtype = "auto") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """An optimized directory's tensors as the float checkpoint names the runner expects (dequantized)."""
    cfg = load_config(root)
    plan = QuantPlan.read(root / PLAN_FILE)
    tdtype = resolve_dtype(dtype, cfg)
    f = root / WEIGHTS_FILE
    if not f.exists():
        raise CheckpointError(f"{f}: missing (an optimized directory keeps all weights in {WEIGHTS_FILE})")
    weights: dict[str, torch.Tensor] = {}
    with safe_open(str(f), framework="pt") as sf:
        names = set(sf.keys())
        for n in names:
            if not n.endswith((".qweight", ".scales")):
                weights[n] = sf.get_tensor(n).to(tdtype)
        for lp in plan.layers:
            if lp.precision == "float":
                continue
            if lp.kind == "embedding" and plan.shares_tied_int8():
                # Stored once as lm_head [hidden, vocab] with per-vocab scales: the same integers, transposed.
                q = sf.get_tensor(f"{HEAD}.qweight").numpy().T
                s = sf.get_tensor(f"{HEAD}.scales").numpy().T
                weights["model.embed_tokens.weight"] = torch.from_numpy(q.astype(np.float32) * s).to(tdtype)
                continue
            for part in ("qweight", "scales"):
                if f"{lp.name}.{part}" not in names:
                    raise CheckpointError(f"{f.name}: tensor {lp.name}.{part} is missing but {PLAN_FILE} "
                                          f"plans {lp.name} as {lp.precision}")
            q = sf.get_tensor(f"{lp.name}.qweight").numpy()
            s = sf.get_tensor(f"{lp.name}.scales").numpy()
            if lp.kind == "embedding":
                weights["model.embed_tokens.weight"] = torch.from_numpy(q.astype(np.float32) * s).to(tdtype)
                continue
            k, n = lp.shape
            bits = 8 if lp.precision == "int8" else 4
            qw = QuantizedWeight(data=q, scales=s, bits=bits, group_size=lp.group_size or k, shape=(k, n))
            w = torch.from_numpy(dequantize(qw)).t()  # [out, in], as checkpoints store it
            off = 0
            for src, width in source_parts(cfg, lp.name):
                width = n if width is None else width
                weights[src] = w[off : off + width].contiguous().to(tdtype)
                off += width
    return cfg, weights
