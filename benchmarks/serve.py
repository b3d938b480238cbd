"""Serving benchmark (issue 5): ``dspark serve`` under load vs the same requests one at a time, and the max_batch_size sweep.

Usage: .venv/bin/python benchmarks/serve.py [--quick] [--rounds 1] [--threads 1] [--out benchmarks/out]

Full: 128 requests, ~6-7 min on 2 vCPUs (most of it the one-at-a-time level and
max_batch_size=1); --quick: 48 shorter requests, sweep 1,8,64, ~2 min.

In one run, on the embedded model:

(a) One server (``python -m dspark.server``, max_batch_size 64, KV for 64 of
    the longest requests so nothing is preempted). The same request set
    (deterministic slices of the held-out stdlib files, mixed prompt and
    output lengths, greedy, ``ignore_eos`` so each request yields exactly its
    max_tokens) is sent by ``dspark bench serve``'s load generator in a closed
    loop at concurrency 1, 8, 32 and 64. Concurrency 1 is the "one at a time"
    baseline: each request is sent when the previous one has finished, so the
    server never batches. Reported: output tokens/s, requests/s, TTFT P50/P99,
    e2e P50/P99, and each level's ratio to the one-at-a-time run. With
    ``--rounds R`` the levels run R times in turn and each level pools its rounds.
(b) The tuning sweep: a fresh server per max_batch_size (1, 4, 16, 64), the
    same requests at concurrency 64; CSV and the throughput-vs-P99 plot go to
    ``--out`` (the plot is also copied to ``--plot``).

Every request must complete with finish_reason "length" and exactly its
max_tokens; the script exits 1 otherwise. All summaries go to ``--out``/serve.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from dspark.server.loadgen.bench import LoadConfig, default_workload, run
from dspark.server.loadgen.stats import RequestResult, Summary, summarize
from dspark.server.loadgen.sweep import ServerProcess, free_port, server_command, sweep

ROOT = Path(__file__).resolve().parent.parent


def check(name: str, s: Summary) -> list[str]:
    bad = []
    if s.failed or s.completed != s.num_requests:
        bad.append(f"{name}: {s.completed}/{s.num_requests} completed, errors {s.errors} {s.error_samples}")
    if s.length_mismatches or set(s.finish_reasons) - {"length"}:
        bad.append(f"{name}: finish reasons {s.finish_reasons}, {s.length_mismatches} with the wrong token count")
    return bad


def fmt(x: float | None, nd: int = 0) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def _sweep(args: argparse.Namespace, sweep_values: list[str], base: LoadConfig, max_batch: int,
           reqs: list[Any], cfg_file: Path, problems: list[str]) -> list[Any]:
    """(b) max_batch_size sweep: a fresh server per value, the same requests at the top concurrency."""
    print(f"\n(b) max_batch_size sweep at concurrency {max_batch}, a fresh server per value\n", flush=True)
    rows = sweep("max_batch_size", sweep_values, replace(base, concurrency=max_batch), reqs, args.out,
                 config=cfg_file, progress=sys.stderr.isatty())
    print("| max_batch_size | output tok/s | req/s | TTFT P50 ms | TTFT P99 ms | e2e P50 ms | e2e P99 ms | TPOT P99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r.summary
        problems += check(f"max_batch_size {r.value}", s)
        print(f"| {r.value} | {s.output_token_throughput:.1f} | {s.request_throughput:.2f} | {fmt(s.ttft_ms.p50)} "
              f"| {fmt(s.ttft_ms.p99)} | {fmt(s.e2e_ms.p50)} | {fmt(s.e2e_ms.p99)} | {fmt(s.tpot_ms.p99, 1)} |")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.out / "sweep.png", args.plot)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter requests; sweep 1,8,64 (~2 min)")
    ap.add_argument("--requests", type=int, default=None, help="request set size (default 128, quick 48)")
    ap.add_argument("--levels", default="1,8,32,64", help="client concurrency levels (1 = one at a time)")
    ap.add_argument("--sweep", default=None, help="max_batch_size values (default 1,4,16,64; quick 1,8,64; "
                    "'none' skips the sweep)")
    ap.add_argument("--decoder", default=None, help="the server's engine.decoder: auto (its default), torch, "
                    "or PLUGIN[@DEVICE] (docs/decoders.md)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the levels this many times on the same server, in turn (load drift hits all "
                         "levels alike); a level's figures pool its rounds")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in the server (the client needs the other core on a 2-vCPU box)")
    ap.add_argument("--dtype", default="float32", help="server model dtype (fp32: no native bf16 matmul here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "img" / "serve_sweep.png"),
                    help="where to copy the sweep plot ('' = do not copy)")
    args = ap.parse_args()

    n = args.requests or (48 if args.quick else 128)
    plen, olen = ((16, 128), (8, 64)) if args.quick else ((32, 256), (16, 128))
    levels = [int(x) for x in args.levels.split(",")]
    sweep_values = [] if args.sweep == "none" else (args.sweep or ("1,8,64" if args.quick else "1,4,16,64")).split(",")
    max_batch = max(levels)
    args.out.mkdir(parents=True, exist_ok=True)
    reqs = default_workload(n, seed=args.seed, prompt_tokens=plen, max_tokens=olen)
    # KV for max_batch of the longest requests (+ BOS and a page of slack): no preemption at any level.
    kv_tokens = max([max_batch, *(int(v) for v in sweep_values)]) * (plen[1] + olen[1] + 32)
    decoder = f", decoder: {args.decoder}" if args.decoder else ""
    cfg_file = args.out / "server.yaml"
    cfg_file.write_text(f"model: {{dtype: {args.dtype}}}\n"
                        f"engine: {{max_total_tokens: {kv_tokens}{decoder}}}\n"
                        f"resources: {{cpu_cores_per_worker: {args.threads}}}\n")
    out_tokens = sum(r.max_tokens for r in reqs)
    print(f"machine: {psutil.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in psutil.getloadavg())}; "
          f"python {sys.version.split()[0]}")
    print(f"workload: {n} requests (held-out stdlib slices, seed {args.seed}), prompt {plen[0]}-{plen[1]} tokens, "
          f"max_tokens {olen[0]}-{olen[1]} ({out_tokens:,} output tokens), greedy, ignore_eos; "
          f"server dtype {args.dtype}, {args.threads} torch thread(s), max_total_tokens {kv_tokens}")
    base = LoadConfig(url="", concurrency=1, seed=args.seed, extra_body={"ignore_eos": True})
    problems: list[str] = []
    t_start = time.perf_counter()

    # (a) one server, the same request set at each concurrency level.
    port, mport = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(port=port, metrics_port=mport, config=cfg_file,
                         overrides=[("max_batch_size", str(max_batch))])
    pooled: dict[int, tuple[list[RequestResult], float]] = {c: ([], 0.0) for c in levels}
    with ServerProcess(cmd, url=url, log=args.out / "server-levels.log"):
        run(replace(base, url=url, concurrency=8), reqs[:8])  # warm-up, not measured
        for rnd in range(args.rounds):
            for c in levels:
                res = run(replace(base, url=url, concurrency=c), reqs, progress=sys.stderr.isatty(),
                          description=f"concurrency {c}")
                s = res.summary()
                problems += check(f"concurrency {c} round {rnd + 1}", s)
                pooled[c] = (pooled[c][0] + res.results, pooled[c][1] + res.duration_s)
                print(f"  round {rnd + 1}, concurrency {c}: {s.output_token_throughput:.1f} tok/s, TTFT P50 "
                      f"{fmt(s.ttft_ms.p50)} ms P99 {fmt(s.ttft_ms.p99)} ms, {s.duration_s:.1f} s", flush=True)
    by_level = {c: summarize(rs, dur) for c, (rs, dur) in pooled.items()}

    one = by_level.get(1)
    print(f"\n(a) dspark serve (max_batch_size {max_batch}) at each client concurrency vs the same {n} requests "
          f"one at a time (concurrency 1: each sent after the previous finished); {args.rounds} round(s) pooled\n")
    print("| concurrency | output tok/s | req/s | TTFT P50 ms | TTFT P99 ms | e2e P50 ms | e2e P99 ms "
          "| tok/s vs one at a time | TTFT P50 vs one at a time | TTFT P99 vs one at a time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c, s in by_level.items():
        print(f"| {c}{' (one at a time)' if c == 1 else ''} | {s.output_token_throughput:.1f} "
              f"| {s.request_throughput:.2f} | {fmt(s.ttft_ms.p50)} | {fmt(s.ttft_ms.p99)} | {fmt(s.e2e_ms.p50)} "
              f"| {fmt(s.e2e_ms.p99)} | {ratio(s.output_token_throughput, one.output_token_throughput if one else None)} "
              f"| {ratio(s.ttft_ms.p50, one.ttft_ms.p50 if one else None)} "
              f"| {ratio(s.ttft_ms.p99, one.ttft_ms.p99 if one else None)} |")

    # (b) max_batch_size sweep: a fresh server per value, the same requests at the top concurrency.
    rows = []
    if sweep_values:
        rows = _sweep(args, sweep_values, base, max_batch, reqs, cfg_file, problems)
    else:
        print("\n(b) sweep skipped (--sweep none)")
    (args.out / "serve.json").write_text(json.dumps({
        "requests": n, "rounds": args.rounds, "prompt_tokens": plen, "max_tokens": olen, "dtype": args.dtype,
        "threads": args.threads, "decoder": args.decoder or "auto",
        "levels": {str(c): s.to_json_dict() for c, s in by_level.items()},
        "sweep": {r.value: r.summary.to_json_dict() for r in rows}}, indent=2))
    print(f"\nwrote {args.out / 'serve.json'}{', the sweep CSV and plot' if rows else ''}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    if problems:
        print("\nFAILED checks:\n  " + "\n  ".join(problems))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
