"""The cuda plugin's whole decoder (plugin API 1.10): dspark's one decoder definition on torch and Triton.

The model is :func:`dspark.sdk.family.forward`; :class:`TorchOps` supplies its ops: dense parts (norms,
projections, the gated MLP, head) as torch ops in the spec's dtype, in the op order of the engine's
torch reference, and attention (with windows and soft-caps) reading and writing the engine's KV
blocks through :mod:`.triton_paged`. KV memory is ``[num_blocks, block_size, kv_heads, head_dim]`` per layer, in the
spec's dtype; the block size is the engine's choice (the bid says ``None``; 16 by default).

Decode steps (one row per sequence, every row's logits) replay CUDA graphs captured per padded batch
bucket (1, 2, 4, ... sequences), per KV allocation and early exit, from static input buffers; the
graph runs the same ``_forward`` as the eager path. Padding rows write no KV (slot -1) and their
outputs are dropped. On the CPU (tests under ``TRITON_INTERPRET=1``) graphs are off.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from dspark.sdk.family import Attention, decline, forward
from dspark.types import DecoderBid

from dspark_plugins_cuda.precision import fp32_mode

if TYPE_CHECKING:
    from dspark.sdk import decoder as sdk_decoder
    from dspark.types import Device

MAX_HEAD_DIM = 256  # triton_paged.MAX_HEAD_DIM, repeated: bidding imports no Triton (a test checks they agree)
DEFAULT_BLOCK_SIZE = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batch sizes a CUDA graph is captured for


def decoder_bid(spec: sdk_decoder.DecoderSpec, device: Device) -> DecoderBid | None:
    """Promise to run ``spec`` on ``device`` (a cuda:N of this plugin), or decline with the reason."""
    if device.kind != "cuda":
        return None
    base: dict[str, Any] = {"device_id": device.id, "runtime": device.runtime,
            "runtime_version": f"torch {torch.__version__}, triton {device.properties.get('triton')}"}
    why = decline(spec, TorchOps.variants)
    if why is None and spec.dtype not in _DTYPES:
        why = f"computes in float32, bfloat16 or float16, not {spec.dtype}"
    if why is None and spec.dtype not in device.dtypes:
        why = f"this GPU does not compute {spec.dtype} natively"
    if why is None and not device.properties.get("triton"):
        why = "Triton is not installed (the paged-attention kernel needs it)"
    if why is None and spec.head_dim > MAX_HEAD_DIM:
        why = f"head_dim {spec.head_dim} is larger than the attention kernel's tiles"
    if why is not None:
        return DecoderBid(**base, declined=why)
    a, b = spec.layers
    item = torch.finfo(_DTYPES[spec.dtype]).bits // 8
    per_layer = (spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
                 + spec.num_heads * spec.head_dim * spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size
                 + 2 * spec.hidden_size)
    edges = spec.vocab_size * spec.hidden_size * ((a == 0) + _needs_head(spec))
    return DecoderBid(**base, precision=spec.dtype, kv_dtype=spec.dtype, block_size=None,
                      weight_bytes=((b - a) * per_layer + edges + spec.hidden_size) * item,
                      kv_bytes_per_token=2 * (b - a) * spec.num_kv_heads * spec.head_dim * item,
                      exit_layers=a == 0,
                      note="torch + Triton paged attention, CUDA graphs for decode steps")


def compile_decoder(spec: sdk_decoder.DecoderSpec, device: Device) -> TritonDecoder | None:
    bid = decoder_bid(spec, device)
    if bid is None or bid.declined:
        return None
    return TritonDecoder(spec, torch_device=device.id)


def _needs_head(spec: sdk_decoder.DecoderSpec) -> bool:
    # A range that starts at layer 0 runs early exits (the bid says so), which end in the head.
    return spec.last or spec.layers[0] == 0


@dataclass
class KVCache:
    """One allocation: per layer of the range, K and V ``[num_blocks, block_size, kv_heads, head_dim]``."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    num_blocks: int


