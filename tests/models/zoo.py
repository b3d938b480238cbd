"""Tiny torch models for importer and CLI tests (``tests/models/zoo.py:tiny_cnn`` specs).

Each factory returns ``(module, example_inputs)`` or ``(module, example_inputs,
dynamic_shapes)``, seeded so weights and inputs are the same on every call.
They are small on purpose: exporting and running them must take well under a
second each on a loaded two-core machine.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class TinyCNN(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(channels)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1)
        self.fc = nn.Linear(2 * channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.bn(self.conv(x))))
        x = torch.relu(self.conv2(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)  # global average pool
        return self.fc(x)


class TinyBlock(nn.Module):
    """A pre-norm transformer block with hand-written attention (clean ONNX, no fused SDPA)."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        hd = d // self.heads
        q, k, v = (z.reshape(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(hd), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Unexportable(nn.Module):
    """Data-dependent control flow: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -x


class NoOnnxOp(nn.Module):
    """Exports with torch.export but uses a custom op the ONNX exporter has no translation for."""

    def __init__(self) -> None:
        super().__init__()
        _register_mystery_op()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.dspark_zoo.mystery(x) + 1


def _register_mystery_op() -> None:
    # Registered on first use, once per process, whichever way this file was imported.
    if hasattr(torch.ops.dspark_zoo, "mystery"):
        return

    @torch.library.custom_op("dspark_zoo::mystery", mutates_args=())
    def mystery(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @mystery.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)


def _seeded(seed: int = 0) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def tiny_mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    g = _seeded()
    return TinyMLP(), (torch.randn(2, 16, generator=g),)


def tiny_mlp_dynamic() -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    """The MLP with a symbolic batch dim (example batch 3)."""
    g = _seeded()
    return TinyMLP(), (torch.randn(3, 16, generator=g),), {"x": {0: "batch"}}


def tiny_cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    g = _seeded(1)
    model = TinyCNN()
    with torch.no_grad():  # non-trivial statistics and affine, so BatchNorm is really tested
        model.bn.running_mean.uniform_(-0.5, 0.5, generator=g)
        model.bn.running_var.uniform_(0.5, 1.5, generator=g)
        model.bn.weight.uniform_(0.5, 1.5, generator=g)
        model.bn.bias.uniform_(-0.1, 0.1, generator=g)
    return model, (torch.randn(1, 3, 16, 16, generator=g),)


def _block(g: torch.Generator) -> TinyBlock:
    model = TinyBlock()
    with torch.no_grad():  # distinct LayerNorm affines: the exporter merges identical initializers
        for ln in (model.ln1, model.ln2):
            ln.weight.uniform_(0.5, 1.5, generator=g)
            ln.bias.uniform_(-0.1, 0.1, generator=g)
    return model


def tiny_transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    g = _seeded(2)
    return _block(g), (torch.randn(1, 8, 32, generator=g),)


def tiny_transformer_dynamic() -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]:
    """The block with symbolic batch and sequence dims (example 2 x 8)."""
    g = _seeded(2)
    return _block(g), (torch.randn(2, 8, 32, generator=g),), {"x": {0: "batch", 1: "seq"}}


def unexportable() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Unexportable(), (torch.randn(2, 4),)


def no_onnx_op() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return NoOnnxOp(), (torch.randn(2, 3),)


def tiny_cnn_module() -> nn.Module:
    """The ``module.example_inputs`` factory form."""
    model, inputs = tiny_cnn()
    model.example_inputs = inputs  # type: ignore[assignment]
    return model
