"""User-facing entry points: ``LLM`` (blocking, batched) and ``AsyncLLMEngine`` (asyncio, for servers)."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from dspark.llm.engine import EngineStats, LLMEngine, RequestOutput
from dspark.llm.outputs import EngineLayout
from dspark.llm.inputs import InputProcessor
from dspark.llm.runner.types import Work
from dspark.llm.sampling import SamplingParams

Prompt = str | list[int]


def default_model_path() -> Path:
    return Path(__file__).resolve().parent.parent / "assets" / "models" / "stdlib-llama"


def _resolve(model: str | Path | None) -> Path:
    if model is not None:
        return Path(model)
    path = default_model_path()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the embedded default model is not at {path} (not trained/installed yet); "
                                "pass a checkpoint directory to LLM(...)")
    return path


class LLM:
    """``LLM(path_or_default=None, *, dtype="auto", **EngineConfig fields)``; None = embedded model.

    Prompts are strings (tokenized with the checkpoint's tokenizer.json, which
    adds BOS if the tokenizer does) or token-id lists. An empty prompt is run
    as BOS alone; a model without a ``bos_token_id`` rejects it.
    """

    def __init__(self, model: str | Path | None = None, *, dtype: str = "auto", **engine_kw: Any) -> None:
        self.engine = LLMEngine.from_model(_resolve(model), dtype=dtype, **engine_kw)
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: int | Sequence[int] = 0) -> list[RequestOutput]:
        """Run all prompts through the engine together; outputs in prompt order."""
        plist: list[Prompt] = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)  # type: ignore[list-item]
        n = len(plist)
        ps = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * n
        prios = list(priority) if isinstance(priority, Sequence) else [priority] * n
        if len(ps) != n or len(prios) != n:
            raise ValueError(f"{n} prompts but {len(ps)} sampling params and {len(prios)} priorities")
        rids = [f"gen-{next(self._ids)}" for _ in plist]
        # Validate everything before queueing anything, so a bad prompt leaves no half-run batch.
        seqs = [self.engine.make_sequence(r, p, sp, pr) for r, p, sp, pr in zip(rids, plist, ps, prios)]
        final: dict[str, RequestOutput] = {}
        try:
            for s in seqs:
                self.engine.add_sequence(s)
            while len(final) < n:
                for out in self.engine.step(finished_only=True, closed=True):
                    final[out.request_id] = out
        finally:
            for r in rids:
                if r not in final:
                    self.engine.abort(r)
        return [final[r] for r in rids]

    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None,
                        priority: int = 0) -> Iterator[str]:
        """Yield text as it is produced; breaking out of the loop aborts the request."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params, priority)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        if out.delta:
                            yield out.delta
        finally:
            if not done:
                self.engine.abort(rid)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def runner(self) -> Any:
        """The :class:`~dspark.llm.runner.model.ModelRunner` (its forward, kernels and weights)."""
        return self.engine.runner

    @property
    def plan(self) -> Any:
        """The :class:`~dspark.llm.quantization.QuantPlan` the model runs with, or None when it is float."""
        return self.engine.quant_plan

    @property
    def kernels(self) -> list[Any]:
        """Who runs each quantized layer, and the bids that chose it."""
        return list(self.engine.quant_kernels)

    def weight_bytes(self) -> int:
        """Bytes of the weights as held in memory: the torch runner's (quantized layers at their packed size),
        or, once a compiled decoder holds the model, what its plugin's bid said the weights take."""
        return int(self.runner.weight_bytes())


def optimize_model(model: Any = None, quantization_config: dict[str, Any] | str | None = None,
                   speculative_decoding_config: dict[str, Any] | bool | None = None, *, dtype: str = "auto",
                   **engine_kw: Any) -> LLM:
    """The seed's entry point: a ready model, quantized and with speculative decoding as configured.

    ``model``: a checkpoint directory, None for the embedded model, an optimized directory from
    ``dspark convert``, or a loaded ``transformers`` model whose ``name_or_path`` is a local directory.
    ``quantization_config``: :class:`~dspark.llm.quantization.QuantizationConfig` fields, e.g.
    ``{"method": "auto_mixed_precision", "calibration_dataset": "calib.jsonl",
    "sensitive_layers": ["embed_tokens", "lm_head"], "target_device": "cpu"}``.
    ``speculative_decoding_config``: :class:`~dspark.llm.config.SpeculativeConfig` fields, e.g.
    ``{"enabled": True, "draft_model": "auto", "strategy": "deepspec"}``.
    """
    from dspark.llm.config import QuantizationConfig

    path = _model_path(model)
    qc = None if quantization_config is None else QuantizationConfig.model_validate(
        quantization_config if isinstance(quantization_config, dict) else {"method": quantization_config})
    if qc is not None and qc.target_device not in ("auto", "cpu"):
        import torch

        dev = qc.target_device
        ok = dev.startswith("cuda") and torch.cuda.is_available() and (
            ":" not in dev or int(dev.split(":")[1]) < torch.cuda.device_count())
        if not ok:
            raise ValueError(f"quantization_config.target_device: {dev!r} is not a device torch can drive here "
                             "(use 'cpu' or 'auto')")
        engine_kw.setdefault("devices", "auto")
    if speculative_decoding_config is not None:
        engine_kw["speculative_decoding"] = speculative_decoding_config
    return LLM(path, dtype=dtype, quantization=qc, **engine_kw)


