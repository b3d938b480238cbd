"""Served throughput of image classifiers under wrk: ``dspark serve`` (Open Inference Protocol) against
ONNX Runtime behind a plain FastAPI app.

Usage: apt-get install -y wrk                      (Debian's wrk 4.1, the load generator)
       .venv/bin/python benchmarks/serve_oip.py [--models resnet50,vit] [--clients 1,8,32] [--duration 20]
                                                [--rounds 3] [--preferred 8,16,32] [--max-queue-delay-us 2000]
                                                [--servers dspark-batch,dspark-nobatch,ort-fastapi]
                                                [--wrk-threads 2] [--fresh] [--report] [--json [PATH]]

Models (benchmarks/models.py, ``SERVING_MODELS``; random weights, exported once with torch's TorchScript
exporter at opset 17 with a dynamic batch dimension to benchmarks/out/serve_oip/models/NAME.onnx):
``resnet50``, the standard bottleneck ResNet-50, and ``vit``, a DeiT-small-shaped vision transformer (patch
16, hidden 384, 12 blocks, 6 heads). Input ``input`` (batch, 3, 224, 224) float32, output ``logits``
(batch, 1000).

Servers, each started fresh in its own process for each (round, model), the three in turn with the one
that goes first rotating from round to round and model to model:

  dspark-batch    ``dspark serve --config`` a generated YAML: the model with ``max_batch_size`` = the
                  largest of ``--preferred`` and ``dynamic_batching: {preferred_batch_size: --preferred,
                  max_queue_delay_microseconds: --max-queue-delay-us}`` (Triton's semantics), one instance.
                  Request: ``POST /v2/models/NAME/infer`` with the binary tensor data extension (a JSON
                  header naming the input with ``binary_data_size``, then the image's raw float32 bytes;
                  the output asked for as binary data).
  dspark-nobatch  the same server and request, the model without ``dynamic_batching``: every request
                  runs on its own (Triton's default).
  ort-fastapi     benchmarks/peers/ort_fastapi_app.py under uvicorn (one worker, access log off): one
                  ``onnxruntime.InferenceSession`` with default options, a plain ``def`` endpoint in
                  FastAPI's thread pool, raw float32 bytes in and out (no JSON on its path at all), each
                  request its own ``session.run`` at batch 1: what users write by hand.

Both servers and wrk share the machine's cores (nothing is pinned); the server's own threads are left at
their defaults (ONNX Runtime: one intra-op thread per physical core). wrk (``--wrk-threads``, at most the
connection count) uses CPU too, the same on every row. Each run: start the server, poll its readiness
route (``/v2/health/ready``, the peer's ``/health``), check one response's logits against ONNX Runtime in
this process, warm up with ``--warmup`` seconds of wrk at the largest client count, then ``wrk -tT -cC
-dDs --latency --timeout 60s`` at each client count C (closed loop: each connection sends its next request
when the previous answer arrived). Before each measurement the script waits until the server is idle
(the requests wrk left in flight are still served after it stops, and must not run into the next level).

Reported per (model, clients, server): the median over the rounds of wrk's requests/s (= images/s, one
image a request) and its p50 / p99 latency (from the Lua ``done()`` hook, benchmarks/wrk/post_body.lua,
which also writes p75/p90/p95/p99.9 to the JSON; wrk's own --latency table is kept beside them), the
throughput ratio to the peer at the same client count (> 1: dspark serves more images per second), and
for dspark the mean batch it ran (images / model executions over the run, from Triton's
``nv_inference_count`` and ``nv_inference_exec_count`` on its metrics port; the peer always runs 1). At one
client nothing can be batched: that row is the per-request overhead of each stack. A run with a non-2xx
answer or a socket error is reported and makes the script exit 1.

Time: a dspark start loads, places and warms the model (its calibration and plan are cached under
~/.cache/dspark); the first start of a model took about 220 s for resnet50 on a loaded 2-vCPU box, later
ones about 45 s. The full default run (2 models x 3 servers x 3 rounds, 3 client counts of 20 s) takes
about 35-45 minutes on 2 vCPUs, a few more the first time.

Results: every run is appended to benchmarks/out/serve_oip/runs.json as it finishes, keyed by model,
server, clients, round and the settings (duration, wrk threads, preferred sizes, queue delay); a run
already there is skipped, so an interrupted benchmark resumes where it stopped (``--fresh`` starts over).
The summary (the rows of the table with all percentiles, and the settings) is written to
benchmarks/out/serve_oip/serve_oip.json; ``--json`` prints it to stdout instead of the table (progress then
goes to stderr), ``--json PATH`` writes a copy to PATH; ``--report`` prints the table from runs.json
without running anything. Server logs and the generated configs: benchmarks/out/serve_oip/{logs,configs}/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out" / "serve_oip"
MODEL_DIR = OUT / "models"
RUNS = OUT / "runs.json"
LUA = HERE / "wrk" / "post_body.lua"
PEER_APP = HERE / "peers"
SERVERS = ("dspark-batch", "dspark-nobatch", "ort-fastapi")
PEER = "ort-fastapi"
INPUT, OUTPUT, SHAPE = "input", "logits", (1, 3, 224, 224)


def say(line: str) -> None:
    """Progress: to stdout, or to stderr when stdout carries the JSON summary (--json)."""
    print(line, file=sys.stderr if _JSON_TO_STDOUT else sys.stdout, flush=True)


_JSON_TO_STDOUT = False


# -- models ----------------------------------------------------------------------------------------------
def model_file(name: str) -> Path:
    """benchmarks/models.py's SERVING_MODELS[name] as ONNX (dynamic batch, opset 17), exported once and
    checked against torch at batch 1 and 4 under ONNX Runtime."""
    path = MODEL_DIR / f"{name}.onnx"
    if path.exists():
        return path
    import warnings

    import numpy as np
    import onnxruntime as ort
    import torch

    sys.path.insert(0, str(HERE))
    from models import SERVING_MODELS

    module, (x,) = SERVING_MODELS[name]()
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.onnx")
    say(f"exporting {name} to {path}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(tmp), dynamo=False, opset_version=17, input_names=[INPUT],
                          output_names=[OUTPUT], dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}})
    sess = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
    for b in (1, 4):
        xb = torch.randn(b, *SHAPE[1:], generator=torch.Generator().manual_seed(b))
        with torch.no_grad():
            ref = module(xb).numpy()
        got = sess.run([OUTPUT], {INPUT: xb.numpy()})[0]
        if got.shape != ref.shape or not np.allclose(got, ref, rtol=1e-3, atol=1e-4):
            raise SystemExit(f"{name}: ONNX Runtime disagrees with torch at batch {b}: "
                             f"max |diff| {np.abs(got - ref).max():.3g}")
    tmp.rename(path)
    return path


def image_and_reference(name: str, path: Path) -> tuple[bytes, Any]:
    """The fixed request image (seeded) as float32 bytes, and ONNX Runtime's logits for it."""
    import numpy as np
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal(SHAPE, dtype=np.float32)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run([OUTPUT], {INPUT: x})[0]
    return x.astype("<f4").tobytes(), ref


