"""A decoder that runs a quantized GGUF file as stored, probed and timed in a process of its own (stored.py).

``python -m dspark.llm.decoding.probe_child REQUEST_JSON`` prints one JSON line. With ``"probe"`` (the
default when the request has no ``"time"``) the probe step runs: against the reference's recorded logits
(stored.py keeps them per file), recorded first here when there are none (the file dequantized to float as
its forward reaches each matrix, within a memory budget, and let go before the decoder is compiled):
``{"bad": null, "verdict": true}`` (trusted) or ``{"bad": "why", "verdict": true}`` (wrong or failing), which
the parent caches. With ``"time"`` (the engine's ``max_batch_size`` and prefill chunk) the decoder, if it
passed, is timed at the engine's step shapes and ``"step_ms"`` added. ``{"bad": "why"}`` without a verdict:
a compile or process that failed (the parent tries it again next start); ``{"missing": "why"}``: the plugin
cannot be loaded here (one registered in the parent's process only).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.llm.decoding.conformance import Transcript


def run(req: dict[str, object]) -> dict[str, object]:
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.decoding.spec import make_spec
    from dspark.llm.gguf import load_runner

    plugin, device_id = str(req["plugin"]), str(req["device"])
    host = PluginHost().load()
    inv = probe(host)
    dev = next((d for d in inv.drivers() if d.plugin == plugin and d.id == device_id), None)
    if dev is None:
        return {"missing": f"plugin {plugin!r} on {device_id} cannot be loaded in a process of its own"}
    path = Path(str(req["path"]))
    runner, _ = load_runner(path, str(req["dtype"]), weightless_if_quantized=True)
    spec = make_spec(runner, path, max_num_tokens=int(str(req["max_num_tokens"])),
                     max_num_seqs=int(str(req["max_num_seqs"])), extra_features=frozenset({"gguf_stored"}))
    if spec.fingerprint != req["fingerprint"]:
        return {"bad": f"the file changed while it was probed ({spec.fingerprint} != {req['fingerprint']})"}
    recording = _recorded(spec, path, str(req["dtype"])) if req.get("probe", "time" not in req) else None
    compiled = host.call(plugin, "dspark_compile_decoder", decoder=spec, device=dev)
    if compiled is None:
        return {"bad": "bid, then did not compile in the probe's process"}
    out: dict[str, object] = {}
    if recording is not None:
        try:
            out = {"bad": _replayed(compiled, runner, spec, recording), "verdict": True}  # the probe's own answer
        except Exception as exc:  # not a verdict: tried again next start
            return {"bad": f"the probe step raised {type(exc).__name__}: {exc}"}
        if out["bad"] or "time" not in req:
            return out
    return {**out, **_time(req, runner, compiled, plugin, device_id)}


def _recorded(spec: object, path: Path, dtype: str) -> Transcript:
    """The reference's recording of the probe scenario for this file: from the cache, or recorded here (the
    file dequantized to float within a memory budget, dspark.llm.gguf.reference; let go before any decoder is
    compiled) and kept for every later probe."""
    import gc

    from dspark.llm.decoding import stored
    from dspark.llm.decoding.conformance import PROBE_SCENARIO, probe_blocks, record
    from dspark.llm.gguf.reference import reference_runner

    t = stored.load_transcript(spec)  # type: ignore[arg-type]
    if t is None:
        reference = reference_runner(path, dtype)
        t = record(reference, 16, num_blocks=probe_blocks(16), **PROBE_SCENARIO)
        del reference
        gc.collect()
        try:
            stored.store_transcript(spec, t)  # type: ignore[arg-type]
        except OSError:  # a full or read-only cache: recorded again next time
            pass
    return t


def _replayed(compiled: object, runner: object, spec: object, recording: Transcript) -> str | None:
    from dspark.llm.decoding.choose import exact
    from dspark.llm.decoding.conformance import probe_blocks, replay
    from dspark.sdk.decoder import is_sequence

    bs = 16 if is_sequence(compiled) else compiled.block_size  # type: ignore[attr-defined]
    cfg, dtype = runner.cfg, runner.dtype  # type: ignore[attr-defined]
    at_bs = Transcript(bs, recording.events)  # (stored.load_transcript: any block size)
    r = replay(compiled, at_bs, cfg, dtype, num_blocks=probe_blocks(bs))  # type: ignore[arg-type]
    return r.why_not(exact(spec, None))  # type: ignore[arg-type]


def _time(req: dict[str, object], runner: object, compiled: object, plugin: str, device_id: str) -> dict[str, object]:
    from dspark.host import hook_threads
    from dspark.llm.decoding.runner import DecoderRunner, Target
    from dspark.llm.decoding.timing import CONTEXT, Bench, Contention, shapes, time_targets
    from dspark.sdk.decoder import is_sequence

    max_batch, chunk = (int(x) for x in req["time"])  # type: ignore[attr-defined]
    sl = shapes(max_batch, chunk)
    max_seqs = max(s.seqs for s in sl)
    target = Target(f"{plugin}@{device_id}", "", compiled, plugin, device_id)  # type: ignore[arg-type]
    dr = DecoderRunner(runner, [target], step_timeout_s=None, max_seqs=max_seqs)  # type: ignore[arg-type]
    bs = 16 if is_sequence(compiled) else compiled.block_size  # type: ignore[attr-defined]
    cfg = runner.cfg  # type: ignore[attr-defined]
    try:
        bench = Bench(dr.step, lambda n: dr.make_cache(n, bs), bs, max_seqs=max_seqs,
                      context=min(CONTEXT, cfg.max_position_embeddings - 130), max_rows=130, vocab=cfg.vocab_size,
                      greedy=dr.greedy_steps if dr.offers_greedy_steps() else None)
        hook_threads.retire_idle()
        with Contention() as busy:
            timed = time_targets({"t": bench}, sl)["t"]
        return {"step_ms": timed, "busy": busy.share}
    except Exception as exc:
        return {"bad": f"a timed step raised {type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    from dspark.llm.gguf.metadata import shared_readers

    with shared_readers():
        print(json.dumps(run(json.loads(sys.argv[1]))))
