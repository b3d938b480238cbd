"""GGUF files: ``dspark.LLM("model.gguf")``, ``dspark serve --model model.gguf``, ``dspark convert``.

The file is read through the ``gguf`` package: the architecture and config from
its metadata (metadata.py), the tokenizer from its vocabulary and merges
(tokenizer.py), float tensors as stored and quantized ones dequantized
(tensors.py); Q8_0 projections then run on the plugins' int8 kernels, which
hold its blocks exactly, and every other quantized type is dequantized with
the reason logged (plan.py). docs/model-sources.md has the table.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dspark.llm.gguf.metadata import SUPPORTED_ARCHITECTURES, GGUFError, is_gguf
from dspark.llm.gguf.plan import TypeDecision

if TYPE_CHECKING:
    from dspark.llm.runner.types import ModelConfig
    from dspark.llm.runner.model import ModelRunner
    from dspark.llm.runner.quant_plan import QuantPlan

__all__ = ["BF16_BLOCKS", "SUPPORTED_ARCHITECTURES", "GGUFError", "GGUFModel", "TypeDecision", "block_types", "is_gguf",
           "is_quantized", "load_gguf", "load_runner", "read_tokenizer_config", "tensor_dtype", "write_checkpoint"]
FLOAT_TYPES = ("F32", "F16", "BF16")
SOURCE_FILE = "dspark_gguf_source.json"  # what write_checkpoint records about the file it came from


@dataclass
class GGUFModel:
    """A GGUF file as the engine uses it."""

    path: Path
    raw_config: dict[str, Any]  # as a config.json would say it
    cfg: ModelConfig
    weights: dict[str, torch.Tensor]  # emptied once a runner holds them (load_runner)
    stored: dict[str, Any]  # Hugging Face tensor name -> tensors.StoredTensor
    tokenizer: Any  # tokenizers.Tokenizer, or None for a tokenizer model not built here
    tokenizer_config: dict[str, Any]
    plan: QuantPlan | None = None  # set by attach(): the file's types over the runner's projections
    decisions: dict[str, TypeDecision] = field(default_factory=dict)  # per storage type, what dspark does

    @property
    def int8_layers(self) -> list[str]:
        return [] if self.plan is None else [lp.name for lp in self.plan.layers if lp.precision == "int8"]

    def attach(self, runner: ModelRunner) -> None:
        """Decide each projection's kernel from the file's types (logged per type)."""
        from dspark.llm.gguf.plan import plan_for

        self.plan, self.decisions = plan_for(runner, self.stored, self.path.name)


def load_gguf(path: str | Path, dtype: str | torch.dtype = "auto", *, tensors: bool = True) -> GGUFModel:
    """Read a GGUF file: config, tokenizer and every tensor (float, cast to ``dtype``; "stored" = the file's
    float type, float32 when anything is quantized). ``tensors=False``: metadata, config, tokenizer and each
    tensor's storage type only (nothing dequantized; ``weights`` stays empty)."""
    from dspark.llm.gguf.metadata import open_reader, read_metadata, to_config
    from dspark.llm.gguf.tensors import ROPE_FREQS, load_tensors, read_tensor, shapes, stored_types
    from dspark.llm.gguf.tokenizer import build_tokenizer, tokenizer_config
    from dspark.llm.runner.loader import check_shapes, parse_config

    p = Path(path)
    reader = open_reader(p)
    md = read_metadata(reader)
    rope_freqs = next((read_tensor(t, p) for t in reader.tensors if t.name == ROPE_FREQS), None)
    raw = to_config(md, shapes(reader), p, rope_freqs)
    cfg = parse_config(raw, str(p))
    kinds = stored_types(reader)
    tdtype = tensor_dtype(cfg, dtype, blocks=block_types(kinds))
    if tensors:
        weights, stored = load_tensors(reader, raw, p, tdtype)
        check_shapes(cfg, weights, p)
    else:
        weights, stored = {}, kinds
    return GGUFModel(path=p, raw_config=raw, cfg=cfg, weights=weights, stored=stored,
                     tokenizer=build_tokenizer(md, p), tokenizer_config=tokenizer_config(md))


