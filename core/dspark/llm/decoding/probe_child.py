"""The probe step of a decoder that runs a quantized GGUF file as stored, and its timing, in a process of its own.

The engine that starts such a file holds no torch copy of its weights (decoding/setup.py); the probe's
torch reference (the file dequantized to float) is loaded here instead, so the serving process never
holds it. ``python -m dspark.llm.decoding.probe_child REQUEST_JSON`` prints one JSON line:
``{"bad": null}`` (trusted), ``{"bad": "why"}`` (wrong or failing; with ``"verdict": true`` when the probe
step itself answered, which the parent caches: a compile or process that failed is tried again next start),
or ``{"missing": "why"}`` when the plugin cannot be loaded here (one registered in the parent's process
only). A request with ``"time"`` (the engine's ``max_batch_size`` and prefill chunk) times the decoder at the
engine's step shapes instead and prints ``{"step_ms": {...}}``: where several decoders run the file as stored,
each is timed in a process of its own, so the serving process never holds one decoder's weights and KV while
it times another.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run(req: dict[str, object]) -> dict[str, object]:
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.decoding.choose import _probe
    from dspark.llm.decoding.spec import make_spec
    from dspark.llm.gguf import load_runner

    plugin, device_id = str(req["plugin"]), str(req["device"])
    host = PluginHost().load()
    inv = probe(host)
    dev = next((d for d in inv.drivers() if d.plugin == plugin and d.id == device_id), None)
    if dev is None:
        return {"missing": f"plugin {plugin!r} on {device_id} cannot be loaded in a process of its own"}
    path = Path(str(req["path"]))
    runner, _ = load_runner(path, str(req["dtype"]), weightless_if_quantized="time" in req)
    spec = make_spec(runner, path, max_num_tokens=int(str(req["max_num_tokens"])),
                     max_num_seqs=int(str(req["max_num_seqs"])), extra_features=frozenset({"gguf_stored"}))
    if spec.fingerprint != req["fingerprint"]:
        return {"bad": f"the file changed while it was probed ({spec.fingerprint} != {req['fingerprint']})"}
    compiled = host.call(plugin, "dspark_compile_decoder", decoder=spec, device=dev)
    if compiled is None:
        return {"bad": "bid, then did not compile in the probe's process"}
    if "time" in req:
        return _time(req, runner, compiled, plugin, device_id)
    try:
        return {"bad": _probe(compiled, runner, spec), "verdict": True}  # the probe's own answer: kept
    except Exception as exc:
        return {"bad": f"the probe step raised {type(exc).__name__}: {exc}"}


def _time(req: dict[str, object], runner: object, compiled: object, plugin: str, device_id: str) -> dict[str, object]:
    from dspark.host import hook_threads
    from dspark.llm.decoding.runner import DecoderRunner, Target
    from dspark.llm.decoding.timing import CONTEXT, Bench, shapes, time_targets
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
                      context=min(CONTEXT, cfg.max_position_embeddings - 130), max_rows=130, vocab=cfg.vocab_size)
        hook_threads.retire_idle()
        return {"step_ms": time_targets({"t": bench}, sl)["t"]}
    except Exception as exc:
        return {"bad": f"a timed step raised {type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    from dspark.llm.gguf.metadata import shared_readers

    with shared_readers():
        print(json.dumps(run(json.loads(sys.argv[1]))))
