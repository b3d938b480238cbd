"""dspark-plugin-llamacpp: llama.cpp as a whole-model decoder that keeps its own KV per sequence.

Shipped as its own distribution, as a third party would ship it, through the plugin API alone
(API 1.8's ``kv="sequence"`` decoders). It bids on GGUF files as they are stored (every type
llama.cpp runs: Q4_K_M, Q5_K, Q6_K, Q8_0, F16, BF16, ...) and on Hugging Face Llama checkpoints,
which it writes once as a GGUF file of the engine's dtype (convert.py); anything else is declined
with the reason. The engine times it beside the other decoders and runs whichever is fastest.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from dspark import hookimpl
from dspark.sdk import cache, get_logger, hostinfo
from dspark.sdk.decoder import DecoderSpec, SeqBatch
from dspark.types import DecoderBid, Device, Unavailable

__version__ = "0.3.0"  # 0.3: flash attention over f16 K and V; 0.2: K and V in
# half precision for a half-precision engine (each version's timings and verdicts are redone)
DSPARK_API_VERSION = "1.15"  # cancel(); pages released (dspark.sdk.release_file); greedy_steps; end_run

log = get_logger("dspark_llamacpp")
MAX_SEQS = 256  # LLAMA_MAX_SEQ: the most sequences one llama.cpp context holds
KV_SPLIT_BUDGET = 4  # a cache per sequence may take up to this many times the engine's KV budget
KV_SPLIT_MEMORY = 0.5  # ... and at most this share of the host's available memory (an edge box's)
_models: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_models_lock = threading.Lock()


def _runtime() -> Any:
    from dspark_llamacpp import runtime

    return runtime


@hookimpl
def dspark_probe_devices(refresh: bool) -> list[Device | Unavailable]:
    try:
        rt = _runtime()
    except Exception as exc:  # the binding is not installed or its library does not load on this machine
        return [Unavailable(what="llama.cpp", reason=f"llama-cpp-python does not import: {type(exc).__name__}: {exc}")]
    info = hostinfo.cpu_static()
    total, free = hostinfo.memory()
    return [Device(id="cpu", kind="cpu", name=info["model"], runtime=rt.version(), memory_total_bytes=total,
                   memory_free_bytes=free, dtypes=["float32", "bfloat16", "float16"],
                   properties={"system_info": rt.system_info()})]


def _is_gguf(path: str) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def _stored_types(path: str) -> dict[str, int]:
    """Tensors per storage type in a GGUF file (read from its header)."""
    import gguf

    reader = gguf.GGUFReader(path)
    out: dict[str, int] = {}
    for t in reader.tensors:
        name = t.tensor_type.name
        out[name] = out.get(name, 0) + 1
    return out


def _precision(types: dict[str, int]) -> str:
    """What a file's matrices compute in: a float type's products round the activations to it too."""
    if set(types) - {"F32", "F16", "BF16"}:
        return "as stored"
    return "bfloat16" if "BF16" in types else "float16" if "F16" in types else "float32"


def kv_dtype(engine_dtype: str) -> str:
    """What K and V are held in for an engine computing in ``engine_dtype``: float32 keeps the torch runner's
    logits; a half-precision engine's cache takes half the memory, as float16 (llama.cpp's own default:
    bfloat16's bytes with three more mantissa bits, which the embedded model's greedy text needs)."""
    return "float32" if engine_dtype == "float32" else "float16"


def flash_attn(kv: str) -> bool:
    """Whether llama.cpp's flash attention runs over K and V held in ``kv``: over f16 (llama.cpp's own
    default there) it is faster at every step shape and, as this project builds it, keeps a row's logits
    whatever rows share its step (scripts/patches/llama-cpp-python-0.3.36/4-flash-attn-row-order.patch and
    5-flash-attn-grouped-rows.patch); over f32 it is no faster, and the float32 engine keeps the torch
    runner's logits with the plain attention."""
    return kv == "float16"


def _kv_bytes_per_token(spec: DecoderSpec) -> int:
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * (4 if kv_dtype(spec.dtype) == "float32" else 2)