# Block types OpenVINO holds as 4-bit weights. On AMX it steps them in bfloat16 as fast as in float32 and
# prefills about twice as fast; 8-bit ones (Q8_0, Q5_0, Q6_K) it steps faster in float32, on its int8 kernels.
BF16_BLOCKS = frozenset({"Q4_0", "Q4_K"})


def tensor_dtype(cfg: ModelConfig, dtype: str | torch.dtype, *, blocks: frozenset[str] = frozenset()) -> torch.dtype:
    """The float type the file's tensors are read as and the model computes in: ``dtype`` ("stored": the
    file's float type, float32 when anything is quantized). ``"auto"`` for a quantized file (``blocks``: its
    tensors' storage types), which has no float type of its own: bfloat16 on a GPU, and on a CPU with AMX's
    bfloat16 tiles where the file holds 4-bit blocks (:data:`BF16_BLOCKS`; docs/model-sources.md), else
    float32. llama.cpp computes in float32 whatever the engine's dtype."""
    from dspark.host import hostinfo
    from dspark.llm.runner.loader import resolve_dtype

    if dtype == "auto" and blocks - set(FLOAT_TYPES):
        amx = "amx_bf16" in hostinfo.cpu_static()["isa_features"]
        if torch.cuda.is_available() or (amx and blocks & BF16_BLOCKS):
            return torch.bfloat16
        return torch.float32
    return resolve_dtype(cfg.torch_dtype or "float32" if dtype == "stored" else dtype, cfg)


def block_types(stored: dict[str, Any]) -> frozenset[str]:
    """The storage types of a file's tensors (F32, Q4_K, ...): ``GGUFModel.stored``."""
    return frozenset(s.ggml_type for s in stored.values())


def is_quantized(g: GGUFModel) -> bool:
    """The file stores some tensor in a block-quantized type (Q4_K, Q8_0, ...)."""
    return bool(block_types(g.stored) - set(FLOAT_TYPES))


def load_runner(path: str | Path, dtype: str | torch.dtype = "auto", *,
                weightless_if_quantized: bool = False) -> tuple[ModelRunner, GGUFModel | None]:
    """The runner for a checkpoint directory or a GGUF file (with what the file holds, for the engine).
    ``weightless_if_quantized``: for a quantized GGUF file, a runner without weights
    (:meth:`ModelRunner.weightless`): a decoder that runs the file as stored may make the torch copy needless."""
    from dspark.llm.runner.model import ModelRunner

    if not is_gguf(path):
        return ModelRunner.from_pretrained(str(path), dtype), None
    if weightless_if_quantized:
        g = load_gguf(path, dtype, tensors=False)
        if is_quantized(g):
            return ModelRunner.weightless(g.cfg, tensor_dtype(g.cfg, dtype, blocks=block_types(g.stored))), g
    g = load_gguf(path, dtype)
    runner = ModelRunner(g.cfg, g.weights, tensor_dtype(g.cfg, dtype, blocks=block_types(g.stored)))
    g.weights = {}  # the runner holds its own (stacked) copies
    g.attach(runner)
    return runner, g


def read_tokenizer_config(path: str | Path) -> dict[str, Any]:
    """The file's chat template and special tokens, as a tokenizer_config.json would hold them (metadata only)."""
    from dspark.llm.gguf.metadata import open_reader, read_metadata
    from dspark.llm.gguf.tokenizer import tokenizer_config

    return tokenizer_config(read_metadata(open_reader(Path(path))))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_checkpoint(path: str | Path, out: Path) -> GGUFModel:
    """Write the file as a Hugging Face checkpoint directory (config.json, tokenizer files, float safetensors
    as loaded: F32/F16 as stored, quantized types dequantized to float32), for `dspark convert`."""
    from safetensors.torch import save_file

    from dspark.llm.runner.model import ModelRunner

    g = load_gguf(path, "stored")
    g.attach(ModelRunner(g.cfg, dict(g.weights), next(iter(g.weights.values())).dtype))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(g.raw_config, indent=2, sort_keys=True) + "\n")
    if g.tokenizer is not None:
        g.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(g.tokenizer_config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in sorted(g.weights.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    source = {"file": g.path.name, "sha256": _sha256(g.path),
              "types": {k: vars(d) for k, d in sorted(g.decisions.items())}}
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n")
    return g

