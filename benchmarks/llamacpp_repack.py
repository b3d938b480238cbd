"""llama.cpp's repacked weights (its extra CPU buffer types) against the file's weights as stored, through the
llamacpp plugin's own ``Context``: the time of a decode step of 1, 8 and 32 rows, of a step of 1, 2, 5 and 9 rows
of one sequence (a verification step of 0, 1, 4 and 8 drafted tokens), and the memory a loaded model holds and
peaks at (the plugin releases the file's pages of repacked tensors as it loads).

Usage: .venv/bin/python benchmarks/llamacpp_repack.py [GGUF] [--rounds 3] [--threads 2]

Default file: the 0.5B random Llama's Q4_K_M that benchmarks/vs_llamacpp.py writes. 32 sequences of 96 prompt
tokens share one cache; each row count then decodes 30 steps (the first 3 untimed); one sequence of 96 tokens in
a cache of its own then takes 30 steps of each row count, each rolled back after it. Each side runs in its own
process (OpenMP workers spin between calls), sides alternating, ``--rounds`` rounds; medians of the rounds'
medians. Ratios are repacked / as stored (< 1: repacking faster or smaller).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT = HERE / "out" / "llamacpp" / "files" / "random-0.5b-q4_k_m.gguf"
ROWS = (1, 8, 32)
VERIFY = (1, 2, 5, 9)  # rows of one sequence's steps


def _mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))


def median_ms(f: Callable[[], None], reps: int, skip: int = 3) -> float:
    """The median time of ``f`` over ``reps`` calls, the first ``skip`` untimed, in ms."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times[skip:]) * 1e3


def in_children(script: str, file: str, threads: int, rounds: int,
                sides: dict[str, tuple[str, dict[str, str]]]) -> dict[str, list[dict[str, float]]]:
    """Each side, ``name: (child argument, extra environment)``, run as ``script FILE --threads N --child ARG`` in
    a process of its own (OpenMP workers spin between calls), the sides' order rotating round by round; each
    child's last line of output is its figures as JSON. Returns every side's figures, round by round."""
    names = list(sides)
    res: dict[str, list[dict[str, float]]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            arg, extra = sides[name]
            proc = subprocess.run([sys.executable, script, file, "--threads", str(threads), "--child", arg],
                                  capture_output=True, text=True, env={**os.environ, **extra}, timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(proc.stderr[-3000:])
            res[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in res[name][-1].items()), flush=True)
    return res


def fill_prompts(ctx: Any, seqs: int) -> None:
    """Sequences 0 .. ``seqs`` - 1 of a plugin ``Context`` each get a 96-token prompt, four prompts a call."""
    import numpy as np

    want = np.zeros(384, bool)
    want[95::96] = True
    for s0 in range(0, seqs, 4):
        ctx.decode(np.repeat(np.arange(s0, s0 + 4, dtype=np.int32), 96), np.arange(384, dtype=np.int32) % 5000 + 5,
                   np.tile(np.arange(96, dtype=np.int32), 4), want)


def child(path: str, threads: int) -> dict[str, float]:
    import numpy as np

    from dspark_llamacpp import runtime

    base = _mb("VmRSS")
    model = runtime.Model(path)
    held, peak = _mb("VmRSS") - base, _mb("VmHWM") - base
    ctx = runtime.Context(model, n_ctx=8192, n_seq_max=32, n_batch=512, threads=threads)
    fill_prompts(ctx, 32)
    pos = np.full(32, 96, np.int32)
    out: dict[str, float] = {"load_held_mb": held, "load_peak_mb": peak, "repacked": float(model.repacked)}
    for n in ROWS:

        def rows(n: int = n) -> None:
            ctx.decode(np.arange(n, dtype=np.int32), np.full(n, 7, np.int32), pos[:n].copy(), np.ones(n, bool))
            pos[:n] += 1

        out[f"rows_{n}_ms"] = median_ms(rows, 30)
    # One sequence alone: steps of 1 + k rows at the end of a 96-token prompt, rolled back after each (a
    # verification step of k drafted tokens, as DeepSpec takes one request at a time).
    one = runtime.Context(model, n_ctx=512, n_seq_max=1, n_batch=512, threads=threads)
    last = np.zeros(96, bool)
    last[-1] = True
    one.decode(np.zeros(96, np.int32), np.arange(96, dtype=np.int32) % 5000 + 5, np.arange(96, dtype=np.int32), last)
    for n in VERIFY:

        def verify(n: int = n) -> None:
            one.decode(np.zeros(n, np.int32), np.full(n, 7, np.int32), np.arange(96, 96 + n, dtype=np.int32),
                       np.ones(n, bool))
            one.drop(0, 96)

        out[f"one_seq_{n}_rows_ms"] = median_ms(verify, 30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", nargs="?", default=str(DEFAULT))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=("0", "1"))
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.file, args.threads)))
        return
    if not Path(args.file).exists():
        raise SystemExit(f"{args.file}: not found (benchmarks/vs_llamacpp.py writes the 0.5B files)")
    res = in_children(__file__, args.file, args.threads, args.rounds,
                      {"repacked": ("1", {"DSPARK_LLAMACPP_EXTRA_BUFTS": "1"}),
                       "as stored": ("0", {"DSPARK_LLAMACPP_EXTRA_BUFTS": "0"})})
    print(f"\n{Path(args.file).name}, {args.threads} threads, {args.rounds} rounds (medians)\n")
    print("| measure | repacked | as stored | repacked / as stored |\n|---|---|---|---|")
    for key in (*[f"rows_{n}_ms" for n in ROWS], *[f"one_seq_{n}_rows_ms" for n in VERIFY], "load_held_mb",
                "load_peak_mb"):
        a, b = (statistics.median(x[key] for x in res[s]) for s in ("repacked", "as stored"))
        f = ".2f" if key.endswith("_ms") else ".1f"
        print(f"| {key} | {a:{f}} | {b:{f}} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
