"""A quantized GGUF file's float reference within a memory budget: the probe's judge of a decoder that runs the
file as stored (dspark.llm.decoding.probe_child).

Dequantized whole, a file takes four bytes a weight (a 3B Q4_K_M file, 2 GB on disk, some 12 GB), more than the
edge box that runs the file as stored may have. Here each quantized matrix is dequantized when the forward
reaches it, by the same ``gguf.dequantize`` and row order as ``load_gguf``; the matrices first reached are kept
while they fit the budget, the rest are dequantized again at each use (the head's in slices of rows, the
embedding's only the rows looked up), so the process holds at most the budget plus one matrix (a head slice) of
float weights. Every projection takes the same path whether its matrix is kept or not, so the logits do not
depend on the budget.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dspark.llm.runner.model import ModelRunner

BUDGET_ENV = "DSPARK_REFERENCE_BYTES"  # bytes of float weights the reference may keep; default: half of free RAM
HEAD_SLICE_ROWS = 4096  # rows of an unkept head (or embedding, as a tied head) dequantized at a time


def default_budget() -> int:
    """``DSPARK_REFERENCE_BYTES`` if set, else half of the memory available now (a cgroup's limit honoured)."""
    env = os.environ.get(BUDGET_ENV)
    if env:
        try:
            return max(0, int(env))
        except ValueError as e:
            raise ValueError(f"{BUDGET_ENV}={env!r}: expected a number of bytes") from e
    from dspark.host import hostinfo

    return hostinfo.memory()[1] // 2


@dataclass
class _Budget:
    left: int
    kept: int = 0  # bytes of float weights held


@dataclass
class _Matrix:
    """One quantized [out, in] matrix of the file, as float on demand."""

    tensor: Any  # the reader's tensor: data is [out, bytes a row]
    dtype: torch.dtype
    heads: int | None  # Llama's q/k rows to put back in Hugging Face's order (tensors.unpermute)
    budget: _Budget
    held: torch.Tensor | None = field(default=None, repr=False)
    tried: bool = False  # the budget was asked once, at first use: what is kept is decided in forward order

    @property
    def nbytes(self) -> int:
        rows = int(self.tensor.data.shape[0])
        cols = int(self.tensor.shape[0])  # ggml's first dimension: the row's length
        return rows * cols * self.dtype.itemsize

    def rows(self, sl: slice | np.ndarray) -> torch.Tensor:
        """The float rows ``sl`` (no row permutation: the embedding and the head)."""
        from gguf import dequantize

        if self.held is not None:
            return self.held[torch.as_tensor(sl) if isinstance(sl, np.ndarray) else sl]
        part = np.asarray(dequantize(self.tensor.data[sl], self.tensor.tensor_type), dtype=np.float32)
        return torch.from_numpy(np.ascontiguousarray(part)).to(self.dtype)

    def full(self) -> torch.Tensor:
        """The whole matrix in Hugging Face's row order; kept if it is the first use and it fits the budget."""
        if self.held is not None:
            return self.held
        from gguf import dequantize

        from dspark.llm.gguf.tensors import unpermute

        w = np.asarray(dequantize(self.tensor.data, self.tensor.tensor_type), dtype=np.float32)
        if self.heads is not None:
            w = unpermute(w, self.heads)
        out = torch.from_numpy(np.ascontiguousarray(w)).to(self.dtype)
        if not self.tried:
            self.tried = True
            if self.nbytes <= self.budget.left:
                self.held = out
                self.budget.left -= self.nbytes
                self.budget.kept += self.nbytes
        return out


Part = torch.Tensor | _Matrix


def _weight(p: Part) -> torch.Tensor:
    return p.full() if isinstance(p, _Matrix) else p


def _projection(parts: list[Part]) -> Callable[[torch.Tensor], torch.Tensor]:
    """x[T, in] -> x @ cat(parts).T, a part at a time."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, _weight(p)) for p in parts], dim=-1)
    return fn


def _head(m: _Matrix) -> Callable[[torch.Tensor], torch.Tensor]:
    """x[T, hidden] -> logits, the head's rows dequantized a slice at a time unless they are kept."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        if m.held is not None or (not m.tried and m.nbytes <= m.budget.left):
            return F.linear(x, m.full())
        m.tried = True
        n = int(m.tensor.data.shape[0])
        return torch.cat([F.linear(x, m.rows(slice(i, min(n, i + HEAD_SLICE_ROWS))))
                          for i in range(0, n, HEAD_SLICE_ROWS)], dim=-1)
    return fn


class ReferenceRunner(ModelRunner):
    """The torch runner over a file's weights as :mod:`reference` holds them."""

    embed_matrix: _Matrix | None = None
    budget: _Budget

    def _lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.embed_matrix is None:
            return super()._lookup(tokens)
        ids = tokens.cpu().numpy()
        uniq, inv = np.unique(ids, return_inverse=True)
        return self.embed_matrix.rows(uniq)[torch.from_numpy(inv.reshape(-1))]

    @property
    def kept_bytes(self) -> int:
        """Bytes of dequantized weights kept between steps (within the budget)."""
        return self.budget.kept


def reference_runner(path: str | Path, dtype: str | torch.dtype = "auto", budget: int | None = None) -> ReferenceRunner:
    """The file's torch runner with its quantized matrices dequantized at use, keeping at most ``budget`` bytes
    of them (None: :func:`default_budget`). Float tensors (norms, biases, F32/F16/BF16 matrices) load as stored."""
    from dspark.llm.gguf import GGUFError, block_types, load_gguf, tensor_dtype
    from dspark.llm.gguf.metadata import open_reader
    from dspark.llm.gguf.tensors import ROPE_FREQS, hf_name, permuted_heads, read_tensor, unpermute
    from dspark.llm.runner.layout import HEAD, PROJECTION_PARTS, PROJECTIONS

    p = Path(path)
    g = load_gguf(p, dtype, tensors=False)
    cfg = g.cfg
    tdtype = tensor_dtype(cfg, dtype, blocks=block_types(g.stored))
    bud = _Budget(default_budget() if budget is None else max(0, budget))
    arch = g.raw_config["model_type"]
    src: dict[str, Part] = {}
    for t in open_reader(p, share=False).tensors:
        name = hf_name(t.name)
        if name is None or t.name == ROPE_FREQS:
            continue
        heads = permuted_heads(arch, name, cfg.num_attention_heads, cfg.num_key_value_heads)
        if t.tensor_type.name in ("F32", "F16", "BF16") or len(t.shape) != 2:
            w = read_tensor(t, p)
            w = unpermute(w, heads) if heads is not None else w
            src[name] = torch.from_numpy(np.array(w)).to(tdtype)
        else:
            src[name] = _Matrix(t, tdtype, heads, bud)

    lazy: dict[str, list[Part]] = {}
    by_parts: set[str] = set()  # tensors a lazy projection reads from its parts
    for li in range(cfg.num_hidden_layers):
        for proj, _, _, _ in PROJECTIONS:
            parts_of = (proj,) if cfg.fused_projections else PROJECTION_PARTS[proj]
            names = [f"model.layers.{li}.{n}.weight" for n in parts_of]
            missing = [n for n in names if n not in src]
            if missing:
                raise GGUFError(f"{p}: the file holds no tensor for {missing[0]}")
            parts = [src[n] for n in names]
            if any(isinstance(x, _Matrix) for x in parts):
                lazy[f"model.layers.{li}.{proj}"] = parts
                by_parts.update(names)
    # The runner's own copies: empty where a projection reads its parts (none held twice) and for a quantized
    # embedding or head (read through embed_matrix and the head's function).
    weights = {k: torch.empty((_rows(v), 0), dtype=tdtype) if isinstance(v, _Matrix) or k in by_parts else v
               for k, v in src.items()}
    emb = src.get("model.embed_tokens.weight")
    head_src = src.get("lm_head.weight", emb)
    runner = ReferenceRunner(cfg, weights, tdtype)
    runner.budget = bud
    for name, parts in lazy.items():
        runner.set_linear(name, _projection(parts))
    if isinstance(head_src, _Matrix):
        runner.set_linear(HEAD, _head(head_src))
    if isinstance(emb, _Matrix):
        runner.embed_matrix = emb
    return runner


def _rows(p: Part) -> int:
    return int(p.shape[0]) if isinstance(p, torch.Tensor) else int(p.tensor.data.shape[0])