@dataclass
class _Inputs:
    """One step on the device: ``ids`` (range from layer 0) or ``hidden``; int64 index tensors except
    the int32 block table; ``rows``: the logit rows (None: all)."""

    ids: torch.Tensor | None
    hidden: torch.Tensor | None
    positions: torch.Tensor  # the rows of the RoPE tables (StepBatch.rope_rows): attention reads past_lens
    slots: torch.Tensor
    seq_begins: torch.Tensor
    past_lens: torch.Tensor
    table: torch.Tensor
    table_begins: torch.Tensor
    rows: torch.Tensor | None
    max_rows: int


class TorchOps:
    """:class:`dspark.sdk.family.DecoderOps` as torch ops on one device; attention on the Triton kernels.

    Weights go to the device once, on first use, keyed by the spec's array (a tied head shares the
    embedding's memory). Graph-safe: no host syncs, no host-built tensors once the weights are there.
    """

    variants = frozenset({"activation.gelu", "activation.gelu_tanh", "attention.window", "attention.softcap",
                          "rope.partial", "softcap"})

    def __init__(self, owner: TritonDecoder) -> None:
        self.d = owner
        self._dev: dict[int, torch.Tensor] = {}
        self._keep: list[np.ndarray] = []  # the arrays keyed by id stay alive
        self._scales: dict[float, torch.Tensor] = {}
        self.kv: KVCache | None = None
        self.inp: _Inputs | None = None

    def t(self, a: np.ndarray) -> torch.Tensor:
        key = id(a)
        if key not in self._dev:
            embed = self._dev.get(-1)
            emb = self.d.weights.embed
            if embed is not None and a.ndim == 2 and a.T.shape == emb.shape \
                    and (np.shares_memory(a, emb) or np.array_equal(a.T, emb)):
                self._dev[key] = embed.t()  # a tied head is the embedding: no second copy
            else:
                self._dev[key] = self.d._t(a)
            self._keep.append(a)
        return self._dev[key]

    def bind(self, kv: KVCache, inp: _Inputs) -> None:
        self.kv, self.inp = kv, inp

    def _i(self) -> _Inputs:
        assert self.inp is not None
        return self.inp

    def tokens(self, table: np.ndarray, quant: Any) -> torch.Tensor:
        return self.d.embed[self._i().ids]  # type: ignore[index]

    def hidden_in(self) -> torch.Tensor:
        return self._i().hidden.to(self.d.dtype)  # type: ignore[union-attr]

    def scale(self, x: torch.Tensor, factor: float) -> torch.Tensor:
        if factor not in self._scales:  # rounded to the model dtype, as the reference; made once, not per step
            self._scales[factor] = torch.tensor(factor, dtype=self.d.dtype, device=self.d.device)
        return x * self._scales[factor]

    def rms_norm(self, x: torch.Tensor, weight: np.ndarray, eps: float) -> torch.Tensor:
        # The reference's op order (HF LlamaRMSNorm): statistics in float32, scale in the model dtype.
        w = self.t(weight)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return w * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)

    def linear(self, x: torch.Tensor, weight: np.ndarray, bias: np.ndarray | None, quant: Any,
               name: str) -> torch.Tensor:
        y = x @ self.t(weight)
        return y if bias is None else y + self.t(bias)

    def split(self, x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return list(torch.split(x, sizes, dim=-1))

    def heads(self, x: torch.Tensor, num: int, dim: int) -> torch.Tensor:
        return x.reshape(x.shape[0], num, dim)

    def rope(self, x: torch.Tensor, table: int) -> torch.Tensor:
        cos_t, sin_t = self.d.rope_tables[table]
        pos = self._i().positions
        cos, sin = cos_t[pos][:, None, :], sin_t[pos][:, None, :]
        rd = cos.shape[-1]
        part = x[..., :rd]
        half = rd // 2
        out = part * cos + torch.cat((-part[..., half:], part[..., :half]), dim=-1) * sin  # rotate-half
        return out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: Attention) -> torch.Tensor:
        inp, kv = self._i(), self.kv
        assert kv is not None
        li = spec.layer - self.d.spec.layers[0]
        kc, vc = kv.k[li], kv.v[li]
        kern = self.d._kernels
        kern.write_kv(k, v, kc, vc, inp.slots)
        attn = kern.paged_attention(q.contiguous(), kc, vc, inp.seq_begins, inp.past_lens, inp.table,
                                    inp.table_begins, inp.max_rows, spec.scale, window=spec.window,
                                    softcap=spec.softcap)
        return attn.reshape(q.shape[0], spec.num_heads * spec.head_dim)

    def activation(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        if kind == "silu":
            return F.silu(x)
        return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")

    def mul(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    def logit_rows(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._i().rows
        return x if rows is None else x[rows]

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        return torch.tanh(x.float() / cap) * cap


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph; None off CUDA: the static inputs run eagerly
    out: torch.Tensor
    # The allocation it captured, weakly: a graph must not keep KV memory the engine let go, and an id
    # reused by a new allocation must not find it.
    kv: weakref.ref[KVCache]


class TritonDecoder:
    """A :class:`dspark.sdk.decoder.CompiledDecoder` on one torch device (cuda:N; "cpu" only under the
    Triton interpreter, for tests).

    ``cuda_graphs``: None = on for CUDA devices. True on the CPU runs decode steps through the same
    padded static buffers as the graphs, eagerly (nothing is captured): how the tests check the
    bucketing without a GPU.
    """

    def __init__(self, spec: sdk_decoder.DecoderSpec, torch_device: str = "cuda:0",
                 block_size: int = DEFAULT_BLOCK_SIZE, cuda_graphs: bool | None = None) -> None:
        self.spec = spec
        # Triton is imported only here: bidding must work (and decline) without it.
        from dspark_plugins_cuda.decoder import triton_paged

        self._kernels = triton_paged
        self.device = torch.device(torch_device)
        triton_paged.check_device(self.device)
        self.block_size = block_size
        self.dtype = _DTYPES[spec.dtype]
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self._lock = threading.Lock()
        self._load(spec)
        self._graphs: dict[tuple[int, int, int | None], _Graph] = {}
        self._pool: Any = None
        self._static: dict[str, torch.Tensor] = {}

    # -- weights ----------------------------------------------------------------------------------

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, self.dtype).contiguous()

    def _opt(self, a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else self._t(a)

    def _load(self, spec: sdk_decoder.DecoderSpec) -> None:
        self.weights = spec.weights()
        self.ops = TorchOps(self)
        self.layers = range(*spec.layers)
        self.embed: torch.Tensor | None = None
        if spec.layers[0] == 0:
            self.embed = self.ops._dev[-1] = self.ops.t(self.weights.embed)
        if _needs_head(spec):  # the head's weights now, not at a graph's capture
            self.ops.t(self.weights.norm)
            self.ops.t(self.weights.head)
        self._rope_len = 0
        self._rope(spec.rope_table_rows)

    def _rope(self, n: int) -> None:
        """cos/sin tables for positions below ``n`` on the device, in the compute dtype (as the reference)."""
        if n <= self._rope_len:
            return
        tables = sorted({t for t in (self.spec.layer_rope or (0,)) if t is not None}) or [0]
        self.rope_tables = {i: tuple(self._t(a) for a in self.spec.rope_at(i, n)) for i in tables}
        self._rope_len = n

    def allocate(self, num_blocks: int) -> KVCache:
        s = self.spec
        shape = (num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        n = len(self.layers)
        # Zeros, not empty: padding rows of a graph may read a block that holds nothing yet.
        return KVCache([torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)],
                       [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(n)], num_blocks)

    # -- the forward ------------------------------------------------------------------------------

    def _forward(self, kv: KVCache, inp: _Inputs, stop: int, head: bool) -> torch.Tensor:
        """Layers ``[a, stop)`` of the range, then the final norm and head over ``inp.rows`` when ``head``
        (logits float32), else the hidden state. Graph-safe: no host syncs, no host-built tensors."""
        self.ops.bind(kv, inp)
        out = forward(self.spec, self.ops, (self.spec.layers[0], stop), head=head, weights=self.weights)
        return out.float()

    # -- a step -----------------------------------------------------------------------------------

    def _plan(self, batch: sdk_decoder.StepBatch) -> tuple[int, bool]:
        """(the layer to stop at, whether the head runs) for this batch."""
        a, b = self.spec.layers
        e = batch.exit_layer
        if e is not None and e < b:
            if a != 0 or e <= a:
                raise ValueError(f"exit_layer {e} outside the range {a}..{b} (exits need a range from layer 0)")
            return e, True
        return b, self.spec.last

    def _check(self, kv: KVCache, batch: sdk_decoder.StepBatch) -> None:
        if not isinstance(kv, KVCache) or len(kv.k) != len(self.layers):
            raise TypeError("kv is not an allocation of this decoder")
        first = self.spec.layers[0] == 0
        if (batch.input_ids is None) if first else (batch.hidden is None):
            raise ValueError("a range from layer 0 takes input_ids, a later one hidden")
        if batch.num_tokens and int(batch.rope_rows.max()) >= self._rope_len:
            self._rope(int(batch.rope_rows.max()) + 1)
            self._graphs.clear()  # they captured the old tables, and their buffers' widths
            self._static = {}

    def step(self, kv: KVCache, batch: sdk_decoder.StepBatch) -> torch.Tensor:
        """Logits ``[len(logit_rows), vocab]`` or the hidden state ``[T, hidden]``: float32, on the CPU."""
        with self._lock:
            self._check(kv, batch)
            stop, head = self._plan(batch)
            with ExitStack() as ctx:
                if self.device.type == "cuda":
                    ctx.enter_context(torch.cuda.device(self.device))  # Triton and graphs use the current device
                    ctx.enter_context(fp32_mode(torch, tf32=False))  # float32 stays IEEE, as the reference
                ctx.enter_context(torch.inference_mode())
                n = batch.num_tokens
                if self._graphable(batch, head):
                    out = self._replay(kv, batch, stop, head)[:n]
                else:
                    out = self._forward(kv, self._upload(batch), stop, head)
                return out.cpu()

    def _upload(self, batch: sdk_decoder.StepBatch) -> _Inputs:
        dev = self.device

        def put(a: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev, dtype, non_blocking=True)

        begins = np.asarray(batch.subsequence_begins)
        return _Inputs(
            ids=None if batch.input_ids is None else put(batch.input_ids),
            hidden=None if batch.hidden is None else put(batch.hidden, torch.float32),
            positions=put(batch.rope_rows), slots=put(batch.slot_mapping), seq_begins=put(begins),
            past_lens=put(batch.past_lens), table=put(batch.block_indices, torch.int32),
            table_begins=put(batch.block_indices_begins), rows=put(batch.logit_rows),
            max_rows=int(np.diff(begins).max()) if begins.size > 1 else 0)

    # -- CUDA graphs ------------------------------------------------------------------------------

    def _graphable(self, batch: sdk_decoder.StepBatch, head: bool) -> bool:
        """A decode step: one row per sequence, all rows' logits, within the largest bucket and table."""
        n = batch.num_seqs
        if not self.cuda_graphs or n == 0 or batch.num_tokens != n or n > self._max_bucket():
            return False
        if head and not np.array_equal(batch.logit_rows, np.arange(n)):
            return False
        widths = np.diff(batch.block_indices_begins)
        return bool(widths.max() <= self._width())

    def _max_bucket(self) -> int:
        cap = min(max(1, self.spec.max_num_seqs), _BUCKETS[-1])
        return next(b for b in _BUCKETS if b >= cap)

    def _width(self) -> int:
        # Blocks per sequence a graph's table holds: enough for the model's whole context.
        return -(-self._rope_len // self.block_size)

    def _buffers(self) -> dict[str, torch.Tensor]:
        """Static inputs shared by every graph (steps are serialized): sized for the largest bucket."""
        if not self._static:
            n, dev = self._max_bucket(), self.device
            self._static = {
                "ints": torch.zeros(6 * n + 2, dtype=torch.int64, device=dev),
                "table": torch.zeros(n * self._width(), dtype=torch.int32, device=dev),
                "hidden": torch.zeros((n, self.spec.hidden_size), dtype=torch.float32, device=dev),
            }
        return self._static

    def _graph_inputs(self, bucket: int) -> _Inputs:
        st, n, B = self._buffers(), self._max_bucket(), bucket
        ints = st["ints"]
        # ints: ids | positions | slots | past_lens (n each), seq_begins | table_begins (n + 1 each)
        return _Inputs(
            ids=ints[:B] if self.spec.layers[0] == 0 else None,
            hidden=None if self.spec.layers[0] == 0 else st["hidden"][:B],
            positions=ints[n:n + B], slots=ints[2 * n:2 * n + B], past_lens=ints[3 * n:3 * n + B],
            seq_begins=ints[4 * n:4 * n + B + 1], table_begins=ints[5 * n + 1:5 * n + B + 2],
            table=st["table"], rows=None, max_rows=1)

    def _fill(self, bucket: int, batch: sdk_decoder.StepBatch | None) -> None:
        """Copy a decode batch into the static buffers (two or three host-to-device copies); padding
        sequences get no KV write, no past, and the first table entry. ``None``: a safe empty batch."""
        st, n = self._buffers(), self._max_bucket()
        m = 0 if batch is None else batch.num_seqs
        host = np.zeros(6 * n + 2, dtype=np.int64)
        host[2 * n:3 * n] = -1
        host[4 * n:4 * n + bucket + 1] = np.arange(bucket + 1)
        tlen = 1
        if batch is not None:
            if batch.input_ids is not None:
                host[:m] = batch.input_ids
            host[n:n + m] = batch.rope_rows
            host[2 * n:2 * n + m] = batch.slot_mapping
            host[3 * n:3 * n + m] = batch.past_lens
            host[5 * n + 1:5 * n + m + 2] = batch.block_indices_begins
            host[5 * n + m + 2:5 * n + bucket + 2] = 0
            tlen = max(1, len(batch.block_indices))
            if batch.hidden is not None:
                st["hidden"][:m].copy_(torch.from_numpy(np.ascontiguousarray(batch.hidden, dtype=np.float32)))
        st["ints"].copy_(torch.from_numpy(host), non_blocking=False)
        table = np.zeros(tlen, dtype=np.int32) if batch is None or not len(batch.block_indices) \
            else np.ascontiguousarray(batch.block_indices, dtype=np.int32)
        st["table"][:tlen].copy_(torch.from_numpy(table))

    def _replay(self, kv: KVCache, batch: sdk_decoder.StepBatch, stop: int, head: bool) -> torch.Tensor:
        bucket = next(b for b in _BUCKETS if b >= batch.num_seqs)
        key = (id(kv), bucket, stop if stop != self.spec.layers[1] else None)
        g = self._graphs.get(key)
        if g is None or g.kv() is not kv:
            self._graphs = {k: v for k, v in self._graphs.items() if v.kv() is not None}
            g = self._capture(kv, bucket, stop, head)
            self._graphs[key] = g
        self._fill(bucket, batch)
        if g.graph is None:
            return self._forward(kv, self._graph_inputs(bucket), stop, head)
        g.graph.replay()
        return g.out

    def _capture(self, kv: KVCache, bucket: int, stop: int, head: bool) -> _Graph:
        inp = self._graph_inputs(bucket)
        if self.device.type != "cuda":
            return _Graph(None, inp.positions, weakref.ref(kv))
        self._fill(bucket, None)  # warm-up and capture must not write anyone's KV
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compiles the Triton kernels and settles the allocator first
            for _ in range(2):
                self._forward(kv, inp, stop, head)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # One pool for all graphs: each graph's output is copied to the host right after its replay.
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(kv, inp, stop, head)
        return _Graph(graph, out, weakref.ref(kv))
