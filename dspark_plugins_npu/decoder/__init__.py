"""The whole LLM decoder on an ONNX Runtime execution provider (plugin API 1.6).

A step (:class:`~dspark.sdk.decoder.StepBatch`) is split into runs of one
graph (:mod:`.graph`) because ``GroupQueryAttention`` on the CPU EP
takes one query length per run and several new tokens with a past only at
batch 1 (found by experiment on onnxruntime 1.31: "batch_size must be 1 when
sequence_length > 1 and past context is given"):

- every 1-token row (decode, or a 1-token prompt): one run, ``[B, 1]``;
- every first prompt chunk (no past): one run, right-padded to ``[B, S_max]``;
- every other chunk (a later prompt chunk, a verified draft): one run each, ``[1, n]``.

KV memory: one float32 array per K and V, ``[layers, num_blocks, block_size,
KVH, D]``; each layer's slice is fed to the session as is (ONNX Runtime reads
a C-contiguous numpy input in place), and the new rows' K/V the graph returns
are written into their slots with one numpy assignment per run.

``block_size`` defaults to 16 and is any size: the graph takes it from the
arrays. Set it on the compiled decoder before ``allocate``; each allocation
keeps its own.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.sdk import decoder as dec
from dspark.sdk.family import decline
from dspark.types import DecoderBid, Device
from dspark_plugins_npu import providers, session
from dspark_plugins_npu.decoder import graph as dg

DEFAULT_BLOCK_SIZE = 16
_F32 = 4


# -- bidding -------------------------------------------------------------------


def weight_bytes(spec: dec.DecoderSpec) -> int:
    """float32 bytes of the range's weights (plus embedding / norm and head where it has them), from the config."""
    hid, inter, H, KVH, D = spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    qkv = (H + 2 * KVH) * D
    per_layer = hid * qkv + H * D * hid + hid * 2 * inter + inter * hid + 2 * hid
    per_layer += qkv if "qkv_bias" in spec.features else 0
    per_layer += hid if "o_bias" in spec.features else 0
    per_layer += 2 * D if "qk_norm" in spec.features else 0
    per_layer += 2 * hid if "gemma" in spec.features else 0  # Gemma's norms of the attention and MLP outputs
    n = (spec.layers[1] - spec.layers[0]) * per_layer
    n += spec.vocab_size * hid if spec.first else 0
    # The head also serves early exits, which a range starting at layer 0 may run.
    n += hid + hid * spec.vocab_size if spec.last or (spec.first and spec.exit_layers) else 0
    return n * _F32


def kv_bytes_per_token(spec: dec.DecoderSpec) -> int:
    return 2 * (spec.layers[1] - spec.layers[0]) * spec.num_kv_heads * spec.head_dim * _F32


def why_not(spec: dec.DecoderSpec, ep: str) -> str | None:
    """Why this plugin will not run ``spec`` on ``ep``, or None."""
    if ep != providers.CPU_EP:
        return (f"GroupQueryAttention in float32 runs on {providers.CPU_EP} only "
                f"(not {ep}: CUDA's kernel is float16/bfloat16, other EPs do not claim it)")
    return decline(spec, dg.OnnxOps.variants)


def decoder_bid(spec: dec.DecoderSpec, device: Device) -> DecoderBid | None:
    """The ``dspark_decoder_bid`` hook's body: None for a device record without a provider."""
    if "execution_provider" not in device.properties:
        return None
    ep = str(device.properties["execution_provider"])
    note = "" if spec.dtype == "float32" else f"computes in float32 (the engine in {spec.dtype})"
    return DecoderBid(device_id=device.id, runtime=providers.runtime_name(ep),
                      runtime_version=str(device.properties.get("ort_version", "")), precision="float32",
                      kv_dtype="float32", block_size=None, weight_bytes=weight_bytes(spec),
                      kv_bytes_per_token=kv_bytes_per_token(spec), exit_layers=True, declined=why_not(spec, ep),
                      note=note)


def compile_decoder(spec: dec.DecoderSpec, device: Device) -> OrtDecoder | None:
    """The ``dspark_compile_decoder`` hook's body: None when it would not have bid."""
    if "execution_provider" not in device.properties:
        return None
    ep = str(device.properties["execution_provider"])
    if why_not(spec, ep) is not None:
        return None
    return OrtDecoder(spec, ep, int(device.properties.get("device_index", 0)))


# -- sessions ------------------------------------------------------------------