def oip_body(image: bytes) -> tuple[bytes, dict[str, str]]:
    """An Open Inference Protocol infer request with the binary tensor data extension."""
    header = json.dumps({"inputs": [{"name": INPUT, "shape": list(SHAPE), "datatype": "FP32",
                                     "parameters": {"binary_data_size": len(image)}}],
                         "outputs": [{"name": OUTPUT, "parameters": {"binary_data": True}}]},
                        separators=(",", ":")).encode()
    return header + image, {"Inference-Header-Content-Length": str(len(header))}


def decode_oip(body: bytes, headers: Any) -> Any:
    """The first output of an OIP infer response, binary tensor data or JSON."""
    import numpy as np

    n = headers.get("Inference-Header-Content-Length")
    head = json.loads(body[: int(n)] if n is not None else body)
    out = head["outputs"][0]
    shape = [int(d) for d in out["shape"]]
    size = (out.get("parameters") or {}).get("binary_data_size")
    if n is not None and size is not None:
        return np.frombuffer(body[int(n): int(n) + int(size)], dtype="<f4").reshape(shape)
    return np.asarray(out["data"], dtype=np.float32).reshape(shape)


# -- servers ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dspark_config(model: str, path: Path, batching: bool, args: argparse.Namespace, port: int,
                  metrics_port: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": model, "path": str(path), "max_batch_size": max(args.preferred),
                             "instance_count": 1}
    if batching:
        entry["dynamic_batching"] = {"preferred_batch_size": args.preferred,
                                     "max_queue_delay_microseconds": args.max_queue_delay_us}
    return {"server": {"host": "127.0.0.1", "port": port, "grpc_port": free_port(), "metrics_port": metrics_port},
            "models": [entry]}