@hookimpl
def dspark_decoder_bid(decoder: DecoderSpec, device: Device) -> DecoderBid | None:
    if device.kind != "cpu":
        return None
    base: dict[str, Any] = {"device_id": device.id, "runtime": device.runtime, "kv": "sequence",
                            "max_seqs": MAX_SEQS, "kv_dtype": kv_dtype(decoder.dtype), "exit_layers": False}
    if decoder.layers != (0, decoder.num_layers):
        return DecoderBid(**base, declined="llama.cpp runs whole models, not layer ranges")
    if _is_gguf(decoder.path):
        types = _stored_types(decoder.path)
        stored = ", ".join(f"{k} x{v}" for k, v in sorted(types.items(), key=lambda kv: -kv[1]))
        return DecoderBid(**base, precision=_precision(types), weight_bytes=Path(decoder.path).stat().st_size,
                          kv_bytes_per_token=_kv_bytes_per_token(decoder), note=f"GGUF as stored: {stored}")
    from dspark_llamacpp import convert

    why = convert.why_not(decoder)
    if why:
        return DecoderBid(**base, declined=why)
    per = {"float32": 4, "bfloat16": 2, "float16": 2}[decoder.dtype]
    params = decoder.vocab_size * decoder.hidden_size * 2 + decoder.num_layers * (
        decoder.hidden_size * (decoder.num_heads + 2 * decoder.num_kv_heads) * decoder.head_dim
        + decoder.num_heads * decoder.head_dim * decoder.hidden_size + 3 * decoder.hidden_size * decoder.intermediate_size)
    return DecoderBid(**base, precision=decoder.dtype, weight_bytes=params * per,
                      kv_bytes_per_token=_kv_bytes_per_token(decoder),
                      note=f"written once as a {decoder.dtype} GGUF file (cached)")


def gguf_for(spec: DecoderSpec) -> Path:
    """The GGUF file llama.cpp loads for ``spec``: the file itself, or the checkpoint written once (cached)."""
    if _is_gguf(spec.path):
        return Path(spec.path)
    from dspark_llamacpp import convert

    out = cache.cache_dir() / "llamacpp-gguf" / f"{spec.fingerprint}-{spec.dtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        log.info("llamacpp.convert", model=spec.path, out=str(out))
        convert.write(spec, out)
    return out


def load_model(path: Path, max_seqs: int = 1) -> Any:
    """One loaded model per file (and way of holding it) in this process (the engine compiles a spec more
    than once); ``max_seqs``: the most sequences a step holds, which decides repacking
    (:func:`runtime.extra_bufts`)."""
    repack = _runtime().extra_bufts(max_seqs)
    key = str(path.resolve())
    with _models_lock:
        m = _models.get((key, repack))
        if m is None:
            t = time.perf_counter()
            m = _runtime().Model(key, repack=repack)
            _models[(key, repack)] = m
            log.info("llamacpp.load", file=key, seconds=round(time.perf_counter() - t, 3), max_seqs=max_seqs,
                     extra_buffer_types=repack)
        return m


def split_fits(split_tokens: int, budget_tokens: int, bytes_per_token: int, available_bytes: int) -> bool:
    """Whether a cache per sequence (``split_tokens`` cells in all) is taken over one shared cache of the
    engine's ``budget_tokens``: at most :data:`KV_SPLIT_BUDGET` times the budget, and within
    :data:`KV_SPLIT_MEMORY` of the host's available memory, so that the engine's budget is exceeded only where
    the memory is there (a box sized for the budget gets the shared cache)."""
    return (split_tokens <= KV_SPLIT_BUDGET * budget_tokens
            and split_tokens * bytes_per_token <= KV_SPLIT_MEMORY * available_bytes)


