"""The cpu plugin's whole decoder: dspark's one decoder definition lowered to OpenVINO, on its paged attention.

The model is :func:`dspark.sdk.family.forward`; :mod:`.ops` supplies its ops as
OpenVINO nodes, so every family the definition expresses runs here and an op
variant OpenVINO lacks (the attention soft-cap) is declined by name.

One compiled model per layer range (and one more per early exit the engine asks
for, built on first use), all sharing the same per-layer KV tensors. The KV
layout and block size are the compiled model's own (``[blocks, kv_heads,
block, head_dim]``, 32 tokens per block on CPUs); the bid says so and the
engine lays its block tables out in it. KV precision is pinned to the engine's
dtype: the CPU plugin's default would compress it to u8. A model with soft-capped
attention scores (Gemma 2) attends over the past the graph gathers from host
blocks (:mod:`.gathered`): any block size, float32 KV.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark.sdk import get_logger, mapped
from dspark.sdk.decoder import BlockWeight, StepBatch
from dspark.sdk.family import decline
from dspark.types import DecoderBid
from dspark_plugins_cpu import runtime
from dspark_plugins_cpu.decoder import gathered
from dspark_plugins_cpu.decoder import ops as decoder_ops

if TYPE_CHECKING:
    from dspark.sdk.decoder import DecoderSpec
    from dspark.sdk import MappedWeights
    from dspark.types import Device

_OV_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
log = get_logger("dspark_plugins_cpu.decoder")
BLOCK_SIZE = 32  # the CPU plugin's paged-attention block for f32/bf16/f16 caches (read back after compile)


def decoder_bid(spec: DecoderSpec, device: Device) -> DecoderBid | None:
    ov_name = runtime.ov_device(device)
    if not ov_name.startswith("CPU"):
        return None  # the paged-attention operation is a CPU (and GPU-plugin) kernel; only the CPU is checked here
    base = {"device_id": device.id, "runtime": device.runtime, "runtime_version": runtime.version()}
    why = decline(spec, decoder_ops.OpenVINOOps.variants)
    bits = {q.weight_bits for q in (spec.quantization or {}).values()}
    if why is None and spec.dtype not in _OV_TYPES:
        why = f"computes in float32, bfloat16 or float16, not {spec.dtype}"
    if why is None and spec.dtype != "float32" and spec.dtype not in device.dtypes:
        why = f"this CPU does not compute {spec.dtype} natively"
    stored = None
    if why is None and "gguf_stored" in spec.features:
        why, stored = _stored_bytes(spec)
    if why is not None:
        return DecoderBid(**base, declined=why)
    a, b = spec.layers
    n = b - a
    per_layer = spec.hidden_size * ((spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim) \
        + spec.num_heads * spec.head_dim * spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size
    edges = spec.vocab_size * spec.hidden_size * ((a == 0) + (b == spec.num_layers))
    item = _BYTES[spec.dtype] if not bits else max(bits) / 8  # a rough size: the bulk compressed
    precision = spec.dtype if not bits else ("int8" if bits == {8} else "int4" if bits == {4} else "mixed int8/int4")
    if stored is not None:
        precision = "GGUF blocks as stored (" + ", ".join(sorted(stored[1])) + ")"
    own = spec.attn_softcap is not None  # attends over the gathered past: host blocks, float32, any block size
    kv_dtype = "float32" if own else spec.dtype
    return DecoderBid(**base, precision=precision, kv_dtype=kv_dtype, block_size=None if own else BLOCK_SIZE,
                      weight_bytes=stored[0] if stored is not None else int((n * per_layer + edges) * item),
                      kv_bytes_per_token=2 * n * spec.num_kv_heads * spec.head_dim * _BYTES[kv_dtype],
                      exit_layers=a == 0,
                      note="dspark.sdk.family.forward as OpenVINO nodes, on "
                      + ("attention over the gathered past (soft-capped scores)" if own else "PagedAttentionExtension")
                      + (", weights compressed as the plan says" if bits else ""))


def _stored_bytes(spec: DecoderSpec) -> tuple[str | None, tuple[int, set[str]] | None]:
    """Why a GGUF file's types cannot be held (naming the tensor and type), or the bytes its weights take as
    compressed constants (integers, float32 scales and zero points, the float embedding) and its types."""
    w = spec.blocks()
    if w is None:
        return "the engine gives no view of the GGUF file's blocks (DecoderSpec.blocks(), API 1.14)", None
    total, types = 0, set()
    item = _BYTES.get(spec.dtype, 4)
    projections = [p for L in w.layers for p in (L.qkv, L.o, L.gate_up, L.down)]
    for i, proj in enumerate([w.embed, w.head, *projections]):  # a tied head: a second constant of the table
        if not isinstance(proj, BlockWeight):
            total += proj.size * item
            continue
        for part in proj.parts:
            types.add(part.ggml_type)
            if part.is_float:
                total += part.rows * part.cols * item
            elif part.ggml_type not in decoder_ops.OpenVINOOps.block_types:
                return (f"{part.name} is stored as {part.ggml_type}; OpenVINO's compressed weights hold "
                        f"{', '.join(sorted(decoder_ops.OpenVINOOps.block_types))} blocks as stored"), None
            else:
                bits = 4 if part.ggml_type in ("Q4_0", "Q4_K") and i > 0 else 8  # the gathered table: bytes
                zero = part.ggml_type == "Q4_K"
                total += part.rows * part.cols * bits // 8 + part.rows * part.cols // part.group * 4 * (1 + zero)
    return None, (total, types)


class OpenVINODecoder:
    """A :class:`dspark.sdk.decoder.CompiledDecoder` on OpenVINO."""

    def __init__(self, spec: DecoderSpec, device: Device) -> None:
        self.spec = spec
        self.ov_name = runtime.ov_device(device)
        self.config: dict[str, Any] = {
            "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": _OV_TYPES[spec.dtype],
            "KV_CACHE_PRECISION": _OV_TYPES[spec.dtype]}
        if spec.threads > 0:  # the engine's thread budget (a server's cpu_cores_per_worker), not every core
            self.config["INFERENCE_NUM_THREADS"] = spec.threads
        self._lock = threading.Lock()
        self._exits: dict[int, Any] = {}
        self.gathered = spec.attn_softcap is not None
        self.weights_file = self._store()
        try:
            self.compiled = self._compile(spec.layers, head=spec.last, store=self.weights_file)
        except OSError as exc:  # the cache's disk is full or read-only: OpenVINO keeps its own copies
            if self.weights_file is None:
                raise
            self.weights_file.discard()
            self.weights_file = None
            log.warning("cpu.decoder.unmapped", model=spec.name, reason=str(exc))
            self.compiled = self._compile(spec.layers, head=spec.last)
        if self.weights_file is not None:
            self.weights_file.close()
        self._unpacked = {False, True}  # steps of one row / of several not yet run: OpenVINO packs at the first
        self.request = self.compiled.create_infer_request()
        self._running: Any = None  # the request a step is running on (what cancel() stops)
        self._cancelled = False
        self._cancel_lock = threading.Lock()
        self._in_run = False  # a greedy run is stepping (what end_run() ends)
        self._end = False
        self._bound: dict[int, Any] = {}  # id of a request -> the KV set it has bound
        self._held: dict[tuple[int, str], np.ndarray] = {}  # (id of a request, input) -> the array it reads
        self._names: dict[int, set[str]] = {}  # id of a request -> its input names (gathered attention)
        if self.gathered:
            self.block_size = BLOCK_SIZE  # any: the engine may set its own
            return
        shape = self.compiled.input(f"key_cache.{spec.layers[0]}").get_partial_shape()
        self.block_size = shape[2].get_length() if shape[2].is_static else BLOCK_SIZE
        self._kv_shape = [spec.num_kv_heads, self.block_size, spec.head_dim]
        self._kv_type = self.compiled.input(f"key_cache.{spec.layers[0]}").get_element_type()

    def _store(self) -> MappedWeights | None:
        """The file the weights' constants map, a quantization plan's integers and scales too (held once:
        OpenVINO's packed copy, the mapped pages dropped after the first steps); None where mapping saves
        nothing. The spec's fingerprint covers the plan."""
        if not mapped.usable():
            return None
        key = {"fingerprint": self.spec.fingerprint, "layers": list(self.spec.layers), "head": self.spec.last,
               "dtype": self.spec.dtype, "layout": decoder_ops.LAYOUT, "openvino": runtime.version()}
        try:
            return mapped.MappedWeights(key)
        except OSError as exc:  # the cache cannot be written: OpenVINO keeps its own copies
            log.warning("cpu.decoder.unmapped", model=self.spec.name, reason=str(exc))
            return None

    def _compile(self, layers: tuple[int, int], head: bool, store: MappedWeights | None = None) -> Any:
        model = decoder_ops.build(self.spec, layers, head=head, store=store)
        return runtime.core().compile_model(model, self.ov_name, self.config)

    @staticmethod
    def _several(batch: StepBatch) -> bool:
        return len(batch.input_ids if batch.input_ids is not None else batch.hidden) > 1

    def _packing(self, req: Any, batch: StepBatch) -> bool:
        """Whether OpenVINO packs weights in this step: the first step of one row, or of several, on the main
        request of a decoder whose weights are mapped from a file."""
        return self.weights_file is not None and req is self.request and self._several(batch) in self._unpacked

    def _packed(self, batch: StepBatch) -> None:
        """After a packing step (the first of one row, the first of several): OpenVINO has packed every weight
        for such steps, so the mapped pages it packed from leave memory (read back from disk if ever needed)."""
        assert self.weights_file is not None
        self._unpacked.discard(self._several(batch))
        self.weights_file.release()

    def allocate(self, num_blocks: int) -> list[tuple[Any, Any]]:
        import openvino as ov

        if self.gathered:
            shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)
            return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(*self.spec.layers)]
        shape = [num_blocks, *self._kv_shape]
        return [(ov.Tensor(self._kv_type, shape), ov.Tensor(self._kv_type, shape))
                for _ in range(*self.spec.layers)]

    def _request(self, exit_layer: int | None) -> Any:
        if exit_layer is None or exit_layer >= self.spec.layers[1]:
            return self.request
        if exit_layer not in self._exits:  # first use of this exit: its own model over the first layers
            self._exits[exit_layer] = self._compile((self.spec.layers[0], exit_layer), head=True).create_infer_request()
        return self._exits[exit_layer]

    def step(self, kv: list[tuple[Any, Any]], batch: StepBatch) -> np.ndarray:
        return self._step(kv, batch, np.array)  # a copy: the next step reuses the output buffer

    def _step(self, kv: list[tuple[Any, Any]], batch: StepBatch,
              read: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """One step; ``read`` takes what the caller needs from the output (logits or hidden rows) while the
        buffer is still this step's."""
        with self._lock:
            req = self._request(batch.exit_layer)
            a = self.spec.layers[0]
            if self.gathered:
                return read(self._step_gathered(req, kv, batch))
            if self._bound.get(id(req)) is not kv:
                for i in range(len(kv) if req is self.request else batch.exit_layer - a):  # type: ignore[operator]
                    req.set_tensor(f"key_cache.{a + i}", kv[i][0])
                    req.set_tensor(f"value_cache.{a + i}", kv[i][1])
                self._bound[id(req)] = kv
            feed = {"position_ids": batch.rope_rows, "past_lens": batch.past_lens,
                    "subsequence_begins": batch.subsequence_begins, "block_indices": _bucketed(batch.block_indices),
                    "block_indices_begins": batch.block_indices_begins,
                    "max_context_len": np.asarray(batch.max_context_len, dtype=np.int32)}
            if a == 0:
                feed["input_ids"] = batch.input_ids
            else:
                feed["hidden"] = batch.hidden
            if req is not self.request or self.spec.last:
                feed["logit_rows"] = batch.logit_rows
            for name, value in feed.items():
                self._feed(req, name, value)
            packing = self._packing(req, batch)
            self._infer(req, packing)
            if packing:
                self._packed(batch)
            return read(req.get_output_tensor(0).data)

    def greedy_steps(self, kv: list[tuple[Any, Any]], batch: StepBatch, limits: np.ndarray,
                     stop_ids: frozenset[int]) -> np.ndarray:
        """Several greedy decode steps in one call (API 1.13), one row per sequence each step: every sequence
        runs as many steps as the first to end (its limit, or a token of ``stop_ids``), so the step keeps its
        shape and OpenVINO prepares nothing again. A range short of the head, an early exit or LongRoPE's
        long rows run one step."""
        out = np.full((len(limits), int(limits.max())), -1, np.int64)
        whole = self.spec.layers[0] == 0 and self.spec.last and batch.exit_layer is None
        steps = int(limits.min()) if whole and batch.rope_positions is None else 1
        vocab = self.spec.vocab_size

        def argmax(logits: np.ndarray) -> np.ndarray:
            return logits[:, :vocab].argmax(1)  # no copy of the logits

        with self._cancel_lock:  # an end_run() from here on reaches this run
            self._in_run, self._end = True, False
        try:
            for s in range(steps):
                if s == 0 or self.gathered:
                    nxt = self._step(kv, batch, argmax)
                else:  # the first step bound every input: the next ones move four of them in place
                    nxt = self._next_step(nxt, argmax)
                out[:, s] = nxt
                if s + 1 == steps or self._end or not stop_ids.isdisjoint(nxt.tolist()):  # not np.isin: slow
                    break
                if self.gathered:  # its inputs are the gathered K/V, built from the batch each step
                    batch = _advanced(batch, nxt, self.block_size)
        finally:
            with self._cancel_lock:
                self._in_run = False
        return out

    def _next_step(self, tokens: np.ndarray, read: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """The next step of a greedy run, one row per sequence, fed in place: the main request reads the arrays
        the run's first step bound (:meth:`_feed`), and of those only the tokens, positions, past lengths and
        the longest context move; the block table already holds the whole run's pages (reserved before it)."""
        with self._lock:
            req, held = self.request, self._held
            key = id(req)
            np.copyto(held[key, "input_ids"], tokens)
            for name in ("position_ids", "past_lens", "max_context_len"):
                held[key, name] += 1
            self._infer(req)
            return read(req.get_output_tensor(0).data)

    def end_run(self) -> None:
        """End the greedy run in progress after its step in flight (API 1.15: a request arrived); nothing when
        none runs."""
        with self._cancel_lock:
            if self._in_run:
                self._end = True

    def _feed(self, req: Any, name: str, value: np.ndarray) -> None:
        """``value`` into input ``name`` of ``req``. Each input is bound once to an array of this decoder's that
        the request reads in place (a shared tensor); a step of the same shape refills that array rather than
        wrapping and setting a new tensor (7 inputs a step: 0.039 ms of set_tensor)."""
        import openvino as ov

        key = (id(req), name)
        held = self._held.get(key)
        if held is not None and held.shape == value.shape and held.dtype == value.dtype:
            np.copyto(held, value)
            return
        held = self._held[key] = np.array(value, order="C")  # owned: the batch's arrays are the engine's
        req.set_tensor(name, ov.Tensor(held, shared_memory=True))

    def _infer(self, req: Any, packing: bool = False) -> None:
        with self._cancel_lock:  # a cancel meant for this step reaches this step only
            self._cancelled, self._running = False, req
        # While OpenVINO packs (``packing``: the first steps) the pages it packed from go as it proceeds, so the
        # load peaks at the packed copy and a little, not at the packed copy and the whole mapped file. Only
        # then: a thread started and joined each step costs a step of a small model a tenth of a millisecond.
        releasing = _Releasing(self.weights_file) if packing and self.weights_file is not None else None
        try:
            req.infer()
        finally:
            if releasing is not None:
                releasing.stop()
            with self._cancel_lock:
                cancelled, self._running = self._cancelled, None
        if cancelled:  # also a cancel that reached the request before its inference began
            raise RuntimeError("step cancelled")

    def cancel(self) -> None:
        """Stop the step running now (API 1.11: the engine's watchdog, past the step's deadline): its
        ``infer`` raises, or the step raises once it returns."""
        with self._cancel_lock:
            if self._running is not None:
                self._cancelled = True
                self._running.cancel()

    def _step_gathered(self, req: Any, kv: list[tuple[np.ndarray, np.ndarray]], batch: StepBatch) -> np.ndarray:
        import openvino as ov

        a = self.spec.layers[0]
        names = self._names.get(id(req))
        if names is None:  # a request's input names, read once
            names = self._names[id(req)] = {n for port in req.model_inputs for n in port.get_names()}
        slots, seqs, pos = gathered.past_slots(batch, self.block_size)
        windows = [w for w in {*self.spec.windows, None} if gathered.mask_name(w) in names]
        feed: dict[str, np.ndarray] = {"position_ids": batch.rope_rows, "past_slots": slots,
                                       **gathered.masks(batch, seqs, pos, windows)}
        feed["input_ids" if a == 0 else "hidden"] = batch.input_ids if a == 0 else batch.hidden  # type: ignore[assignment]
        if "logit_rows" in names:
            feed["logit_rows"] = batch.logit_rows
        layers = [i for i in range(len(kv)) if f"key_cache.{a + i}" in names]
        for i in layers:
            feed[f"key_cache.{a + i}"], feed[f"value_cache.{a + i}"] = kv[i]
        for name, value in feed.items():
            req.set_tensor(name, ov.Tensor(np.ascontiguousarray(value), shared_memory=True))
        packing = self._packing(req, batch)
        self._infer(req, packing)
        if packing:
            self._packed(batch)
        for i in layers:
            for j, kind in enumerate(("key", "value")):
                new = req.get_tensor(f"{kind}_new.{a + i}").data
                gathered.write(kv[i][j], new, batch.slot_mapping)
        return np.array(req.get_output_tensor(0).data)


class _Releasing:
    """Releases a mapped weights file's pages every ``period_s`` on a thread of its own until stopped (OpenVINO
    reads the file's pages once, to pack them, during the steps this runs beside; a page released before it
    was read comes back from the file)."""

    def __init__(self, weights: MappedWeights, period_s: float = 0.02) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(weights, period_s), daemon=True,
                                        name="dspark-cpu-release")
        self._thread.start()

    def _run(self, weights: MappedWeights, period_s: float) -> None:
        while not self._done.wait(period_s):
            weights.release()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _advanced(batch: StepBatch, tokens: np.ndarray, block_size: int) -> StepBatch:
    """``batch`` one decode step on: each sequence's next token at the next position."""
    pos = batch.positions + 1
    first_block = batch.block_indices_begins[:-1]
    slots = batch.block_indices[first_block + pos // block_size].astype(np.int64) * block_size + pos % block_size
    return replace(batch, input_ids=tokens, positions=pos, past_lens=batch.past_lens + 1, slot_mapping=slots,
                   max_context_len=batch.max_context_len + 1)


def _bucketed(blocks: np.ndarray) -> np.ndarray:
    """``blocks`` (every sequence's block table, end to end) padded with zeros to a power of two, at least 16:
    PagedAttention reads only up to ``block_indices_begins``' last offset, and a length that changes as
    sequences cross pages would make OpenVINO prepare its attention nodes again at each crossing."""
    n = len(blocks)
    size = max(16, 1 << max(n - 1, 0).bit_length())
    if size == n:
        return blocks
    out = np.zeros(size, dtype=blocks.dtype)
    out[:n] = blocks
    return out


def compile_decoder(spec: DecoderSpec, device: Device) -> OpenVINODecoder | None:
    bid = decoder_bid(spec, device)
    if bid is None or bid.declined:
        return None
    return OpenVINODecoder(spec, device)
