"""llama.cpp through its C API (llama-cpp-python's ctypes bindings): a model loaded once, contexts over it.

A :class:`Context` is one KV store: a llama.cpp context with a unified KV cache of ``n_ctx`` cells
shared by up to ``n_seq_max`` sequences. :meth:`Context.step` runs one engine step: drop what the
engine dropped (``llama_memory_seq_rm``), then one ``llama_decode`` per ``n_batch`` rows (more rows
than ``n_batch`` in one call aborts the process), logits read for the flagged rows only.

The batch is our own ``llama_batch`` over numpy arrays allocated once per context: each row's
``seq_id`` pointer points into one int32 array, so a step fills arrays instead of looping in Python.
"""

from __future__ import annotations

import ctypes
import heapq
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from dspark.sdk import release_file
from dspark_llamacpp import amx
from llama_cpp import llama_cpp as C

_lock = threading.Lock()
_ready = False
_LOG_CB: Any = None  # kept alive: llama.cpp calls it from C

# ggml's type for each dtype K and V may be held in.
KV_TYPES = {"float32": C.GGML_TYPE_F32, "float16": C.GGML_TYPE_F16}

# What the runtime's log says about a load that failed, kept for the error message.
_last_errors: list[str] = []


def init() -> None:
    """Initialise the backend once, with llama.cpp's log routed to a short buffer (no progress dots)."""
    global _ready, _LOG_CB
    with _lock:
        if _ready:
            return

        @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
        def _log(level: int, text: bytes, _user: Any) -> None:
            if level not in (3, 4) or not text:  # GGML_LOG_LEVEL_WARN, _ERROR; debug, info and CONT dropped
                return
            _last_errors.append(text.decode(errors="replace").strip())
            del _last_errors[:-20]

        _LOG_CB = _log
        C.llama_log_set(_LOG_CB, None)
        C.llama_backend_init()
        _ready = True


def version() -> str:
    """The binding's version and its build: the first characters of the CPU library's hash in the wheel's RECORD
    (the project builds the wheel from the sdist with its own patches, scripts/llamacpp_wheel.sh; the engine keeps
    decoder timings and probe verdicts per runtime version, so a rebuilt library is timed and checked again)."""
    import llama_cpp

    return f"llama.cpp (llama-cpp-python {llama_cpp.__version__}{_build()})"


def _build() -> str:
    from importlib import metadata

    try:
        record = metadata.distribution("llama_cpp_python").read_text("RECORD") or ""
    except metadata.PackageNotFoundError:
        return ""
    for line in record.splitlines():
        name, _, rest = line.partition(",")
        if name.endswith("/libggml-cpu.so") and rest.startswith("sha256="):
            return f", build {rest[7:15]}"
    return ""


def system_info() -> str:
    init()
    raw: bytes = C.llama_print_system_info()
    return raw.decode().strip()


class LlamaError(RuntimeError):
    pass


def _abort_check() -> Any:
    """llama.cpp's abort callback (``bool (*)(void * data)``, asked between graph nodes) as a C function that
    reads a flag without entering Python: libc's ``strlen`` over a two-byte buffer ``[flag, 0]`` answers 0
    (go on) or 1 (abort). A Python callback takes the GIL at every node of every step (a twentieth of a
    decode step of the embedded model)."""
    libc = ctypes.CDLL(None)
    return C.ggml_abort_callback(ctypes.cast(libc.strlen, ctypes.c_void_p).value)


_ABORT: Any = None


REPACK_MAX_SEQS = 8  # repacked weights for steps of at most this many sequences (docs/benchmarks.md)


def extra_bufts(max_seqs: int = 1) -> bool:
    """Whether a model stepped with at most ``max_seqs`` sequences loads with llama.cpp's extra CPU buffer
    types (its quantized weights repacked for its kernels). Without AMX, repacked steps of a few rows ran
    faster and steps of 32 rows slower (docs/benchmarks.md, "Extra buffer types"), so on for engines of up
    to :data:`REPACK_MAX_SEQS` sequences. With AMX, its buffer type ran faster at every step size, so on
    for every engine where this llama.cpp's AMX kernels run (:func:`amx.runs`: a probe in a child process,
    cached). ``DSPARK_LLAMACPP_EXTRA_BUFTS=1`` or ``0`` decides instead."""
    asked = os.environ.get("DSPARK_LLAMACPP_EXTRA_BUFTS")
    if asked in ("0", "1"):
        return asked == "1"
    if amx.has_amx():
        return amx.runs()
    return max_seqs <= REPACK_MAX_SEQS


