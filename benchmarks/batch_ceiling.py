"""How much batching can give on this machine: each runtime alone, images per second at batch 1 and batch N.

Usage: .venv/bin/python benchmarks/batch_ceiling.py [--models resnet50,vit] [--batch 16] [--rounds 3]

A dynamic batcher cannot serve more images per second than the runtime computes at the batch it forms, so
the ratio (images/s at batch N) / (images/s at batch 1) of the runtime alone bounds what any batching server
gains over one that runs every request at batch 1 (benchmarks/serve_oip.py's ``ort-fastapi`` peer). Each
(round, model, runtime) runs in a fresh process (ONNX Runtime's and OpenVINO's worker threads spin after a
run and slow whatever runs next in the same process), the runtimes alternated; default threads, fp32. The
models are the ONNX files benchmarks/serve_oip.py exports (exported here when missing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIMES = ("onnxruntime", "openvino")


def _time_one(runtime: str, path: str, batch: int, seconds: float) -> float:
    """Images per second of ``runtime`` alone on ``path`` at ``batch`` (median over repeated runs)."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((batch, 3, 224, 224), dtype=np.float32)
    if runtime == "onnxruntime":
        import onnxruntime as ort

        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name

        def run() -> None:
            sess.run(None, {name: x})
    else:
        import openvino as ov

        request = ov.Core().compile_model(path, "CPU", {"PERFORMANCE_HINT": "LATENCY"}).create_infer_request()

        def run() -> None:
            request.infer({0: x})
    for _ in range(2):
        run()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < end:
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return batch / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,vit")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0, help="timed seconds per (runtime, batch)")
    ap.add_argument("--one", nargs=4, metavar=("RUNTIME", "PATH", "BATCH", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        runtime, path, batch, seconds = args.one
        print(json.dumps(_time_one(runtime, path, int(batch), float(seconds))))
        return
    models = args.models.split(",")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_oip import model_file  # the same files the serving benchmark loads

    paths = {m: model_file(m) for m in models}
    rates: dict[tuple[str, str, int], list[float]] = {}
    for r in range(args.rounds):
        for i, model in enumerate(models):
            path = paths[model]
            order = RUNTIMES if (r + i) % 2 == 0 else RUNTIMES[::-1]
            for runtime in order:
                for batch in (1, args.batch):
                    out = subprocess.run([sys.executable, __file__, "--one", runtime, str(path), str(batch),
                                          str(args.seconds)], capture_output=True, text=True, check=True)
                    rate = float(out.stdout.strip().splitlines()[-1])
                    rates.setdefault((model, runtime, batch), []).append(rate)
                    print(f"round {r + 1} {model} {runtime} batch {batch}: {rate:.1f} images/s", file=sys.stderr)
    print(f"\n{'model':<10}{'runtime':<13}{'batch 1 img/s':>15}{f'batch {args.batch} img/s':>16}{'ratio':>8}")
    for model in models:
        for runtime in RUNTIMES:
            one = statistics.median(rates[(model, runtime, 1)])
            big = statistics.median(rates[(model, runtime, args.batch)])
            print(f"{model:<10}{runtime:<13}{one:>15.1f}{big:>16.1f}{big / one:>8.2f}")


if __name__ == "__main__":
    main()
