"""A :class:`~dspark.sdk.decoder.DecoderSpec` for the engine's model, read off its torch runner."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
import torch

from dspark.llm.runner.torch_ops import family_fields
from dspark.sdk.decoder import DecoderSpec, DecoderWeights, LayerWeights
from dspark.types import QuantSpec

if TYPE_CHECKING:
    from dspark.llm.runner.model import ModelRunner


def _np(t: torch.Tensor | None, stored: bool = False) -> np.ndarray | None:
    if t is None:
        return None
    if t.numel() == 0:
        raise ValueError("a float weight was dropped by quantization; the spec needs the float checkpoint")
    t = t.detach().cpu()
    if t.dtype == torch.float32 or (stored and t.dtype == torch.float16):
        return t.numpy()
    if stored and t.dtype == torch.bfloat16:  # the same bits seen as ml_dtypes' bfloat16: a view, no copy
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.float().numpy()


def weights_of(runner: ModelRunner, stored: bool = False) -> DecoderWeights:
    """The runner's weights in the spec's layout (views where the runner holds float32, or ``stored``)."""
    def a(t: torch.Tensor | None) -> np.ndarray | None:
        return _np(t, stored)

    layers = []
    for L in runner.layers:
        layers.append(LayerWeights(
            in_norm=a(L.in_norm), post_norm=a(L.post_norm), qkv=a(L.w_qkv_t), o=a(L.w_o.t()),
            gate_up=a(L.w_gate_up_t), down=a(L.w_down.t()), qkv_bias=a(L.b_qkv), o_bias=a(L.b_o),
            q_norm=a(L.q_norm), k_norm=a(L.k_norm), attn_out_norm=a(L.attn_out_norm),
            mlp_out_norm=a(L.mlp_out_norm)))
    return DecoderWeights(embed=a(runner.embed), norm=a(runner.norm), head=a(runner.lm_head_t), layers=layers)


def fingerprint(path: Path, runner: ModelRunner, extra: object = None) -> str:
    """Identifies weights, config, dtype and any quantization plan: the key of compiled caches."""
    h = hashlib.sha256()
    h.update(runner.cfg.model_dump_json().encode())
    h.update(str(runner.dtype).encode())
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def float_runner(path: Path, dtype: torch.dtype) -> ModelRunner:
    """The checkpoint's float weights again (a quantized runner has dropped those it quantized)."""
    from dspark.llm.runner.model import ModelRunner

    return ModelRunner.from_pretrained(str(path), dtype)


class SpecWeights:
    """A spec's ``weights_fn``: the runner's weights in the spec's layout (the float checkpoint's when the
    runner was quantized). :meth:`from_disk` lets go of the runner: once a compiled decoder runs, a spec
    compiled again (a failover target) reads its weights from the model file instead."""

    def __init__(self, runner: ModelRunner, path: Path, quantized: bool) -> None:
        self.runner: ModelRunner | None = runner
        self.path, self.dtype, self.quantized = path, runner.dtype, quantized
        self._float: ModelRunner | None = None  # the float checkpoint of a quantized runner, read on first use
        self._load: Callable[[], ModelRunner] | None = None

    def from_disk(self, load: Callable[[], ModelRunner]) -> None:
        self.runner = self._float = None
        self._load = load

    def __call__(self, stored: bool = False) -> DecoderWeights:
        if self._load is not None:
            return weights_of(float_runner(self.path, self.dtype) if self.quantized else self._load(), stored)
        if not self.quantized:
            assert self.runner is not None
            return weights_of(self.runner, stored)
        if self._float is None:
            self._float = float_runner(self.path, self.dtype)
        return weights_of(self._float, stored)


def make_spec(runner: ModelRunner, path: Path, *, layers: tuple[int, int] | None = None,
              max_num_tokens: int = 512, max_num_seqs: int = 256,
              quantization: dict[str, QuantSpec] | None = None, extra_features: frozenset[str] = frozenset()) -> DecoderSpec:
    c = runner.cfg
    ropes = runner.ropes
    weights_fn = SpecWeights(runner, path, bool(quantization))

    def rope_tables_fn(index: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        rope, pos = ropes[index], torch.arange(n)
        if rope.kind != "longrope":  # (dynamic NTK changes nothing below max_position_embeddings, where the engine stops)
            cos, sin = rope.cos_sin(pos, torch.float32)
        else:  # rows past max_position_embeddings: the long factors, from position 0 (StepBatch.rope_positions)
            long = pos >= c.max_position_embeddings
            cos, sin = rope.cos_sin(torch.where(long, pos - c.max_position_embeddings, pos), torch.float32,
                                    torch.where(long, rope.orig + 1, 0))
        return cos.numpy(), sin.numpy()

    def rope_fn(n: int) -> tuple[np.ndarray, np.ndarray]:
        return rope_tables_fn(0, n)

    fields = family_fields(runner)
    fields["features"] = fields["features"] | extra_features
    blocks_fn = None
    if "gguf_stored" in extra_features:
        from dspark.llm.gguf.blocks import stored_weights

        blocks_fn = functools.partial(stored_weights, path)
    return DecoderSpec(
        name=path.name, path=str(path), fingerprint=fingerprint(path, runner, {k: v.model_dump() for k, v in (quantization or {}).items()}),
        layers=layers or (0, c.num_hidden_layers),
        exit_layers=tuple(range(1, c.num_hidden_layers)), threads=torch.get_num_threads(),
        max_num_tokens=max_num_tokens,
        max_num_seqs=max_num_seqs, quantization=quantization,
        weights_fn=weights_fn, stored_weights_fn=functools.partial(weights_fn, stored=True), rope_fn=rope_fn,
        rope_tables_fn=rope_tables_fn, blocks_fn=blocks_fn, **fields)