class _Session:
    """One graph's InferenceSession; its weights come from memory (shared with the spec's arrays)."""

    def __init__(self, built: dg.Built, ep: str, index: int, threads: int = 0) -> None:
        rt = session.ort()
        so = session.session_options(strict=ep != providers.CPU_EP)
        if threads > 0:  # the engine's thread budget (a server's cpu_cores_per_worker), not every core
            so.intra_op_num_threads = threads
        names = list(built.weights)
        # OrtValues over the arrays themselves: the session reads the engine's memory, no copy.
        self._values = [rt.OrtValue.ortvalue_from_numpy(built.weights[n]) for n in names]
        so.add_external_initializers(names, self._values)
        opts = providers.provider_options(ep, index)
        try:
            self.sess = rt.InferenceSession(built.model.SerializeToString(), so,
                                            providers=[(ep, opts)] if opts else [ep])
        except Exception as exc:
            raise session.EpUnusable(f"the decoder graph does not load on {ep}: {session.clean_error(exc)}") from exc
        if ep not in self.sess.get_providers():
            raise session.EpUnusable(f"a decoder session asked for {ep} fell back to {self.sess.get_providers()}")
        self.num_layers = built.num_layers
        self.head = built.head
        self.input_names = frozenset(i.name for i in self.sess.get_inputs())  # an exit may use fewer RoPE tables
        self.outputs = [dg.LOGITS if built.head else dg.HIDDEN_OUT, dg.K_NEW, dg.V_NEW]
        self._weights = built.weights  # keeps the arrays the OrtValues point into alive
        self._run_options = rt.RunOptions()

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        fed = {k: v for k, v in feeds.items() if k in self.input_names}
        return list(self.sess.run(self.outputs, fed, self._run_options))


# Sessions per (model, range, exit, provider): the hook may compile the same spec more than once
# (timing, then the winner); a live session is reused rather than built and prepacked again.
_sessions: weakref.WeakValueDictionary[tuple[Any, ...], _Session] = weakref.WeakValueDictionary()
_sessions_lock = threading.Lock()


def _shared_session(spec: dec.DecoderSpec, weights: dec.DecoderWeights, stop: int | None, ep: str,
                    index: int) -> _Session:
    key = (spec.fingerprint, spec.layers, stop, ep, index, spec.threads)
    with _sessions_lock:
        found = _sessions.get(key)
        if found is None:
            found = _Session(dg.build(spec, weights, stop=stop), ep, index, spec.threads)
            _sessions[key] = found
        return found


# -- KV memory -----------------------------------------------------------------


