"""The numpy plugin's LLM decoder: the ops of dspark's one decoder definition, in NumPy (plugin API 1.10).

A vendor adds LLM support by implementing :class:`dspark.sdk.family.DecoderOps`
on its runtime, not by writing a model: :func:`dspark.sdk.family.forward` is
every family's decoder (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, SmolLM3) over
these ops. This is the eager form: ``forward`` runs every step and each op
computes. The KV cache is one pair of arrays per layer, ``[blocks, kv_heads,
block, head_dim]``, in the engine's blocks (the engine's block tables index them).
A graph runtime writes the same ops to build nodes instead and calls ``forward``
once at compile time (dspark_plugins_cpu.decoder.ops does so for OpenVINO).
"""

from __future__ import annotations

import math
import numpy as np

from dspark.sdk import QuantizedWeight, dequantize, quantize_weight, reference_linear
from dspark.sdk.decoder import DecoderSpec, StepBatch
from dspark.sdk.family import Attention, decline, forward
from dspark.types import DecoderBid, Device, QuantSpec
from dspark_numpy.blas import one_blas_thread

BLOCK_SIZE = 16
RUNTIME = "numpy"
_erf = np.vectorize(math.erf, otypes=[np.float64])  # numpy has no erf; exact GELU is rare, so per element


class NumpyOps:
    """:class:`dspark.sdk.family.DecoderOps` computing on numpy float32 arrays, for one step at a time."""

    variants = frozenset({"activation.gelu", "activation.gelu_tanh", "attention.window", "attention.softcap",
                          "rope.partial", "softcap", "linear.int8", "linear.int4", "embed.int8"})

    def __init__(self, spec: DecoderSpec) -> None:
        self.spec = spec
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._quantized: dict[str, QuantizedWeight] = {}  # weight name -> the canonical rounding, computed once
        self.kv: list[tuple[np.ndarray, np.ndarray]] = []
        self.batch: StepBatch | None = None

    def bind(self, kv: list[tuple[np.ndarray, np.ndarray]], batch: StepBatch) -> None:
        self.kv, self.batch = kv, batch

    def _b(self) -> StepBatch:
        assert self.batch is not None, "bind a step first"
        return self.batch

    def _rounded(self, name: str, w: np.ndarray, q: QuantSpec) -> QuantizedWeight:
        if name not in self._quantized:
            self._quantized[name] = quantize_weight(np.asarray(w, dtype=np.float32), q)
        return self._quantized[name]

    def tokens(self, table: np.ndarray, quant: QuantSpec | None) -> np.ndarray:
        ids = self._b().input_ids
        assert ids is not None
        if quant is None:
            return table[ids]
        return dequantize(self._rounded("model.embed_tokens", table.T, quant)).T[ids]  # per row: columns of embed.T

    def hidden_in(self) -> np.ndarray:
        h = self._b().hidden
        assert h is not None
        return np.asarray(h, dtype=np.float32)

    def scale(self, x: np.ndarray, factor: float) -> np.ndarray:
        return x * np.float32(factor)

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        var = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(var + np.float32(eps)) * weight

    def linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, quant: QuantSpec | None,
               name: str) -> np.ndarray:
        y = x @ weight if quant is None else reference_linear(x, self._rounded(name, weight, quant), quant.activations)
        return y if bias is None else y + bias

    def split(self, x: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
        return np.split(x, np.cumsum(sizes)[:-1], axis=-1)

    def heads(self, x: np.ndarray, num: int, dim: int) -> np.ndarray:
        return x.reshape(x.shape[0], num, dim)

    def rope(self, x: np.ndarray, table: int) -> np.ndarray:
        if table not in self._tables:
            self._tables[table] = self.spec.rope_at(table, self.spec.rope_table_rows)
        cos_t, sin_t = self._tables[table]
        pos = self._b().rope_rows
        cos, sin = cos_t[pos][:, None, :], sin_t[pos][:, None, :]
        rd = cos.shape[-1]
        r, rest = x[..., :rd], x[..., rd:]
        half = rd // 2
        rot = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
        out = r * cos + rot * sin
        return out if rest.shape[-1] == 0 else np.concatenate([out, rest], axis=-1)

    def attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, spec: Attention) -> np.ndarray:
        b = self._b()
        kc, vc = self.kv[spec.layer - self.spec.layers[0]]
        bs = kc.shape[2]
        slots = b.slot_mapping
        kc[slots // bs, :, slots % bs] = k  # [T, KVH, D] rows into their blocks
        vc[slots // bs, :, slots % bs] = v
        group = spec.num_heads // spec.num_kv_heads
        out = np.empty((q.shape[0], spec.num_heads, spec.head_dim), dtype=np.float32)
        for s in range(b.num_seqs):
            r0, r1 = int(b.subsequence_begins[s]), int(b.subsequence_begins[s + 1])
            n = int(b.past_lens[s]) + (r1 - r0)
            blocks = b.block_indices[b.block_indices_begins[s]:b.block_indices_begins[s + 1]]
            keys = kc[blocks].transpose(0, 2, 1, 3).reshape(-1, spec.num_kv_heads, spec.head_dim)[:n]
            vals = vc[blocks].transpose(0, 2, 1, 3).reshape(-1, spec.num_kv_heads, spec.head_dim)[:n]
            keys, vals = np.repeat(keys, group, axis=1), np.repeat(vals, group, axis=1)  # [n, H, D]
            scores = np.einsum("thd,nhd->htn", q[r0:r1], keys) * np.float32(spec.scale)
            if spec.softcap is not None:
                scores = np.tanh(scores / np.float32(spec.softcap)) * np.float32(spec.softcap)
            qp = b.positions[r0:r1][:, None]
            kp = np.arange(n)[None, :]
            visible = kp <= qp if spec.window is None else (kp <= qp) & (kp > qp - spec.window)
            scores = np.where(visible[None], scores, -np.inf)
            e = np.exp(scores - scores.max(axis=-1, keepdims=True))
            p = e / e.sum(axis=-1, keepdims=True)
            out[r0:r1] = np.einsum("htn,nhd->thd", p, vals)
        return out.reshape(q.shape[0], -1)

    def activation(self, x: np.ndarray, kind: str) -> np.ndarray:
        if kind == "silu":
            return x * (np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x)))  # x * sigmoid(x)
        if kind == "gelu_tanh":
            c = np.float32(math.sqrt(2.0 / math.pi))
            return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x ** 3)))
        return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(np.float32)

    def mul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a * b

    def add(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def logit_rows(self, x: np.ndarray) -> np.ndarray:
        return x[self._b().logit_rows]

    def softcap(self, x: np.ndarray, cap: float) -> np.ndarray:
        return np.tanh(x / np.float32(cap)) * np.float32(cap)


class NumpyDecoder:
    """A :class:`dspark.sdk.decoder.CompiledDecoder`: :func:`dspark.sdk.family.forward` on :class:`NumpyOps`."""

    block_size = BLOCK_SIZE

    def __init__(self, spec: DecoderSpec) -> None:
        self.spec = spec
        self.weights = spec.weights()
        self.ops = NumpyOps(spec)

    def allocate(self, num_blocks: int) -> list[tuple[np.ndarray, np.ndarray]]:
        s = self.spec
        shape = (num_blocks, s.num_kv_heads, BLOCK_SIZE, s.head_dim)
        return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(*s.layers)]

    def step(self, kv: list[tuple[np.ndarray, np.ndarray]], batch: StepBatch) -> np.ndarray:
        self.ops.bind(kv, batch)
        try:
            with one_blas_thread():
                if batch.exit_layer is not None and batch.exit_layer < self.spec.layers[1]:
                    out = forward(self.spec, self.ops, (self.spec.layers[0], batch.exit_layer), head=True,
                                  weights=self.weights)
                else:
                    out = forward(self.spec, self.ops, weights=self.weights)
        finally:
            self.ops.batch, self.ops.kv = None, []
        return np.ascontiguousarray(out, dtype=np.float32)