class Server:
    """One contender's process: started, polled until ready, stopped (SIGTERM, then SIGKILL)."""

    def __init__(self, kind: str, model: str, path: Path, args: argparse.Namespace, tag: str) -> None:
        self.kind, self.model = kind, model
        self.port = free_port()
        self.metrics_port: int | None = None
        (OUT / "logs").mkdir(parents=True, exist_ok=True)
        self.log = OUT / "logs" / f"{tag}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if kind == PEER:
            cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(PEER_APP), "ort_fastapi_app:app",
                   "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1", "--no-access-log",
                   "--log-level", "warning"]
            env["ORT_PEER_MODEL"] = str(path)
            self.health, self.url = "/health", f"http://127.0.0.1:{self.port}/infer"
        else:
            cfg = OUT / "configs" / f"{tag}.yaml"
            cfg.parent.mkdir(parents=True, exist_ok=True)
            self.metrics_port = free_port()
            cfg.write_text(json.dumps(dspark_config(model, path, kind == "dspark-batch", args, self.port,
                                                    self.metrics_port), indent=1))  # YAML is a superset of JSON
            exe = Path(sys.executable).parent / "dspark"
            cmd = [str(exe) if exe.exists() else shutil.which("dspark") or "dspark", "serve", "--config", str(cfg),
                   "--log-level", "WARNING"]
            self.health, self.url = "/v2/health/ready", f"http://127.0.0.1:{self.port}/v2/models/{model}/infer"
        self.cmd = cmd
        self.t0 = time.perf_counter()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.ready_s: float | None = None

    def wait_ready(self, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode} before it was ready; "
                                   f"log {self.log}:\n{self.log.read_text(errors='replace')[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{self.health}", timeout=2) as r:
                    if r.status == 200:
                        self.ready_s = time.perf_counter() - self.t0
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.kind} not ready within {deadline_s:.0f} s; log {self.log}")

    def rss_mb(self) -> dict[str, float] | None:
        """The process tree's current RSS and the sum of its processes' peaks (VmHWM), in MB."""
        try:
            import psutil

            procs = [psutil.Process(self.proc.pid)]
            procs += procs[0].children(recursive=True)
            rss = hwm = 0.0
            for p in procs:
                for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) / 1024
                    elif line.startswith("VmHWM:"):
                        hwm += int(line.split()[1]) / 1024
            return {"rss_mb": round(rss, 1), "peak_rss_mb": round(hwm, 1)}
        except Exception:  # noqa: BLE001 - a figure beside the result, never a reason to fail
            return None

    def counters(self) -> dict[str, float] | None:
        """dspark's Triton counters for the model (nv_inference_count, nv_inference_exec_count, ...) from its
        metrics port; None for the peer or when they cannot be read."""
        if self.metrics_port is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        out = {}
        for name, labels, value in re.findall(r"^(nv_inference_\w+)\{([^}]*)\}\s+(\S+)$", text, re.M):
            if f'model="{self.model}"' in labels:
                out[name] = out.get(name, 0.0) + float(value)
        return out or None

    def wait_idle(self, limit_s: float = 180) -> float:
        """Wait until the server's processes use under a tenth of a core over half a second, twice running:
        when wrk stops, the requests it had in flight are still being served (up to the client count of
        them), and they must not run into the next measurement. Returns the seconds waited."""
        import psutil

        t0 = time.monotonic()
        quiet = 0
        prev = None
        while time.monotonic() - t0 < limit_s and quiet < 2:
            try:
                procs = [psutil.Process(self.proc.pid)]
                procs += procs[0].children(recursive=True)
                cpu = sum(sum(p.cpu_times()[:2]) for p in procs)
            except psutil.Error:
                return time.monotonic() - t0
            if prev is not None:
                quiet = quiet + 1 if cpu - prev < 0.05 else 0
            prev = cpu
            time.sleep(0.5)
        return time.monotonic() - t0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def request_of(kind: str, image: bytes) -> tuple[bytes, str, dict[str, str]]:
    """(body, content type, extra headers) of the one request a contender is sent, over and over."""
    if kind == PEER:
        return image, "application/octet-stream", {}
    body, headers = oip_body(image)
    return body, "application/octet-stream", headers


