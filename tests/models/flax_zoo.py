"""Tiny Flax models for the JAX importer and CLI tests (``tests/models/flax_zoo.py:mlp`` specs).

Each factory returns a tuple ``(module or function, example_inputs[,
dynamic_shapes])`` (an ``nnx`` module holds no arrays as plain attributes),
seeded so weights and inputs are the same on every call. Small on purpose: a
loaded two-core machine converts and runs each in a second or two.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx


class MLP(nnx.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4, *, rngs: nnx.Rngs) -> None:
        self.fc1 = nnx.Linear(d_in, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, d_out, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(nnx.relu(self.fc1(x)))


class Block(nnx.Module):
    """A pre-norm transformer block: multi-head self-attention and a GELU MLP, each with a residual."""

    def __init__(self, dim: int = 32, heads: int = 4, hidden: int = 64, *, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x))
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class LinenMLP(linen.Module):
    hidden: int = 32

    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(4)(linen.tanh(linen.Dense(self.hidden)(x)))


def _inputs(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


Factory = tuple[Any, tuple[np.ndarray, ...], dict[str, dict[int, str]]]


def mlp() -> Factory:
    return MLP(rngs=nnx.Rngs(0)), (_inputs(3, 16),), {"x": {0: "batch"}}


def block() -> Factory:
    return Block(rngs=nnx.Rngs(1)), (_inputs(2, 8, 32, seed=1),), {"x": {0: "batch", 1: "seq"}}


def linen_mlp() -> tuple[Any, tuple[np.ndarray, ...]]:
    """A ``flax.linen`` module: a function closing over its variables, with example inputs."""
    model = LinenMLP()
    x = _inputs(2, 16, seed=2)
    variables = model.init(jax.random.PRNGKey(0), jnp.asarray(x))
    return (lambda x: model.apply(variables, x)), (x,)


def gated(x: jax.Array, w: jax.Array) -> jax.Array:
    """A plain JAX function of two inputs."""
    return jnp.tanh(x @ w) * jax.nn.sigmoid(x.sum(axis=-1, keepdims=True))
