"""What the tests of the engine on a plugin's decoder share: the embedded model, five prompts, and running them."""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path
from typing import Any

from dspark.hookspecs import hookimpl
from dspark.llm.engine import LLMEngine
from dspark.llm.sampling import SamplingParams

MODEL = Path(__file__).resolve().parents[3] / "core" / "dspark" / "assets" / "models" / "stdlib-llama"
PROMPTS = ["def main():\n    args = parse()\n", "import os\nimport sys\n\n", "class Stack:\n    def push(self, x):\n",
           "for i in range(10):\n    print(i)\nfor j in range(", "# a long comment " * 6]


def run_prompts(engine: LLMEngine, params: list[SamplingParams], prios: list[int] | None = None) -> dict[str, Any]:
    """Every prompt of PROMPTS with its params (and priority), run to the end; every KV page comes back."""
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), p, sp, priority=(prios or [0] * len(PROMPTS))[i])
    out: dict[str, Any] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o
    assert engine.cache.all_free()
    return out


def float_engine(decoder: str, model: Path | str = MODEL, **kw: Any) -> LLMEngine:
    return LLMEngine.from_model(model, dtype="float32", decoder=decoder, **kw)


def greedy(n: int = 24) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _ in PROMPTS]


class _Renaming:
    """A real plugin's decoder under another runtime name (``RUNTIME``): its devices (``_devices``), bids
    (``_bid``) and compiled decoders (``_compile``), each decoder wrapped by ``_wrap``."""

    RUNTIME = "renamed"

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> Any:
        return [d.model_copy(update={"runtime": self.RUNTIME}) for d in self._devices(refresh)]

    @hookimpl
    def dspark_decoder_bid(self, decoder: Any, device: Any) -> Any:
        return self._bid(decoder, device)

    @hookimpl
    def dspark_compile_decoder(self, decoder: Any, device: Any) -> Any:
        return self._wrap(self._compile(decoder, device))

    def _devices(self, refresh: bool) -> list[Any]:
        raise NotImplementedError

    def _bid(self, decoder: Any, device: Any) -> Any:
        raise NotImplementedError

    def _compile(self, decoder: Any, device: Any) -> Any:
        raise NotImplementedError

    def _wrap(self, inner: Any) -> Any:
        raise NotImplementedError


class Renamed(_Renaming):
    """OpenVINO's decoder (the cpu plugin's) under another name (``RUNTIME``); subclasses change what a step and
    an allocation do (``_step``, ``_allocate``), and with ``CANCELS`` the decoder offers ``cancel`` (``_cancel``)."""

    DSPARK_API_VERSION = "1.6"
    RUNTIME = "renamed/CPU"
    CANCELS = False
    steps = 0

    def _devices(self, refresh: bool) -> list[Any]:
        from dspark_plugins_cpu import probe as ov_probe

        return [d for d in ov_probe.probe(refresh) if d.id == "cpu"]

    def _bid(self, decoder: Any, device: Any) -> Any:
        from dspark_plugins_cpu import decoder as ov_decoder

        return ov_decoder.decoder_bid(decoder, device)

    def _compile(self, decoder: Any, device: Any) -> Any:
        from dspark_plugins_cpu import decoder as ov_decoder

        return ov_decoder.compile_decoder(decoder, device)

    def _wrap(self, inner: Any) -> Any:
        plugin = self

        class Wrapped:
            block_size = inner.block_size

            def allocate(self, n: int) -> Any:
                return plugin._allocate(inner, n)

            def step(self, kv: Any, batch: Any) -> Any:
                return plugin._step(inner, kv, batch)

        class Cancelling(Wrapped):
            def cancel(self) -> None:
                plugin._cancel(inner)

        return Cancelling() if self.CANCELS else Wrapped()

    def _step(self, inner: Any, kv: Any, batch: Any) -> Any:
        raise NotImplementedError

    def _allocate(self, inner: Any, n: int) -> Any:
        return inner.allocate(n)

    def _cancel(self, inner: Any) -> None:
        inner.cancel()


class Faulty(Renamed):
    """Failing (raising or hanging) at its ``fail_at``-th step."""

    RUNTIME = "faulty/CPU"

    def __init__(self, fail_at: int, hang_s: float = 0.0) -> None:
        self.fail_at, self.hang_s, self.steps = fail_at, hang_s, 0

    def _step(self, inner: Any, kv: Any, batch: Any) -> Any:
        self.steps += 1
        if self.steps == self.fail_at:
            if self.hang_s:
                time.sleep(self.hang_s)
            else:
                raise RuntimeError("device lost")
        return inner.step(kv, batch)


class LlamacppWrapped(_Renaming):
    """llama.cpp's decoder (plugins/dspark-llamacpp) under another runtime name (``RUNTIME``); subclasses change
    what a step does (``_step``), and with ``RUNS`` the decoder offers greedy runs (API 1.13, ``_greedy_steps``), with
    ``ENDS`` also ``end_run`` (API 1.15, ``_end_run``).
    Built only where the plugin is installed."""

    DSPARK_API_VERSION = "1.15"
    RUNTIME = "wrapped llama.cpp"
    RUNS = False
    ENDS = False  # with RUNS: the decoder offers end_run (API 1.15, ``_end_run``)

    def _devices(self, refresh: bool) -> list[Any]:
        import dspark_llamacpp

        return list(dspark_llamacpp.dspark_probe_devices(refresh))

    def _bid(self, decoder: Any, device: Any) -> Any:
        import dspark_llamacpp

        return dspark_llamacpp.dspark_decoder_bid(decoder, device)

    def _compile(self, decoder: Any, device: Any) -> Any:
        import dspark_llamacpp

        return dspark_llamacpp.dspark_compile_decoder(decoder, device)

    def _wrap(self, inner: Any) -> Any:
        plugin = self

        class Wrapped:
            kv_mode = "sequence"

            def allocate(self, n: int, seqs: int) -> Any:
                return inner.allocate(n, seqs)

            def step(self, kv: Any, batch: Any) -> Any:
                return plugin._step(inner, kv, batch)

        class Running(Wrapped):
            def greedy_steps(self, kv: Any, batch: Any, limits: Any, stop_ids: frozenset[int]) -> Any:
                return plugin._greedy_steps(inner, kv, batch, limits, stop_ids)

        class Ending(Running):
            def end_run(self) -> None:
                plugin._end_run(inner)

        return (Ending() if self.ENDS else Running()) if self.RUNS else Wrapped()

    def _step(self, inner: Any, kv: Any, batch: Any) -> Any:
        return inner.step(kv, batch)

    def _greedy_steps(self, inner: Any, kv: Any, batch: Any, limits: Any, stop_ids: frozenset[int]) -> Any:
        return inner.greedy_steps(kv, batch, limits, stop_ids)

    def _end_run(self, inner: Any) -> None:
        inner.end_run()


class Counted(Renamed):
    """OpenVINO's decoder under its own name, counting the compiled decoders alive when it compiles one."""

    def __init__(self, name: str, alive: weakref.WeakSet[Any], seen: list[int]) -> None:
        self.RUNTIME, self.alive, self.seen = f"{name}/CPU", alive, seen

    @hookimpl
    def dspark_compile_decoder(self, decoder: Any, device: Any) -> Any:
        gc.collect()
        self.seen.append(len(self.alive))
        compiled = Renamed.dspark_compile_decoder(self, decoder, device)
        self.alive.add(compiled)
        return compiled

    def _step(self, inner: Any, kv: Any, batch: Any) -> Any:
        return inner.step(kv, batch)
