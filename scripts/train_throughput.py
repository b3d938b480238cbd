#!/usr/bin/env python3
"""Training throughput of the embedded model, per configuration, in tokens/s.

Each configuration runs in its own process (a compiled model or a different
thread pool must not leak into the next one), on random tokens, for a few
warm-up steps and then ``--steps`` timed ones; the figure is the median step.
The first row is what ``train_default_model.py`` did before issue 19 (fp32,
4 x 512 windows, early exit scored on every position); the last rows are what
it does now (bf16 autocast, 8 x 256 windows then 4 x 512, exit every 4th
position).

    .venv/bin/python scripts/train_throughput.py            # ~4 min here
    .venv/bin/python scripts/train_throughput.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS: list[dict] = [
    {"name": "before: fp32, 4x512, exit on every position", "amp": False, "bs": 4, "seq": 512, "stride": 1},
    {"name": "bf16 autocast, 4x512", "amp": True, "bs": 4, "seq": 512, "stride": 1},
    {"name": "bf16 + fused AdamW, 4x512", "amp": True, "bs": 4, "seq": 512, "stride": 1, "fused": True},
    {"name": "bf16 + torch.compile, 4x512", "amp": True, "bs": 4, "seq": 512, "stride": 1, "compile": True},
    {"name": "bf16, 16x256", "amp": True, "bs": 16, "seq": 256, "stride": 1},
    {"name": "bf16, 8x256", "amp": True, "bs": 8, "seq": 256, "stride": 1},
    {"name": "now, short phase: bf16, 8x256, exit every 4th", "amp": True, "bs": 8, "seq": 256, "stride": 4},
    {"name": "now, long phase: bf16, 4x512, exit every 4th", "amp": True, "bs": 4, "seq": 512, "stride": 4},
]


def child(cfg: dict, steps: int, threads: int) -> dict:
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("tdm", Path(__file__).with_name("train_default_model.py"))
    tdm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tdm)  # type: ignore[union-attr]
    from transformers import LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    mc = tdm.make_config(tdm.MAIN_ARCH, 8192, 1024)
    mc._attn_implementation = "sdpa"
    model = LlamaForCausalLM(mc)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=cfg.get("fused") or None)
    if cfg.get("compile"):
        model.model = torch.compile(model.model)
    batches = tdm.Batches(torch.randint(4, 8192, (600_000,), dtype=torch.int32), cfg["seq"], cfg["bs"], 0)

    def step(i: int) -> float:
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg["amp"]):
            main, exits = tdm.losses(model, batches.get(i), [2], cfg["stride"])
            loss = main + 0.3 * sum(exits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t

    for i in range(3):
        step(i)
    times = [step(3 + i) for i in range(steps)]
    med = statistics.median(times)
    return {**cfg, "step_s": round(med, 4), "tokens_per_s": round(cfg["bs"] * cfg["seq"] / med)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.steps, args.threads)))
        return
    rows = []
    for cfg in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg), "--steps", str(args.steps),
                              "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{rows[-1]['name']:<50} {rows[-1]['tokens_per_s']:>6} tok/s", flush=True)
    base = rows[0]["tokens_per_s"]
    print("\n| configuration | tokens/s (median step) | vs before |\n|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['tokens_per_s']:,} | {r['tokens_per_s'] / base:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