def _model_path(model: Any) -> Path | None:
    if model is None or isinstance(model, (str, Path)):
        return None if model is None else Path(model)
    if isinstance(model, LLM):
        return model.engine.model_path
    name = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if isinstance(name, str) and Path(name).is_dir():
        return Path(name)
    raise TypeError(f"optimize_model: model must be a checkpoint directory, None (the embedded model) or a "
                    f"transformers model loaded from a local directory; got {type(model).__name__}")


def _is_ids(x: object) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _put_all(items: list[tuple[asyncio.Queue[Any], Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


class EngineClient(Protocol):
    """What a server asks of an engine, in this process (:class:`AsyncLLMEngine`) or on a cluster's replicas
    (``dspark.server.cluster.frontend.RemoteAsyncEngine``); vLLM's ``EngineClient``. ``inputs`` runs a
    request's checks before anything is queued; ``generate`` streams one sequence's outputs."""

    @property
    def inputs(self) -> InputProcessor: ...

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                 priority: int = 0) -> AsyncIterator[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def shutdown(self) -> None: ...


class AsyncLLMEngine:
    """Steps the engine in one background thread; any number of asyncio tasks stream from it.

    Adds and aborts go through an inbox that the engine thread drains between
    steps, so the engine itself is only ever touched by that thread.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        # Two locks: the engine's, held through each step (a run of greedy steps lasts milliseconds), and the
        # stream table's, held for a dict operation. The event loop takes only the second when a request
        # arrives or ends, so it never waits on a step: a burst of arrivals reaches the inbox at once and is
        # admitted in one step, not one step each.
        self._lock = threading.Lock()  # engine reads and steps
        self._streams_lock = threading.Lock()  # _streams
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ids = itertools.count()

    @property
    def inputs(self) -> InputProcessor:
        """The engine's request checks; pure, so any thread may run them."""
        return self.engine.inputs

    @classmethod
    def from_pretrained(cls, model: str | Path | None = None, *, dtype: str = "auto", **engine_kw: Any) -> AsyncLLMEngine:
        """The engine built on the thread that then steps it. Runtimes keep state per calling thread: torch
        and llama.cpp share one libgomp, whose thread team belongs to the thread that calls, and once the
        thread that probed and timed the decoders and the thread that steps it each had one, llama.cpp's
        decode step of the embedded model took 1.2-2.1 ms instead of 0.6."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def build_then_step() -> None:
            try:
                obj = cls(LLMEngine.from_model(_resolve(model), dtype=dtype, **engine_kw))
            except BaseException as exc:  # raised again in the caller
                box["error"] = exc
                ready.set()
                return
            obj._thread = threading.current_thread()
            box["engine"] = obj
            ready.set()
            obj._run()

        thread = threading.Thread(target=build_then_step, name="dspark-llm-engine", daemon=True)
        thread.start()
        while not ready.wait(1.0):
            if not thread.is_alive():  # (it sets ready on every way out; this is the guard for a crash)
                raise RuntimeError("the engine thread ended while building the engine")
        if "error" in box:
            raise box["error"]
        return box["engine"]  # type: ignore[no-any-return]

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="dspark-llm-engine", daemon=True)
            self._thread.start()

    def _deliver(self, rid: str, item: Any) -> None:
        with self._streams_lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:
                pass  # the caller's loop is gone

    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            while not self._inbox.empty():
                op, arg = self._inbox.get()
                if op == "add":
                    try:
                        with self._lock:
                            eng.add_sequence(arg)
                    except ValueError as e:  # e.g. an id already used through the sync API
                        self._deliver(arg.request_id, e)
                    continue
                with self._lock:
                    out = eng.abort(arg)
                if out is not None:
                    self._deliver(arg, out)
            with self._lock:
                busy = eng.has_unfinished()
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                with self._lock:
                    outs = eng.step()
            except BaseException as e:  # a step fault fails every open stream, not just silently the thread
                self._error = e
                with self._lock:
                    eng.abort_all()
                with self._streams_lock:
                    rids = list(self._streams)
                for rid in rids:
                    self._deliver(rid, e)
                continue
            self._deliver_all(outs)

    def _deliver_all(self, outs: list[RequestOutput]) -> None:
        """A step's outputs, handed to each caller's event loop in one callback (one wake-up of the loop
        per step, not one per request: each is a write to the loop's self-pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        with self._streams_lock:
            for out in outs:
                target = self._streams.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass  # the caller's loop is gone

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        rid = request_id or f"async-{next(self._ids)}"
        seq = self.engine.make_sequence(rid, prompt, params, priority)  # raises here, in the caller
        q: asyncio.Queue[Any] = asyncio.Queue()
        with self._streams_lock:
            if rid in self._streams:
                raise ValueError(f"request_id {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), q)
        self._start()
        self._inbox.put(("add", seq))
        self._wake.set()
        self.engine.end_run()  # a greedy run in progress ends after its step in flight: this one is admitted next
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(rid, None)
            if not finished:  # consumer went away or was cancelled: free its pages
                self._inbox.put(("abort", rid))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def observe(self, fn: Callable[[Work, float], None]) -> None:
        """:meth:`LLMEngine.observe`: ``fn`` is called on the engine thread; keep it short."""
        with self._lock:
            self.engine.observe(fn)

    def layout(self) -> EngineLayout:
        """:meth:`LLMEngine.layout`: what runs the model and where."""
        with self._lock:
            return self.engine.layout()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self.engine.abort_all()