class LlamaDecoder:
    """A compiled decoder in API 1.8's sequence mode: each KV store is a llama.cpp context."""

    kv_mode = "sequence"

    def __init__(self, model: Any, spec: DecoderSpec) -> None:
        self.model = model
        self.threads = spec.threads or os.cpu_count() or 1
        self.n_batch = max(64, min(spec.max_num_tokens, 4096))
        self.vocab = spec.vocab_size
        self.max_len = spec.max_position_embeddings
        self.kv_bytes_per_token = _kv_bytes_per_token(spec)
        self.kv_dtype = kv_dtype(spec.dtype)
        self._running: Any = None  # the context a step is decoding in (what cancel() stops)
        self._cancel_lock = threading.Lock()
        if model.n_vocab < spec.vocab_size:
            raise ValueError(f"{model.path}: llama.cpp reads {model.n_vocab} tokens, the model has {spec.vocab_size}")

    def allocate(self, num_tokens: int, max_seqs: int) -> Any:
        if max_seqs > MAX_SEQS:
            raise ValueError(f"llama.cpp holds at most {MAX_SEQS} sequences per context, {max_seqs} asked")
        # A unified cache makes every row attend over every sequence's cells (masked): at many sequences that
        # is most of a step. A cache per sequence needs each to hold a whole context, so it is taken only while
        # that costs at most KV_SPLIT_BUDGET times the engine's budget and fits in KV_SPLIT_MEMORY of the
        # memory available now (DSPARK_LLAMACPP_KV=unified|split forces).
        per_seq = min(self.max_len, num_tokens)
        mode = os.environ.get("DSPARK_LLAMACPP_KV", "auto")
        split = max_seqs > 1 and (mode == "split" or (mode == "auto" and split_fits(
            max_seqs * per_seq, num_tokens, self.kv_bytes_per_token, hostinfo.memory()[1])))
        n_ctx = max_seqs * per_seq if split else num_tokens
        return _runtime().Context(self.model, n_ctx=n_ctx, n_seq_max=max_seqs, n_batch=self.n_batch,
                                  threads=self.threads, unified=not split, kv_dtype=self.kv_dtype,
                                  flash_attn=flash_attn(self.kv_dtype))

    def step(self, kv: Any, batch: SeqBatch) -> np.ndarray:
        if batch.exit_layer is not None:
            raise NotImplementedError("llama.cpp runs no early exit")
        for seq, first in batch.drops:
            kv.drop(seq, first)
        want = np.zeros(batch.num_tokens, np.int8)
        want[batch.logit_rows] = 1
        with self._cancel_lock:  # a cancel meant for this step reaches this step only
            self._running = kv
        try:
            logits: np.ndarray = kv.decode(batch.seq_ids, batch.input_ids, batch.positions, want)
        finally:
            with self._cancel_lock:
                self._running = None
        return logits[:, : self.vocab] if logits.shape[1] != self.vocab else logits

    def greedy_steps(self, kv: Any, batch: SeqBatch, limits: np.ndarray, stop_ids: frozenset[int]) -> np.ndarray:
        """Several greedy decode steps in one call (API 1.13): one ``llama_decode`` and an argmax per step."""
        for seq, first in batch.drops:
            kv.drop(seq, first)
        with self._cancel_lock:  # an end_run() from here on reaches this run
            self._running = kv
            kv.start_run()
        try:
            out: np.ndarray = kv.greedy(batch.seq_ids, batch.input_ids, batch.positions, limits, stop_ids, self.vocab)
        finally:
            with self._cancel_lock:
                self._running = None
        return out

    def cancel(self) -> None:
        """Stop the step running now (API 1.11: the engine's watchdog, past the step's deadline)."""
        with self._cancel_lock:
            if self._running is not None:
                self._running.cancel()

    def end_run(self) -> None:
        """End the greedy run in progress after its step in flight (API 1.15: a request arrived); nothing when
        none runs."""
        with self._cancel_lock:
            if self._running is not None:
                self._running.end_run()


@hookimpl
def dspark_compile_decoder(decoder: DecoderSpec, device: Device) -> LlamaDecoder | None:
    return LlamaDecoder(load_model(gguf_for(decoder), decoder.max_num_seqs), decoder)
