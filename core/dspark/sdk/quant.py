"""Reference weight quantization: the canonical layouts plugins repack from.

A MatMul/Gemm weight ``W`` of shape (K, N) (K = input features) is quantized
symmetrically per output channel (one scale per column) or per group of
``group_size`` rows of K within each column. int4 values are stored two per
byte along K, low nibble first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dspark.graph.model import Subgraph
from dspark.types import QuantSpec


@dataclass(frozen=True)
class QuantizedWeight:
    data: np.ndarray  # int8 (K, N), or uint8 (ceil(K/2), N) packed int4
    scales: np.ndarray  # float32 (G, N): G = 1 per channel, or ceil(K / group_size)
    bits: int
    group_size: int  # K for per-channel
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scales.nbytes)


def quantizable_weights(subgraph: Subgraph) -> list[str]:
    """Names of 2-D float weights read as the right operand of MatMul / Gemm(transB=0)."""
    names: list[str] = []
    inits = subgraph.graph.initializers
    for op in subgraph.ops:
        if op.op_type == "MatMul" or (op.op_type == "Gemm" and not op.attrs.get("transB")):
            w = op.inputs[1]
            if w in inits and inits[w].ndim == 2 and inits[w].dtype == np.float32 and w not in names:
                names.append(w)
    return names


def quantize_weight(w: np.ndarray, spec: QuantSpec) -> QuantizedWeight:
    k, n = w.shape
    group = k if spec.granularity == "per_channel" else min(spec.group_size, k)
    groups = -(-k // group)
    qmax = 127 if spec.weight_bits == 8 else 7
    padded = np.zeros((groups * group, n), dtype=np.float32)
    padded[:k] = w
    blocks = padded.reshape(groups, group, n)
    scales = np.abs(blocks).max(axis=1) / qmax
    scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
    q = np.clip(np.rint(blocks / scales[:, None, :]), -qmax, qmax).astype(np.int8).reshape(-1, n)[:k]
    if spec.weight_bits == 4:
        if k % 2:
            q = np.vstack([q, np.zeros((1, n), np.int8)])
        nib = (q & 0x0F).astype(np.uint8)
        q = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
    return QuantizedWeight(data=q, scales=scales, bits=spec.weight_bits, group_size=group, shape=(k, n))


def unpack_int4(data: np.ndarray, k: int) -> np.ndarray:
    low = (data & 0x0F).astype(np.int8)
    high = ((data >> 4) & 0x0F).astype(np.int8)
    low = np.where(low > 7, low - 16, low)
    high = np.where(high > 7, high - 16, high)
    out = np.empty((data.shape[0] * 2, data.shape[1]), dtype=np.int8)
    out[0::2], out[1::2] = low, high
    return out[:k]


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    k, n = qw.shape
    q = unpack_int4(qw.data, k) if qw.bits == 4 else qw.data
    scales = np.repeat(qw.scales, qw.group_size, axis=0)[:k]
    return (q.astype(np.float32) * scales).astype(np.float32)


# -- the LLM's unit of quantization ------------------------------------------------------------

LINEAR_INPUT, LINEAR_OUTPUT = "x", "y"


def linear_subgraph(name: str, w_t: np.ndarray, *, tokens: int | str = "tokens",
                    representative_tokens: int = 1) -> Subgraph:
    """One projection ``y[tokens, N] = x[tokens, K] @ W[K, N]`` as a one-op subgraph.

    This is what the LLM engine hands to ``dspark_quantize`` / ``dspark_bid`` /
    ``dspark_compile`` for each of its linear layers: input ``"x"``, output
    ``"y"``, float32 weight initializer ``f"{name}.weight"`` in the canonical
    [K, N] layout (:func:`quantize_weight` reads it as is). ``tokens`` is
    symbolic by default (the engine calls it with 1 row in decode and hundreds
    in prefill); ``representative_tokens`` is the size cost models assume.
    """
    from dspark.graph.model import Graph, Op, TensorSpec

    w = np.ascontiguousarray(w_t, dtype=np.float32)
    k, n = w.shape
    wname = f"{name}.weight"
    rows = representative_tokens if isinstance(tokens, str) else tokens
    graph = Graph(
        name=name,
        ops=[Op(name=name, op_type="MatMul", inputs=[LINEAR_INPUT, wname], outputs=[LINEAR_OUTPUT],
                flops=2.0 * rows * k * n, param_bytes=int(w.nbytes))],
        tensors={LINEAR_INPUT: TensorSpec(name=LINEAR_INPUT, dtype="float32", shape=(tokens, k)),
                 wname: TensorSpec(name=wname, dtype="float32", shape=(k, n)),
                 LINEAR_OUTPUT: TensorSpec(name=LINEAR_OUTPUT, dtype="float32", shape=(tokens, n))},
        inputs=[LINEAR_INPUT], outputs=[LINEAR_OUTPUT], initializers={wname: w},
        dim_hints={tokens: representative_tokens} if isinstance(tokens, str) else {},
    )
    return graph.subgraph()


def quantize_activations_per_token(x: np.ndarray) -> np.ndarray:
    """Dynamic symmetric int8 per row (token), returned dequantized: the reference for W8A8 kernels."""
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    return (np.clip(np.rint(x / scale), -127, 127) * scale).astype(np.float32)


def reference_linear(x: np.ndarray, qw: QuantizedWeight, activations: str = "float") -> np.ndarray:
    """What a quantized projection must compute (within the precision's tolerance), in float64."""
    xa = quantize_activations_per_token(x) if activations == "dynamic_int8" else x
    return (xa.astype(np.float64) @ dequantize(qw).astype(np.float64)).astype(np.float32)
