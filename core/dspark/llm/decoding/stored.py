"""The decoders of a quantized GGUF file run as stored: each probed and timed in a process of its own.

The engine that starts such a file holds no torch copy of its weights, so the probe's reference (the file
dequantized to float, within a memory budget: dspark.llm.gguf.reference) is loaded in a child process
(``probe_child``), never in the serving one. The reference is needed only for its logits on the probe
scenario: the first probe records them before its decoder is compiled (the reference gone by then) and keeps
the recording on disk, and every later probe, of any decoder, replays it; the file is dequantized once per
version of the file and of dspark, not once per decoder. A decoder's probe and its timing share one process
and one compile. Verdicts of the probe step are cached (per file, target, runtime and versions of the plugin
and dspark); a compile or process that failed is not: it is tried again at the next start.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dspark.host import cache as disk
from dspark.llm.decoding.conformance import PROBE_SCENARIO, Transcript, from_state, to_state

if TYPE_CHECKING:
    from dspark.host.plugin_manager import PluginHost
    from dspark.llm.config import EngineConfig
    from dspark.llm.decoding.runner import Target
    from dspark.sdk.decoder import DecoderSpec

PROBE_NAMESPACE = "decoder-probe-stored-v2"  # verdicts (v2: keyed by versions, failures not kept)
TRANSCRIPT_NAMESPACE = "decoder-probe-transcript-v1"  # the reference's logits on the probe scenario
TIMEOUT_S = 900


@functools.cache
def dspark_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dspark")
    except PackageNotFoundError:  # a source tree on the path, not installed
        return ""


def _transcript_key(spec: DecoderSpec) -> dict[str, Any]:
    return {"fingerprint": spec.fingerprint, "dtype": spec.dtype, "dspark": dspark_version(),
            "scenario": json.loads(json.dumps(PROBE_SCENARIO))}


def load_transcript(spec: DecoderSpec) -> Transcript | None:
    """The reference's recorded probe scenario for this file; None if not recorded. A decoder of another block
    size replays its events as they are: the reference's logits do not depend on how its cache is paged."""
    import torch

    key = _transcript_key(spec)
    blob = disk.blob_path(TRANSCRIPT_NAMESPACE, key)
    if disk.load(TRANSCRIPT_NAMESPACE, key) is None or not blob.is_file():
        return None
    try:
        return from_state(torch.load(blob, weights_only=True))
    except Exception:  # a damaged or foreign file: recorded again
        return None


def store_transcript(spec: DecoderSpec, t: Transcript) -> None:
    import torch

    key = _transcript_key(spec)
    blob = disk.blob_path(TRANSCRIPT_NAMESPACE, key)
    blob.parent.mkdir(parents=True, exist_ok=True)
    tmp = blob.with_name(f".tmp-{os.getpid()}-{blob.name}")
    torch.save(to_state(t), tmp)
    os.replace(tmp, blob)  # the blob before its entry (disk.blob_path)
    disk.store(TRANSCRIPT_NAMESPACE, key, {"block_size": t.block_size})


def child(req: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    """probe_child's answer to ``req``, or why it gave none."""
    try:
        proc = subprocess.run([sys.executable, "-m", "dspark.llm.decoding.probe_child", json.dumps(req)],
                              capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return {"bad": f"the probe's process did not finish within {TIMEOUT_S} s"}
    if proc.returncode == 0 and proc.stdout.strip():
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    return {"bad": f"the probe's process failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"}


def _verdict(t: Target, spec: DecoderSpec, host: PluginHost | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The key of ``t``'s probe verdict on this file, and the verdict kept under it (None: not probed yet)."""
    rec = host.records.get(t.plugin or "") if host is not None else None
    key = {"fingerprint": spec.fingerprint, "target": t.label, "runtime": t.runtime,
           "plugin_version": rec.version if rec is not None else "", "dspark": dspark_version()}
    return key, disk.load(PROBE_NAMESPACE, key)


def _request(t: Target, spec: DecoderSpec) -> dict[str, Any]:
    return {"path": spec.path, "dtype": spec.dtype, "plugin": t.plugin, "device": t.device_id,
            "fingerprint": spec.fingerprint, "max_num_tokens": spec.max_num_tokens, "max_num_seqs": spec.max_num_seqs}


def _ask(t: Target, req: dict[str, Any], key: dict[str, Any]) -> dict[str, Any]:
    out = child(req, {**os.environ, "DSPARK_PLUGINS": str(t.plugin)})
    if out.get("verdict"):  # the probe step's own answer: kept
        disk.store(PROBE_NAMESPACE, key, {"bad": out.get("bad")})
    return out


def probe_isolated(t: Target, spec: DecoderSpec, probe_here: Callable[[], str | None] | None,
                   host: PluginHost | None = None) -> str | None:
    """Why ``t`` cannot be trusted on this file, or None: the cached verdict, or the probe's process's.
    ``probe_here``: the probe in this process, for a plugin that lives only in it (None: it is declined)."""
    key, cached = _verdict(t, spec, host)
    if cached is not None:
        return cached.get("bad")
    out = _ask(t, {**_request(t, spec), "probe": True}, key)
    if "missing" in out:
        return str(out["missing"]) if probe_here is None else probe_here()
    return out.get("bad")


def time_isolated(t: Target, spec: DecoderSpec, cfg: EngineConfig, host: PluginHost,
                  declined: list[dict[str, str]]) -> dict[str, Any] | None | bool:
    """Probe (unless its verdict is cached) and time ``t`` in one process of its own: the timings as the engine's
    cache keeps them; False when it failed (declined, charged to its plugin); None when its plugin lives in
    this process only (probed and timed here)."""
    if t.plugin is None:
        bad: str | None = "no plugin"
    else:
        key, cached = _verdict(t, spec, host)
        bad = cached.get("bad") if cached is not None else None
        if not bad:
            req = {**_request(t, spec), "time": [cfg.max_batch_size, min(128, cfg.max_num_batched_tokens)],
                   "probe": cached is None}
            out = _ask(t, req, key)
            if "missing" in out:
                return None
            if "step_ms" in out and not out.get("bad"):
                return {"step_ms": out["step_ms"], "reference_ms": None, "busy": out.get("busy")}
            bad = str(out.get("bad"))
    declined.append({"label": t.label, "reason": str(bad)})
    if t.plugin is not None:
        host.charge(t.plugin, "decoder.probe", str(bad), device=t.device_id)
    return False