@dataclass
class OrtKV:
    """One allocation: K and V ``[layers of the range, num_blocks, block_size, KVH, D]`` float32."""

    k: np.ndarray
    v: np.ndarray

    @property
    def block_size(self) -> int:
        return int(self.k.shape[2])

    def feeds(self, layers: int) -> dict[str, np.ndarray]:
        """The first ``layers`` layers' blocks as session inputs (views: no copy)."""
        out: dict[str, np.ndarray] = {}
        for i in range(layers):
            out[dg.k_cache(i)] = self.k[i]
            out[dg.v_cache(i)] = self.v[i]
        return out

    def write(self, layers: int, slots: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """New rows' K/V ``[layers, n, KVH, D]`` into their slots (block * block_size + offset)."""
        L, nb, bs, kvh, d = self.k.shape
        self.k.reshape(L, nb * bs, kvh, d)[:layers, slots] = k_new
        self.v.reshape(L, nb * bs, kvh, d)[:layers, slots] = v_new


# -- the compiled decoder -----------------------------------------------------


@dataclass
class _Run:
    """One session run's share of a step: its rows (-1: padding) as a [B, S] grid, and its sequences."""

    rows: np.ndarray  # [B * S] global row indices, -1 where padded
    seqs: np.ndarray  # [B] sequence indices
    seq_len: int  # S
    first_prompt: bool  # no past at all: GQA's prompt path, no past gathered


class OrtDecoder:
    """``CompiledDecoder`` over ONNX Runtime sessions: the range's graph, and one per early exit (lazily)."""

    def __init__(self, spec: dec.DecoderSpec, ep: str, index: int = 0) -> None:
        self.spec = spec
        self.block_size = DEFAULT_BLOCK_SIZE  # settable before allocate(); any size works
        self._ep, self._index = ep, index
        self._weights = spec.weights()
        self._lock = threading.Lock()
        self._exits: dict[int, _Session] = {}
        self._main = _shared_session(spec, self._weights, None, ep, index)
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # RoPE table -> cos, sin (grown by doubling)
        self._rope_tables = sorted({t for t in (spec.layer_rope or (0,)) if t is not None})

    def allocate(self, num_blocks: int) -> OrtKV:
        s = self.spec
        shape = (s.layers[1] - s.layers[0], num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
        return OrtKV(np.zeros(shape, np.float32), np.zeros(shape, np.float32))

    def _session(self, exit_layer: int | None) -> _Session:
        a, b = self.spec.layers
        if exit_layer is None or (exit_layer >= b and self.spec.last):
            return self._main
        if not a < exit_layer <= b:
            raise ValueError(f"exit layer {exit_layer} is outside the range {self.spec.layers}")
        with self._lock:  # built once per exit layer; its weights are the main session's arrays
            if exit_layer not in self._exits:
                self._exits[exit_layer] = _shared_session(self.spec, self._weights, exit_layer, self._ep,
                                                          self._index)
            return self._exits[exit_layer]

    def _rope(self, index: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin rows of RoPE table ``index`` for ``positions``; a table grows by doubling as contexts do."""
        need = int(positions.max()) + 1 if positions.size else 1
        cos, sin = self._tables.get(index, (np.zeros((0, 0), np.float32),) * 2)
        if need > len(cos):
            n = max(256, 1 << (need - 1).bit_length())
            c, s = self.spec.rope_at(index, n)
            cos, sin = np.ascontiguousarray(c, np.float32), np.ascontiguousarray(s, np.float32)
            self._tables[index] = (cos, sin)
        return cos[positions], sin[positions]

    def step(self, kv: OrtKV, batch: dec.StepBatch) -> np.ndarray:
        sess = self._session(batch.exit_layer)
        T = batch.num_tokens
        want = np.zeros(T, bool)
        want[batch.logit_rows] = True
        out = (np.empty((len(batch.logit_rows), self.spec.vocab_size), np.float32) if sess.head
               else np.empty((T, self.spec.hidden_size), np.float32))
        for run in plan(batch):
            self._run(sess, kv, batch, run, want, out)
        return out

    def _run(self, sess: _Session, kv: OrtKV, batch: dec.StepBatch, run: _Run, want: np.ndarray,
             out: np.ndarray) -> None:
        rows = run.rows
        real = rows >= 0
        take = np.where(real, rows, 0)  # padding rows compute on row 0's inputs; their outputs are dropped
        feeds = kv.feeds(sess.num_layers)
        past = batch.past_lens[run.seqs].astype(np.int64)
        pos = np.where(real, batch.rope_rows[take], 0)
        for t in self._rope_tables:
            c, s = (dg.COS, dg.SIN) if t == 0 else (f"{dg.COS}.{t}", f"{dg.SIN}.{t}")
            feeds[c], feeds[s] = self._rope(t, pos)
        feeds[dg.TABLE] = _past_table(batch, run.seqs, past, kv.block_size)
        feeds[dg.PAST_MAX] = np.array([past.max()], np.int64)
        if run.first_prompt:  # lengths of right-padded prompts; the step's query length is the total
            lens = np.diff(batch.subsequence_begins)[run.seqs]
            feeds[dg.SEQLENS] = (lens - 1).astype(np.int32)
            feeds[dg.TOTAL] = np.array(run.seq_len, np.int32)
        else:  # past + new, every row real (1-token rows, or a single chunk)
            feeds[dg.SEQLENS] = (past + run.seq_len - 1).astype(np.int32)
            feeds[dg.TOTAL] = np.array(int(past.max()) + run.seq_len, np.int32)
        if self.spec.first:
            feeds[dg.IDS] = np.where(real, batch.input_ids[take], 0)  # type: ignore[index]
        else:
            feeds[dg.HIDDEN_IN] = np.ascontiguousarray(batch.hidden[take], np.float32)  # type: ignore[index]
        local = np.flatnonzero(real & want[take]) if sess.head else np.flatnonzero(real)
        if sess.head:
            feeds[dg.ROWS] = local.astype(np.int64)
        y, k_new, v_new = sess.run(feeds)
        got = np.flatnonzero(real)
        kv.write(sess.num_layers, batch.slot_mapping[rows[got]], k_new[:, got], v_new[:, got])
        if sess.head:
            out[np.searchsorted(batch.logit_rows, rows[local])] = y
        else:
            out[rows[local]] = y[local]


def plan(batch: dec.StepBatch) -> list[_Run]:
    """The step's session runs: 1-token rows together, first prompts together (right-padded), others alone."""
    begins = batch.subsequence_begins.astype(np.int64)
    lens = np.diff(begins)
    past = batch.past_lens
    runs: list[_Run] = []
    single = np.flatnonzero(lens == 1)
    if single.size:
        runs.append(_Run(begins[single], single, 1, False))
    prompts = np.flatnonzero((lens > 1) & (past == 0))
    if prompts.size:
        S = int(lens[prompts].max())
        grid = begins[prompts, None] + np.arange(S)[None, :]
        grid = np.where(np.arange(S)[None, :] < lens[prompts, None], grid, -1)
        runs.append(_Run(grid.reshape(-1), prompts, S, True))
    for s in np.flatnonzero((lens > 1) & (past > 0)):
        runs.append(_Run(np.arange(begins[s], begins[s + 1]), np.array([s]), int(lens[s]), False))
    return runs


def _past_table(batch: dec.StepBatch, seqs: np.ndarray, past: np.ndarray, block_size: int) -> np.ndarray:
    """[B, NB] blocks holding each sequence's past (NB: the longest past's), padded with block 0;
    the graph cuts the positions they cover to the longest past."""
    nb = int(-(-int(past.max()) // block_size)) if past.size else 0
    starts = batch.block_indices_begins[seqs].astype(np.int64)
    counts = -(-past // block_size)
    cols = np.arange(nb)[None, :]
    idx = np.minimum(starts[:, None] + cols, max(len(batch.block_indices) - 1, 0))
    table = batch.block_indices[idx] if len(batch.block_indices) else np.zeros((len(seqs), nb), np.int64)
    return np.where(cols < counts[:, None], table, 0).astype(np.int64)
