"""The probe step of a decoder that runs a quantized GGUF file as stored, in a process of its own.

The engine that starts such a file holds no torch copy of its weights (decoding/setup.py); the probe's
torch reference (the file dequantized to float) is loaded here instead, so the serving process never
holds it. ``python -m dspark.llm.decoding.probe_child REQUEST_JSON`` prints one JSON line:
``{"bad": null}`` (trusted), ``{"bad": "why"}`` (wrong or failing), or ``{"missing": "why"}`` when the
plugin cannot be loaded here (one registered in the parent's process only).
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
    runner, _ = load_runner(path, str(req["dtype"]))
    spec = make_spec(runner, path, max_num_tokens=int(str(req["max_num_tokens"])),
                     max_num_seqs=int(str(req["max_num_seqs"])), extra_features=frozenset({"gguf_stored"}))
    if spec.fingerprint != req["fingerprint"]:
        return {"bad": f"the file changed while it was probed ({spec.fingerprint} != {req['fingerprint']})"}
    compiled = host.call(plugin, "dspark_compile_decoder", decoder=spec, device=dev)
    if compiled is None:
        return {"bad": "bid, then did not compile in the probe's process"}
    try:
        return {"bad": _probe(compiled, runner, spec)}
    except Exception as exc:
        return {"bad": f"the probe step raised {type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))))
