"""A GGUF file's quantized weights as stored (plugin API 1.14): blocks unpacked to integers and scales.

A runtime whose kernels hold grouped integer weights (OpenVINO's compressed
FullyConnected, oneDNN's, ...) runs a Q8_0, Q4_0, Q4_K or Q6_K tensor without a
float copy by reading its blocks as ``w = (q - zero) * scale`` per group of
``group`` inputs. :meth:`BlockPart.unpack` gives those arrays, one tensor at a
time, from the file's memory map (nothing is unpacked until asked); the bit
layouts are llama.cpp's (``ggml-quants.c``), read as the ``gguf`` package's
``gguf.quants`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BLOCK_TYPES", "FLOAT_TYPES", "BlockPart", "BlockWeight", "Unpacked"]

QK_K = 256
# ggml type -> (values per block, bytes per block, values per scale group)
BLOCK_TYPES: dict[str, tuple[int, int, int]] = {
    "Q8_0": (32, 34, 32), "Q5_0": (32, 22, 32), "Q4_0": (32, 18, 32), "Q4_K": (QK_K, 144, 32),
    "Q6_K": (QK_K, 210, 16)}
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True)
class Unpacked:
    """``w[n, G * g] = (q[n, G, g] - zero[n, G, 1]) * scale[n, G, 1]``. ``q``: int8 for the signed types
    (Q8_0: -127..127 in groups of 32; Q5_0: -16..15 in groups of 32; Q6_K: -32..31 in groups of 16), uint8
    holding 4-bit values 0..15 otherwise (Q4_0: zero 8; Q4_K: each group's minimum over its scale, float);
    ``zero`` None means 0."""

    q: np.ndarray
    scale: np.ndarray  # float32
    zero: np.ndarray | None  # float32, [n, G, 1] or broadcastable to it

    @property
    def bits(self) -> int:
        """The integers' width in a runtime's compressed weights: 4 (unsigned) or 8 (signed)."""
        return 8 if self.q.dtype == np.int8 else 4


@dataclass(frozen=True)
class BlockPart:
    """One tensor of a GGUF file, ``rows`` outputs by ``cols`` inputs, as stored. ``raw``: its bytes
    (``uint8 [rows, bytes per row]``, a view of the file's memory map) for a block type, or its values
    (``[rows, cols]``, float32/float16/bfloat16) for a float type; ``order``: the output rows in the order
    the model uses them (llama.cpp stores a Llama's q/k rows interleaved for its RoPE), None = as stored."""

    name: str
    ggml_type: str
    raw: np.ndarray
    rows: int
    cols: int
    order: np.ndarray | None = None

    @property
    def is_float(self) -> bool:
        return self.ggml_type in FLOAT_TYPES

    @property
    def group(self) -> int:
        """Inputs per scale (0 for a float tensor)."""
        return BLOCK_TYPES[self.ggml_type][2] if not self.is_float else 0

    def values(self) -> np.ndarray:
        """A float tensor's values ``[rows, cols]`` in the model's row order (as stored: no widening)."""
        if not self.is_float:
            raise TypeError(f"{self.name} is stored as {self.ggml_type}: unpack() it")
        return self.raw if self.order is None else self.raw[self.order]

    def unpack(self) -> Unpacked:
        """The tensor's integers, scales and zero points, in the model's row order (a copy: the file's
        memory map is only read)."""
        if self.ggml_type not in BLOCK_TYPES:
            raise TypeError(f"{self.name} is stored as {self.ggml_type}, which has no unpacking here "
                            f"(block types: {', '.join(BLOCK_TYPES)})")
        raw = self.raw if self.order is None else self.raw[self.order]
        per_block, nbytes, g = BLOCK_TYPES[self.ggml_type]
        b = np.ascontiguousarray(raw).reshape(-1, nbytes)
        q, scale, zero = _UNPACK[self.ggml_type](b)
        shape = (self.rows, self.cols // g)
        zero_out = None if zero is None else (zero if zero.ndim == 0 else zero.reshape(*shape, 1))
        return Unpacked(q.reshape(*shape, g), scale.reshape(*shape, 1), zero_out)

    def dequantize(self) -> np.ndarray:
        """The float32 values ``[rows, cols]`` (a reference: ``(q - zero) * scale``)."""
        if self.is_float:
            return np.asarray(self.values(), dtype=np.float32)
        u = self.unpack()
        q = u.q.astype(np.float32)
        if u.zero is not None:
            q = q - u.zero
        return (q * u.scale).reshape(self.rows, self.cols)


@dataclass(frozen=True)
class BlockWeight:
    """A projection ``[in, out]`` (``y = x @ W``, as :class:`dspark.types.decoder.LayerWeights`) kept as its
    file stores it: ``parts`` are tensors stacked along the outputs (q, k, v; gate, up), each of its own type."""

    parts: tuple[BlockPart, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.parts[0].cols, sum(p.rows for p in self.parts)

    @property
    def types(self) -> set[str]:
        return {p.ggml_type for p in self.parts}

    def dequantize(self) -> np.ndarray:
        """float32 ``[in, out]``."""
        return np.concatenate([p.dequantize() for p in self.parts], axis=0).T


def _half(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return b[:, 2:].view(np.int8), _half(b[:, :2]), None


def _q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    qh = np.ascontiguousarray(b[:, 2:6]).view(np.uint32)  # bit i: the fifth bit of value i
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    qs = b[:, 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    return (low | (high << 4)).astype(np.int8) - np.int8(16), _half(b[:, :2]), None


def _q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    qs = b[:, 2:]  # value i in the low nibble of byte i, value 16 + i in its high nibble
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1), _half(b[:, :2]), np.float32(8.0)


def _scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 6-bit scales and minimums of its 8 sub-blocks (``gguf.quants.Q4_K.get_scale_min``)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = len(b)
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mn = _scale_min(b[:, 4:16])
    scale = d * sc.astype(np.float32)  # [n, 8]
    low = dmin * mn.astype(np.float32)  # w = scale * q - low
    qs = b[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32)
    flat = scale == 0  # a sub-block of one value, -low: held as (0 - 1) * low
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, np.float32(1.0), low / np.where(flat, 1, scale)).astype(np.float32)
    if flat.any():
        q = np.where(flat[:, :, None], np.uint8(0), q)
        scale = np.where(flat, low, scale)
    return q, scale.astype(np.float32), zero


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    n = len(b)
    ql, qh = b[:, :128], b[:, 128:192]
    scales, d = b[:, 192:208].view(np.int8).astype(np.float32), _half(b[:, 208:210])
    lo = (ql.reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03
    q = (lo.reshape(n, 8, 32) | (hi.reshape(n, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(n, 16, 16), d * scales, None


_UNPACK = {"Q8_0": _q8_0, "Q5_0": _q5_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q6_K": _q6_k}