def check_answer(server: Server, body: bytes, ctype: str, headers: dict[str, str], ref: Any) -> float:
    """Send the request once; the max |difference| of the logits from ONNX Runtime's (raises if wrong)."""
    import numpy as np

    req = urllib.request.Request(server.url, data=body, method="POST", headers={"Content-Type": ctype, **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw, rh = r.read(), r.headers
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{server.kind}: HTTP {e.code} {e.read()[:500]!r}") from None
    got = np.frombuffer(raw, dtype="<f4").reshape(ref.shape) if server.kind == PEER else decode_oip(raw, rh)
    if got.shape != ref.shape:
        raise RuntimeError(f"{server.kind}: logits of shape {got.shape}, expected {ref.shape}")
    diff = float(np.abs(got - ref).max())
    if not diff <= 1e-2 * max(1.0, float(np.abs(ref).max())):
        raise RuntimeError(f"{server.kind}: logits differ from ONNX Runtime's by up to {diff:.3g}")
    return diff


def mean_batch(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Images per model execution over a run, from the server's counters (a batch of n is n inferences,
    one execution); None where the server has no such counters (the peer always runs batch 1)."""
    if not before or not after:
        return None
    execs = after.get("nv_inference_exec_count", 0) - before.get("nv_inference_exec_count", 0)
    infers = after.get("nv_inference_count", 0) - before.get("nv_inference_count", 0)
    return infers / execs if execs > 0 else None


# -- wrk -------------------------------------------------------------------------------------------------
_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4, "h": 3.6e6}


def parse_wrk(text: str) -> dict[str, Any]:
    """wrk's --latency report (requests/s, the latency distribution) and the Lua done() line."""
    out: dict[str, Any] = {}
    m = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    if not m:
        raise RuntimeError(f"no Requests/sec in wrk's output:\n{text[-2000:]}")
    out["req_s"] = float(m.group(1))
    dist = {}
    block = text.split("Latency Distribution", 1)[1] if "Latency Distribution" in text else ""
    for p, v, u in re.findall(r"^\s+([\d.]+)%\s+([\d.]+)(us|ms|s|m|h)\s*$", block, re.M):
        dist[p] = float(v) * _UNIT_MS[u]
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    out["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"^\s+Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text, re.M)
    out["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0
    lua = re.search(r"^wrk-json (\{.*\})\s*$", text, re.M)
    if lua:
        d = json.loads(lua.group(1))
        lat = d["latency_us"]
        out["requests"] = d["requests"]
        out["duration_s"] = d["duration_us"] / 1e6
        out["percentiles_ms"] = {k: v / 1e3 for k, v in lat["percentiles"].items()}
        out["mean_ms"], out["max_ms"] = lat["mean"] / 1e3, lat["max"] / 1e3
        out["lua_errors"] = d["errors"]
    else:  # the table alone: 50/75/90/99
        out["percentiles_ms"] = dist
    out["p50_ms"] = out["percentiles_ms"].get("50", dist.get("50"))
    out["p99_ms"] = out["percentiles_ms"].get("99", dist.get("99"))
    out["wrk_table_ms"] = dist
    return out


def run_wrk(url: str, clients: int, seconds: float, threads: int, body_file: Path, ctype: str,
            headers: dict[str, str]) -> dict[str, Any]:
    t = max(1, min(threads, clients))  # wrk needs at least one connection per thread
    cmd = ["wrk", f"-t{t}", f"-c{clients}", f"-d{max(1, round(seconds))}s", "--latency", "--timeout", "60s",
           "-s", str(LUA), url, "--", str(body_file), ctype]
    for k, v in headers.items():
        cmd += [k, v]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    if p.returncode != 0:
        raise RuntimeError(f"wrk failed ({p.returncode}): {p.stderr[-2000:]}{p.stdout[-2000:]}")
    res = parse_wrk(p.stdout)
    res["wrk_threads"] = t
    return res


# -- results ---------------------------------------------------------------------------------------------
def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    return {"duration_s": args.duration, "wrk_threads": args.wrk_threads, "preferred": args.preferred,
            "max_queue_delay_us": args.max_queue_delay_us}


def run_key(model: str, server: str, clients: int, rnd: int, settings: dict[str, Any]) -> str:
    tag = f"d{settings['duration_s']:g}-t{settings['wrk_threads']}-p{'.'.join(map(str, settings['preferred']))}" \
          f"-q{settings['max_queue_delay_us']}"
    return f"{model}/{server}/c{clients}/r{rnd}/{tag}"


def load_runs(fresh: bool) -> dict[str, Any]:
    if fresh or not RUNS.exists():
        return {}
    return json.loads(RUNS.read_text())


def save_runs(runs: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tmp = RUNS.with_suffix(".tmp")
    tmp.write_text(json.dumps(runs, indent=1))
    tmp.replace(RUNS)


def summarize(runs: dict[str, Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median over the rounds per (model, clients, server), with the ratio of req/s to the peer's."""
    settings = settings_of(args)
    rows = []
    for model in args.models:
        for c in args.clients:
            med: dict[str, dict[str, Any]] = {}
            for server in args.servers:
                rs = [runs[k] for r in range(args.rounds)
                      if (k := run_key(model, server, c, r, settings)) in runs]
                if not rs:
                    continue
                med[server] = {
                    "model": model, "clients": c, "server": server, "rounds": len(rs),
                    "req_s": statistics.median(x["req_s"] for x in rs),
                    "p50_ms": statistics.median(x["p50_ms"] for x in rs),
                    "p99_ms": statistics.median(x["p99_ms"] for x in rs),
                    "percentiles_ms": {p: statistics.median(x["percentiles_ms"][p] for x in rs)
                                       for p in rs[0]["percentiles_ms"] if all(p in x["percentiles_ms"] for x in rs)},
                    "req_s_rounds": [x["req_s"] for x in rs],
                    "errors": sum(x["non_2xx"] + x["socket_errors"] for x in rs),
                    "max_abs_diff": max(x.get("max_abs_diff") or 0.0 for x in rs),
                    "wrk_threads": rs[0]["wrk_threads"],
                    "mean_batch": statistics.median(b) if (b := [x["mean_batch"] for x in rs
                                                                 if x.get("mean_batch") is not None]) else None}
            peer = med.get(PEER, {}).get("req_s")
            for row in med.values():
                row["vs_peer"] = row["req_s"] / peer if peer else None
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | clients | server | req/s | p50 ms | p99 ms | req/s vs peer | mean batch | rounds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "-" if r["vs_peer"] is None else f"{r['vs_peer']:.2f}"
        err = f" ({r['errors']} errors)" if r["errors"] else ""
        batch = "1" if r["server"] == PEER else "-" if r.get("mean_batch") is None else f"{r['mean_batch']:.1f}"
        lines.append(f"| {r['model']} | {r['clients']} | {r['server']} | {r['req_s']:.1f}{err} | {r['p50_ms']:.1f} "
                     f"| {r['p99_ms']:.1f} | {ratio} | {batch} | {r['rounds']} |")
    return "\n".join(lines)


def machine_line(args: argparse.Namespace) -> str:
    import psutil

    wrk = ""
    if shutil.which("wrk"):
        wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("[")[0].strip()
    return (f"machine: {psutil.cpu_count()} logical CPUs ({psutil.cpu_count(logical=False)} physical), load average "
            f"{', '.join(f'{x:.2f}' for x in psutil.getloadavg())}; servers and wrk share them, nothing pinned, "
            f"server threads at their defaults; {wrk or 'wrk'} with -t{args.wrk_threads} (at most one per "
            f"connection), closed loop, --timeout 60s; python {sys.version.split()[0]}")


# -- the run ---------------------------------------------------------------------------------------------
def measure(args: argparse.Namespace) -> list[str]:
    runs = load_runs(args.fresh)
    settings = settings_of(args)
    problems: list[str] = []
    files = {m: model_file(m) for m in args.models}
    inputs = {m: image_and_reference(m, files[m]) for m in args.models}
    OUT.mkdir(parents=True, exist_ok=True)
    n = len(args.servers)
    for rnd in range(args.rounds):
        for mi, model in enumerate(args.models):
            k = (rnd + mi) % n
            for kind in args.servers[k:] + args.servers[:k]:
                todo = [c for c in args.clients if run_key(model, kind, c, rnd, settings) not in runs]
                if not todo:
                    continue
                image, ref = inputs[model]
                body, ctype, headers = request_of(kind, image)
                body_file = OUT / f"body-{model}-{'peer' if kind == PEER else 'oip'}.bin"
                body_file.write_bytes(body)
                server = Server(kind, model, files[model], args, tag=f"{model}-{kind}-r{rnd}")
                try:  # a contender that fails is reported and the others still run (the script exits 1)
                    server.wait_ready(args.ready_timeout)
                    diff = check_answer(server, body, ctype, headers, ref)
                    run_wrk(server.url, max(args.clients), args.warmup, args.wrk_threads, body_file, ctype, headers)
                    for c in todo:
                        drained = server.wait_idle()
                        before = server.counters()
                        res = run_wrk(server.url, c, args.duration, args.wrk_threads, body_file, ctype, headers)
                        res["mean_batch"] = mean_batch(before, server.counters())
                        res.update(model=model, server=kind, clients=c, round=rnd, settings=settings,
                                   max_abs_diff=diff, ready_s=server.ready_s, memory=server.rss_mb(),
                                   drained_s=round(drained, 1),
                                   loadavg=os.getloadavg()[0], time=time.strftime("%Y-%m-%dT%H:%M:%S"))
                        if res["non_2xx"] or res["socket_errors"]:
                            problems.append(f"{model}/{kind}/c{c}/round {rnd + 1}: {res['non_2xx']} non-2xx, "
                                            f"{res['socket_errors']} socket errors")
                        runs[run_key(model, kind, c, rnd, settings)] = res
                        save_runs(runs)
                        say(f"round {rnd + 1} {model} {kind} clients {c}: {res['req_s']:.1f} req/s, p50 "
                              f"{res['p50_ms']:.1f} ms, p99 {res['p99_ms']:.1f} ms"
                              + (f", {res['non_2xx'] + res['socket_errors']} errors"
                                 if res['non_2xx'] or res['socket_errors'] else ""))
                except (RuntimeError, TimeoutError, OSError, subprocess.SubprocessError) as e:
                    problems.append(f"{model}/{kind}/round {rnd + 1}: {str(e)[:3000]}")
                    say(f"round {rnd + 1} {model} {kind} FAILED: {str(e)[:3000]}")
                finally:
                    server.stop()
    return problems


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x]

    def names(s: str) -> list[str]:
        return [x for x in s.split(",") if x]

    ap.add_argument("--models", type=names, default=["resnet50", "vit"], help="of: resnet50, vit")
    ap.add_argument("--clients", type=ints, default=[1, 8, 32], help="wrk connections (concurrent clients)")
    ap.add_argument("--duration", type=float, default=20, help="seconds of wrk per client count")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; a row is the median over them")
    ap.add_argument("--preferred", type=ints, default=[8, 16, 32],
                    help="dspark-batch's preferred_batch_size (max_batch_size is the largest)")
    ap.add_argument("--max-queue-delay-us", type=int, default=2000,
                    help="dspark-batch's max_queue_delay_microseconds")
    ap.add_argument("--servers", type=names, default=list(SERVERS), help=f"of: {', '.join(SERVERS)}")
    ap.add_argument("--wrk-threads", type=int, default=2, help="wrk -t (at most the connection count)")
    ap.add_argument("--warmup", type=float, default=5, help="seconds of wrk at the largest client count first")
    ap.add_argument("--ready-timeout", type=float, default=600, help="seconds a server may take to be ready")
    ap.add_argument("--fresh", action="store_true", help="forget the runs in runs.json and measure all")
    ap.add_argument("--report", action="store_true", help="only print the table from runs.json")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="print the summary as JSON instead of the table; --json PATH: write a copy there")
    args = ap.parse_args()
    if bad := [m for m in args.models if m not in ("resnet50", "vit")]:
        ap.error(f"unknown models {bad}; have resnet50, vit")
    if bad := [s for s in args.servers if s not in SERVERS]:
        ap.error(f"unknown servers {bad}; have {', '.join(SERVERS)}")
    if shutil.which("wrk") is None and not args.report:
        raise SystemExit("wrk is not installed (apt-get install -y wrk)")

    global _JSON_TO_STDOUT
    _JSON_TO_STDOUT = args.json == "-"
    t0 = time.perf_counter()
    problems: list[str] = []
    machine = machine_line(args)
    if not args.report:
        say(machine)
        problems = measure(args)
    rows = summarize(load_runs(False), args)
    summary = {"machine": machine, "settings": settings_of(args), "models": args.models, "clients": args.clients,
               "servers": args.servers, "rounds": args.rounds, "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "serve_oip.json").write_text(json.dumps(summary, indent=1))
    if args.json and args.json != "-":
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if args.json == "-":
        print(json.dumps(summary, indent=1))
    else:
        import psutil

        print(f"\nServed images/s under wrk (closed loop, {args.duration:g} s per client count, median of "
              f"{args.rounds} round(s)); each server and wrk (-t{args.wrk_threads}, at most one per connection) "
              f"on the same {psutil.cpu_count()} CPUs; dspark-batch: preferred_batch_size {args.preferred}, "
              f"max_queue_delay_microseconds {args.max_queue_delay_us}; req/s vs peer: / {PEER} at the same "
              f"clients\n")
        print(table(rows))
        print(f"\nwrote {RUNS} and {OUT / 'serve_oip.json'}"
              + ("" if args.report else f"; total {time.perf_counter() - t0:.0f} s"))
    if problems:
        print("\nFAILED checks:\n  " + "\n  ".join(problems), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
