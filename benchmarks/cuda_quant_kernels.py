"""The cuda plugin's Triton quantized linears against torch's own matmuls, per call, on a GPU.

Usage: .venv/bin/python benchmarks/cuda_quant_kernels.py [--iters 200]

For each LLM projection shape (K, N) the engine quantizes (the embedded
model's, then a 90M model's) and 1 or 128 rows: median microseconds per call
of the fp32 and fp16 matmuls (torch, cuBLAS) and of the plugin's int8,
w8a8 (dynamic int8 activations), int4 group-128 and int4 group-128 with fp16
activations kernels, each timed alone after 5 warm-up calls with a
synchronize per call, and each quantized kernel's ratio to the fp32 matmul.
Needs a CUDA GPU; exits 2 without one. (This was a test that failed past a
50x ratio; a speed is a benchmark's figure, not a test's verdict.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

PROJECTIONS = [(384, 640), (384, 384), (384, 1792), (896, 384), (384, 8192),
               (768, 1280), (768, 768), (768, 4096), (2048, 768), (768, 8192)]


def median_us(fn: Callable[[], object], iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine: nothing to time", file=sys.stderr)
        return 2
    from dspark.sdk.quant import quantize_weight
    from dspark.types import QuantSpec
    from dspark_plugins_cuda import triton_quant as tq

    specs = {"int8": QuantSpec(weight_bits=8, granularity="per_channel"),
             "w8a8": QuantSpec(weight_bits=8, granularity="per_channel", activations="dynamic_int8"),
             "int4": QuantSpec(weight_bits=4, granularity="group", group_size=128)}
    dev = "cuda:0"
    print(f"{torch.cuda.get_device_name(0)}; median us per call ({args.iters} calls), ratio to fp32 in ()")
    print(f"{'K x N':>12} {'rows':>5} {'fp32':>8} {'fp16':>8} {'int8':>14} {'w8a8':>14} {'int4g128':>14} "
          f"{'int4g128 fp16':>14}")
    for k, n in PROJECTIONS:
        w = (np.random.default_rng(0).standard_normal((k, n)) * 0.05).astype(np.float32)
        wt = torch.from_numpy(w).to(dev)
        lins = {name: tq.QuantLinear(tq.repack(quantize_weight(w, spec)), dev,
                                     dynamic_int8=spec.activations == "dynamic_int8")
                for name, spec in specs.items()}
        for rows in (1, 128):
            x = torch.randn(rows, k, device=dev)
            xh = x.half()
            t = {"fp32": median_us(lambda: x @ wt, args.iters),
                 "fp16": median_us(lambda: xh @ wt.half(), args.iters)}
            for name, lin in lins.items():
                t[name] = median_us(lambda lin=lin: lin(x), args.iters)
            t["int4h"] = median_us(lambda: lins["int4"](xh), args.iters)
            cells = " ".join(f"{t[q]:7.1f} ({t[q] / t['fp32']:4.1f})" for q in ("int8", "w8a8", "int4", "int4h"))
            print(f"{f'{k}x{n}':>12} {rows:>5} {t['fp32']:8.1f} {t['fp16']:8.1f} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
