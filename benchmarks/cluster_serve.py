"""Cluster serving benchmark (issue 23): two engine replicas of one thread each against one replica of two threads.

Usage: .venv/bin/python benchmarks/cluster_serve.py [--quick] [--rounds 2] [--levels 16,64] [--out benchmarks/out]

Full: 128 requests per level, 2 rounds, ~12 min on 2 vCPUs; --quick: 48 shorter requests, 1 round, ~4 min.

In one run, on the embedded model, with the same request set as benchmarks/serve.py
(held-out stdlib slices, greedy, ``ignore_eos``; every request must end with
exactly its max_tokens), against a Ray cluster of one node on this machine
(``ray start --head``, 2 CPUs) joined by ``dspark serve --ray-address``:

(a) Throughput at each client concurrency (closed loop), three contenders,
    each its own server processes, started afresh per round and alternated
    (round 1 in the order below, round 2 reversed):
    * ``2x1``: ``--replicas 2``, each replica reserving 1 CPU with 1 torch thread;
    * ``1x2``: ``--replicas 1``, the replica reserving 2 CPUs with 2 torch threads;
    * ``single``: the single-process server (no Ray), 2 torch threads -- what the
      cluster's ingress hop costs.
    Reported per contender and level: output tok/s, TTFT P50/P99, e2e P50,
    the median over rounds, and the ratio 2x1 / 1x2.
(b) The ingress's own capacity (with ``2x1`` up, and the single server for
    comparison): ``GET /health`` at 64 concurrent clients (proxy + ingress, no
    engine) and a 1-token completion at 64 clients (the whole path), requests/s.
(c) Autoscaling on queue depth: ``cluster.autoscaling`` 1..2 replicas, target 8
    sequences per replica, upscale delay 0 s, downscale 10 s; 64 clients for
    40 s: when the second replica registered, and when the idle app went back to one.

Writes ``--out``/cluster_serve.json; exits 1 when a request fails or ends with the wrong length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml

from dspark.server.cluster.local import LocalCluster
from dspark.server.loadgen.bench import BenchRequest, LoadConfig, default_workload, run
from dspark.server.loadgen.stats import Summary
from dspark.server.loadgen.sweep import ServerProcess, free_port
from serve import check  # benchmarks/serve.py: every request completed with exactly its max_tokens

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = ("2x1", "1x2", "single")


def server_config(out: Path, name: str, kv_tokens: int, max_batch: int) -> Path:
    replicas, cpus, threads = {"2x1": (2, 1, 1), "1x2": (1, 2, 2), "single": (None, None, 2)}[name]
    cfg: dict[str, Any] = {"model": {"dtype": "float32"}, "server": {"host": "127.0.0.1"},
                           "engine": {"max_total_tokens": kv_tokens,
                                      "continuous_batching": {"max_batch_size": max_batch}},
                           "resources": {"cpu_cores_per_worker": threads},
                           "observability": {"access_log": False}}
    if replicas is not None:
        cfg["cluster"] = {"replicas": replicas, "resources_per_replica": {"num_cpus": cpus},
                          "max_ongoing_requests": max_batch}
    path = out / f"cluster-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start(name: str, cfg: Path, cluster: LocalCluster, out: Path) -> tuple[ServerProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dspark.server", "--config", str(cfg), "--port", str(port),
           "--metrics-port", str(free_port())]
    env = None
    if name != "single":
        cmd += ["--ray-address", cluster.address]
        env = cluster.env
    srv = ServerProcess(cmd, url=url, log=out / f"cluster-{name}.log", startup_timeout_s=300, env=env).start()
    want = {"2x1": 2, "1x2": 1}.get(name)
    deadline = time.monotonic() + 120
    while want is not None and len(httpx.get(f"{url}/cluster/replicas", timeout=10).json()["replicas"]) < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}: {want} replicas never registered")
        time.sleep(0.5)
    return srv, url


def health_rps(url: str, n: int = 3000, concurrency: int = 64) -> float:
    async def go() -> float:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as client:
            left = iter(range(n))

            async def worker() -> None:
                for _ in left:
                    r = await client.get("/health")
                    r.raise_for_status()

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return n / (time.perf_counter() - t0)

    return asyncio.run(go())


def tiny_rps(base: LoadConfig, url: str, n: int = 600) -> tuple[float, list[str]]:
    reqs = [BenchRequest("def f(x):", 1)] * n
    s = run(replace(base, url=url, concurrency=64), reqs).summary()
    return s.request_throughput, check("1-token completions", s)


def autoscale(cluster: LocalCluster, out: Path, reqs: list[BenchRequest], base: LoadConfig, kv: int) -> dict[str, Any]:
    cfg = out / "cluster-autoscale.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"dtype": "float32"}, "resources": {"cpu_cores_per_worker": 1},
        "engine": {"max_total_tokens": kv, "continuous_batching": {"max_batch_size": 64}},
        "observability": {"access_log": False},
        "cluster": {"autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8,
                                    "upscale_delay_s": 0, "downscale_delay_s": 10},
                    "resources_per_replica": {"num_cpus": 1}}}))
    srv, url = start("autoscale", cfg, cluster, out)
    counts: list[tuple[float, int]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                n = len(httpx.get(f"{url}/cluster/replicas", timeout=5).json()["replicas"])
                counts.append((time.perf_counter(), n))
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    try:
        t = threading.Thread(target=poll, daemon=True)
        t.start()
        t_load = time.perf_counter()
        looped = (reqs * 8)[:400]
        res = run(replace(base, url=url, concurrency=64, timeout_s=120), looped)
        t_idle = time.perf_counter()
        # Back to one replica: the downscale delay (10 s), the replica's graceful shutdown and the registry's
        # staleness; waited for, up to two minutes, not slept through.
        while time.perf_counter() - t_idle < 120 and not any(ts >= t_idle and n == 1 for ts, n in list(counts)):
            time.sleep(0.5)
        stop.set()
        t.join(5)
    finally:
        srv.stop()
    t_up = next((ts for ts, n in counts if n >= 2 and ts >= t_load), None)
    up = None if t_up is None else t_up - t_load
    down = None if t_up is None else next((ts - t_idle for ts, n in counts if ts >= max(t_idle, t_up) and n == 1),
                                          None)
    s = res.summary()
    return {"requests": len(looped), "load_s": round(t_idle - t_load, 1), "second_replica_after_s": up,
            "back_to_one_after_idle_s": down, "output_tok_s": s.output_token_throughput,
            "failed": s.failed, "max_replicas_seen": max((n for _, n in counts), default=0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--levels", default="16,64")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-autoscale", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    args = ap.parse_args()
    n = args.requests or (48 if args.quick else 128)
    rounds = args.rounds or (1 if args.quick else 2)
    plen, olen = ((16, 128), (8, 64)) if args.quick else ((32, 256), (16, 128))
    levels = [int(x) for x in args.levels.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    reqs = default_workload(n, seed=args.seed, prompt_tokens=plen, max_tokens=olen)
    max_batch = max(levels)
    kv = max_batch * (plen[1] + olen[1] + 32)
    print(f"machine: {psutil.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in psutil.getloadavg())}")
    print(f"workload: {n} requests, prompt {plen[0]}-{plen[1]} tokens, max_tokens {olen[0]}-{olen[1]} "
          f"({sum(r.max_tokens for r in reqs):,} output tokens), greedy, ignore_eos; levels {levels}; {rounds} round(s)")
    base = LoadConfig(url="", concurrency=1, seed=args.seed, extra_body={"ignore_eos": True})
    problems: list[str] = []
    results: dict[str, dict[int, list[Summary]]] = {c: {lv: [] for lv in levels} for c in CONTENDERS}
    ingress: dict[str, dict[str, float]] = {}
    cluster = LocalCluster(args.out / "ray", port=free_port())
    cluster.start(num_cpus=2)
    try:
        for rnd in range(rounds):
            order = CONTENDERS if rnd % 2 == 0 else tuple(reversed(CONTENDERS))
            for name in order:
                srv, url = start(name, server_config(args.out, name, kv, max_batch), cluster, args.out)
                try:
                    run(replace(base, url=url, concurrency=8), reqs[:8])  # warm-up
                    for lv in levels:
                        s = run(replace(base, url=url, concurrency=lv), reqs).summary()
                        problems += check(f"{name} concurrency {lv} round {rnd + 1}", s)
                        results[name][lv].append(s)
                        print(f"  round {rnd + 1} {name:>6} c={lv}: {s.output_token_throughput:7.1f} tok/s, TTFT P50 "
                              f"{s.ttft_ms.p50 or 0:6.0f} ms, e2e P50 {s.e2e_ms.p50 or 0:6.0f} ms", flush=True)
                    if rnd == 0 and name in ("2x1", "single"):
                        rps, bad = tiny_rps(base, url)
                        problems += bad
                        ingress[name] = {"health_rps": health_rps(url), "one_token_completion_rps": rps}
                        print(f"  {name}: /health {ingress[name]['health_rps']:.0f} req/s, 1-token completions "
                              f"{rps:.1f} req/s", flush=True)
                finally:
                    srv.stop()
        scaling = None if args.no_autoscale else autoscale(cluster, args.out, reqs, base, kv)
    finally:
        cluster.stop()

    def med(name: str, lv: int, key: str) -> float:
        vals = [getattr(s, key) if key == "output_token_throughput" else getattr(s, key).p50 or 0.0
                for s in results[name][lv]]
        return float(statistics.median(vals))

    print(f"\n(a) median of {rounds} round(s); output tok/s, TTFT P50 ms, e2e P50 ms\n")
    print("| clients | 2 replicas x 1 thread | 1 replica x 2 threads | single process, 2 threads | 2x1 / 1x2 "
          "| 2x1 / single |")
    print("|---|---|---|---|---|---|")
    table = {}
    for lv in levels:
        tok = {c: med(c, lv, "output_token_throughput") for c in CONTENDERS}
        ttft = {c: med(c, lv, "ttft_ms") for c in CONTENDERS}
        e2e = {c: med(c, lv, "e2e_ms") for c in CONTENDERS}
        table[lv] = {"tok_s": tok, "ttft_p50_ms": ttft, "e2e_p50_ms": e2e,
                     "ttft_p99_ms": {c: statistics.median(s.ttft_ms.p99 or 0 for s in results[c][lv])
                                     for c in CONTENDERS}}
        cell = {c: f"{tok[c]:.1f} tok/s, TTFT {ttft[c]:.0f} ms, e2e {e2e[c]:.0f} ms" for c in CONTENDERS}
        print(f"| {lv} | {cell['2x1']} | {cell['1x2']} | {cell['single']} | {tok['2x1'] / tok['1x2']:.2f} "
              f"| {tok['2x1'] / tok['single']:.2f} |")
    print("\n(b) ingress capacity at 64 clients, requests/s\n")
    print("| server | GET /health | 1-token completion |")
    print("|---|---|---|")
    for name, d in ingress.items():
        print(f"| {name} | {d['health_rps']:.0f} | {d['one_token_completion_rps']:.1f} |")
    if scaling is not None:
        print(f"\n(c) autoscaling 1..2 replicas at 64 clients: {json.dumps(scaling)}")
    (args.out / "cluster_serve.json").write_text(json.dumps({
        "requests": n, "rounds": rounds, "levels": levels, "table": table, "ingress": ingress,
        "autoscaling": scaling}, indent=2))
    if problems:
        print("\nFAILED checks:\n  " + "\n  ".join(problems))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