def _releasing(path: str) -> Any:
    """llama.cpp's load progress callback (``bool (*)(float progress, void *)``, true: go on) that releases
    the file's pages every twentieth of the load (reading the process's mappings at every tensor would add
    to the load what the release saves)."""
    last = [0.0]

    def progress(done: float, _user: Any) -> bool:
        if done - last[0] >= 0.05:
            last[0] = done
            release_file(path)
        return True

    return progress


class Model:
    """A GGUF file loaded once (memory-mapped: the weights stay in the file's own types)."""

    def __init__(self, path: str | Path, repack: bool | None = None) -> None:
        """``repack``: load with the extra CPU buffer types; None: :func:`extra_bufts` for one sequence."""
        init()
        self.path = str(path)
        params = C.llama_model_default_params()
        params.n_gpu_layers = 0
        # The extra CPU buffer types run the quantized types llama.cpp repacks for its kernels (on x86: Q4_0,
        # Q4_K, IQ4_NL) from a repacked copy; the file's pages of those tensors are then never read again,
        # so they leave memory as the load goes (the weights held once, the load's peak too).
        self.repacked = extra_bufts() if repack is None else repack
        params.use_extra_bufts = self.repacked
        progress = None
        if self.repacked:
            progress = C.llama_progress_callback(_releasing(self.path))
            params.progress_callback = progress  # kept alive by ``progress`` until the load returns
        _last_errors.clear()
        ptr = C.llama_model_load_from_file(self.path.encode(), params)
        if self.repacked:
            release_file(self.path)  # what the last tensors touched; the tensors run as stored fault back in
        if not ptr:
            why = "; ".join(_last_errors[-3:]) or "llama.cpp could not load it"
            raise LlamaError(f"{self.path}: {why}")
        self.ptr = ptr
        vocab = C.llama_model_get_vocab(ptr)
        self.n_vocab = int(C.llama_vocab_n_tokens(vocab))
        self.size_bytes = int(C.llama_model_size(ptr))

    def close(self) -> None:
        if getattr(self, "ptr", None):
            C.llama_model_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass


class Context:
    """One KV store over a :class:`Model`: ``n_ctx`` cells for up to ``n_seq_max`` sequences."""

    def __init__(self, model: Model, *, n_ctx: int, n_seq_max: int, n_batch: int, threads: int,
                 kv_dtype: str = "float32", flash_attn: bool = False, unified: bool = True) -> None:
        """``unified``: one cache of ``n_ctx`` cells shared by every sequence (each row's attention then spans
        every used cell, masked); else ``n_ctx / n_seq_max`` cells per sequence, each attending to its own.
        ``kv_dtype``: what K and V are held in (``KV_TYPES``)."""
        if kv_dtype not in KV_TYPES:
            raise ValueError(f"llama.cpp holds K and V in one of {sorted(KV_TYPES)}, not {kv_dtype!r}")
        self.model = model  # keeps the model alive as long as a context uses it
        p = C.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = min(n_batch, 512)
        p.n_seq_max = n_seq_max
        p.kv_unified = unified
        p.n_threads = p.n_threads_batch = threads
        p.type_k = p.type_v = KV_TYPES[kv_dtype]
        p.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.no_perf = True
        _last_errors.clear()
        ctx = C.llama_init_from_model(model.ptr, p)
        if not ctx:
            why = "; ".join(_last_errors[-3:]) or "llama_init_from_model returned NULL"
            raise LlamaError(f"a context of {n_ctx} tokens x {n_seq_max} sequences: {why}")
        self.ptr = ctx
        global _ABORT
        if _ABORT is None:
            _ABORT = _abort_check()
        self._abort = (ctypes.c_char * 2)()  # [flag, 0]: cancel() sets the flag, each decode clears it
        self._end = False  # end_run() sets it: greedy() returns after the step in flight
        C.llama_set_abort_callback(ctx, _ABORT, ctypes.addressof(self._abort))
        self.mem = C.llama_get_memory(ctx)
        self.n_ctx = int(C.llama_n_ctx(ctx))
        self.kv_dtype = kv_dtype
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.n_vocab = model.n_vocab
        # The batch: numpy arrays behind a llama_batch struct, allocated once.
        self._token = np.zeros(n_batch, np.int32)
        self._pos = np.zeros(n_batch, np.int32)
        self._nseq = np.ones(n_batch, np.int32)
        self._seq = np.zeros(n_batch, np.int32)
        self._logits = np.zeros(n_batch, np.int8)
        base = self._seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n_batch)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(n_batch)])
        b = C.llama_batch()
        b.token = self._token.ctypes.data_as(ctypes.POINTER(C.llama_token))
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self._pos.ctypes.data_as(ctypes.POINTER(C.llama_pos))
        b.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(C.llama_seq_id)))
        b.logits = self._logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b
        self.unified = unified
        self.slots: dict[int, int] = {}  # the engine's sequence id -> llama.cpp sequence id
        self._free = list(range(n_seq_max))  # a heap: the lowest free slot is taken first

    def drop(self, seq: int, first: int) -> None:
        slot = self.slots.get(seq)
        if slot is None:
            return
        if not C.llama_memory_seq_rm(self.mem, slot, first, -1):
            raise LlamaError(f"llama_memory_seq_rm refused to drop sequence {seq} from position {first}")
        if first == 0:
            del self.slots[seq]
            heapq.heappush(self._free, slot)

    def slot(self, seq: int) -> int:
        s = self.slots.get(seq)
        if s is None:
            if not self._free:
                raise LlamaError(f"more than {self.n_seq_max} live sequences")
            s = self.slots[seq] = heapq.heappop(self._free)
        return s

    def decode(self, seqs: np.ndarray, tokens: np.ndarray, positions: np.ndarray, want: np.ndarray) -> np.ndarray:
        """Rows of any sequences; returns float32 logits of the rows flagged in ``want`` (bool), in order."""
        n = len(tokens)
        slots = np.fromiter((self.slot(int(s)) for s in seqs), np.int32, n) if n else np.zeros(0, np.int32)
        order = None
        if not self.unified and n > 1 and bool((np.diff(slots) < 0).any()):
            # A cache per sequence splits a batch into micro-batches of sequences with consecutive ids, in
            # the order they come (llama_batch_allocr::split_equal): rows sorted by slot make one of them.
            order = np.argsort(slots, kind="stable")
            slots, tokens, positions, want = slots[order], tokens[order], positions[order], want[order]
        parts = []
        self._abort[0] = b"\x00"
        for a in range(0, n, self.n_batch):
            b = min(n, a + self.n_batch)
            m = b - a
            self._token[:m] = tokens[a:b]
            self._pos[:m] = positions[a:b]
            self._seq[:m] = slots[a:b]
            self._logits[:m] = want[a:b]
            self._batch.n_tokens = m
            rc = C.llama_decode(self.ptr, self._batch)
            if rc != 0:
                what = ("no free KV cells" if rc == 1 else "cancelled" if rc == 2 and self._abort[0] != b"\x00"
                        else f"llama_decode returned {rc}")
                raise LlamaError(f"{what} ({m} rows, {len(self.slots)} sequences, n_ctx {self.n_ctx})")
            r = int(want[a:b].sum())
            if r:
                ptr = C.llama_get_logits(self.ptr)
                parts.append(np.ctypeslib.as_array(ptr, shape=(r, self.n_vocab)).copy())
        if self._abort[0] != b"\x00":  # cancelled after its last node: still a cancelled step
            raise LlamaError(f"cancelled ({n} rows, {len(self.slots)} sequences)")
        if not parts:
            return np.zeros((0, self.n_vocab), np.float32)
        out = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if order is not None:  # back to the caller's row order
            out = out[np.argsort(order[want.astype(bool)], kind="stable")]
        return out

    def _logits_view(self, rows: int) -> np.ndarray:
        """The last decode's logits ``[rows, n_vocab]`` in llama.cpp's own buffer (read before the next decode)."""
        return np.ctypeslib.as_array(C.llama_get_logits(self.ptr), shape=(rows, self.n_vocab))

    def greedy(self, seqs: np.ndarray, tokens: np.ndarray, positions: np.ndarray, limits: np.ndarray,
               stops: frozenset[int], vocab: int) -> np.ndarray:
        """Greedy decoding of several steps in one call: row ``i`` (one per sequence) appends ``tokens[i]`` at
        ``positions[i]``; each step's argmax over the first ``vocab`` logits is the sequence's next token and
        is fed the step after, until the sequence has ``limits[i]`` tokens or gave one of ``stops``. Returns
        ``[rows, max(limits)]`` int64, -1 past each sequence's last token; every token but the last is in the
        cache afterwards."""
        n = len(tokens)
        out = np.full((n, int(limits.max())), -1, np.int64)
        slots = np.fromiter((self.slot(int(s)) for s in seqs), np.int32, n)
        if n > self.n_batch:
            raise LlamaError(f"{n} sequences in one greedy run, n_batch {self.n_batch}")
        self._abort[0] = b"\x00"
        b = self._batch
        if n == 1:  # one sequence: plain ints, no array work between decodes
            t, p, lim = int(tokens[0]), int(positions[0]), int(limits[0])
            self._seq[0], self._logits[0] = slots[0], 1
            b.n_tokens = 1
            for s in range(lim):
                self._token[0], self._pos[0] = t, p + s
                self._decode_checked(1)
                t = int(self._logits_view(1)[0, :vocab].argmax())
                out[0, s] = t
                if t in stops or self._end:
                    break
            return out
        order = np.argsort(slots, kind="stable")  # consecutive slots: one micro-batch (see decode)
        tok = tokens.astype(np.int32)
        pos = positions.astype(np.int32)
        stop_arr = np.fromiter(stops, np.int64, len(stops))
        active = order
        for s in range(int(limits.max())):
            m = len(active)
            self._token[:m], self._pos[:m], self._seq[:m] = tok[active], pos[active], slots[active]
            self._logits[:m] = 1
            b.n_tokens = m
            self._decode_checked(m)
            nxt = self._logits_view(m)[:, :vocab].argmax(1)
            out[active, s] = nxt
            tok[active] = nxt
            pos[active] += 1
            active = active[(s + 1 < limits[active]) & ~np.isin(nxt, stop_arr)]
            if not len(active) or self._end:
                break
        return out

    def end_run(self) -> None:
        """End the running ``greedy`` after the step in flight (from any thread): each sequence keeps the tokens
        it has. Cleared by the caller before the next run (:meth:`start_run`)."""
        self._end = True

    def start_run(self) -> None:
        self._end = False

    def _decode_checked(self, m: int) -> None:
        rc = C.llama_decode(self.ptr, self._batch)
        if rc != 0 or self._abort[0] != b"\x00":
            what = ("no free KV cells" if rc == 1 else "cancelled" if self._abort[0] != b"\x00"
                    else f"llama_decode returned {rc}")
            raise LlamaError(f"{what} ({m} rows, {len(self.slots)} sequences, n_ctx {self.n_ctx})")

    def cancel(self) -> None:
        """Stop the running ``decode`` at its graph's next node (from any thread): it raises "cancelled"."""
        self._abort[0] = b"\x01"

    def close(self) -> None:
        if getattr(self, "ptr", None):
            C.llama_free(self.ptr)
            self.ptr = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def quantize(src: str | Path, dst: str | Path, ftype: str, threads: int = 0) -> None:
    """llama.cpp's own quantizer: ``ftype`` is a llama_ftype name without its prefix ('Q4_K_M', 'Q8_0')."""
    init()
    params = C.llama_model_quantize_default_params()
    params.ftype = getattr(C, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise LlamaError(f"llama_model_quantize {src} -> {ftype} failed ({rc}): " + "; ".join(_last_errors[-3:]))