def decoder_bid(spec: DecoderSpec, device: Device) -> DecoderBid | None:
    if device.kind != "cpu":
        return None
    base = {"device_id": device.id, "runtime": RUNTIME, "runtime_version": np.__version__}
    why = decline(spec, NumpyOps.variants)
    if why is None and spec.dtype != "float32":
        why = f"computes in float32 only, not {spec.dtype}"
    if why is not None:
        return DecoderBid(**base, declined=why)
    a, b = spec.layers
    hid, D = spec.hidden_size, spec.head_dim
    per_layer = 4 * hid * ((spec.num_heads + 2 * spec.num_kv_heads) * D + spec.num_heads * D
                           + 3 * spec.intermediate_size)
    edges = 4 * spec.vocab_size * hid * ((a == 0) + (b == spec.num_layers))  # embedding, head
    return DecoderBid(**base, precision="float32", kv_dtype="float32", block_size=BLOCK_SIZE,
                      weight_bytes=(b - a) * per_layer + edges,  # float32 views it keeps once the engine lets go
                      kv_bytes_per_token=2 * (b - a) * spec.num_kv_heads * spec.head_dim * 4, exit_layers=a == 0,
                      note="dspark.sdk.family.forward on NumPy ops (the example of a decoder written as ops)")


def compile_decoder(spec: DecoderSpec, device: Device) -> NumpyDecoder | None:
    bid = decoder_bid(spec, device)
    if bid is None or bid.declined:
        return None
    return NumpyDecoder(spec)
