"""Cold start of a quantized GGUF file (nothing cached): wall time and each process's peak memory.

Usage:
    .venv/bin/python benchmarks/gguf_cold_start.py [--file F] [--budget BYTES] [--max-batch 32]

An engine is built on ``F`` with ``decoder="auto"`` in a fresh ``DSPARK_CACHE_DIR``: every decoder that runs
the file as stored is probed (the first probe records the float reference's logits) and timed, each in a
process of its own (dspark.llm.decoding.stored). Printed: the cold start's wall time, the serving process's
peak RSS, and each probe process's peak RSS (``/usr/bin/time``), with what it did. ``--budget`` sets
``DSPARK_REFERENCE_BYTES`` (the float weights the reference may keep; default: half of the free memory).
Run the previous commit's tree beside it with ``PYTHONPATH=<worktree>/core`` for a before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_FILE = HERE / "out" / "llamacpp" / "files" / "random-0.5b-q4_k_m.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--file", default=str(DEFAULT_FILE), help="a quantized GGUF file (default: %(default)s)")
    ap.add_argument("--budget", type=int, default=None, help="DSPARK_REFERENCE_BYTES for the probe's reference")
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args()
    if not Path(args.file).is_file():
        sys.exit(f"{args.file}: no such file (benchmarks/vs_llamacpp.py writes the default one)")
    os.environ["DSPARK_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark-cold-")
    if args.budget is not None:
        os.environ["DSPARK_REFERENCE_BYTES"] = str(args.budget)
    from dspark.llm.decoding import stored

    children: list[dict[str, Any]] = []

    def child(req: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
        t0 = time.perf_counter()
        p = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "dspark.llm.decoding.probe_child",
                            json.dumps(req)], capture_output=True, text=True, env=env, timeout=stored.TIMEOUT_S)
        peak = int(p.stderr.strip().splitlines()[-1]) / 1024 if p.stderr.strip() else float("nan")
        children.append({"plugin": req["plugin"], "probe": bool(req.get("probe")), "time": "time" in req,
                         "peak_mb": round(peak), "s": round(time.perf_counter() - t0, 1)})
        if p.returncode != 0 or not p.stdout.strip():
            return {"bad": f"the probe's process failed (exit {p.returncode}): {p.stderr.strip()[-300:]}"}
        return dict(json.loads(p.stdout.strip().splitlines()[-1]))

    stored.child = child  # the same process the engine starts, measured
    t0 = time.perf_counter()
    from dspark.llm.engine import LLMEngine

    eng = LLMEngine.from_model(args.file, decoder="auto", max_batch_size=args.max_batch, max_total_tokens=8192)
    wall = time.perf_counter() - t0
    for c in children:
        print(f"probe process: {c['plugin']:10s} probe={c['probe']!s:5s} time={c['time']!s:5s} "
              f"peak {c['peak_mb']:,} MB, {c['s']} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    budget = os.environ.get("DSPARK_REFERENCE_BYTES", "half of free memory")
    print(f"cold start {wall:.1f} s; serving process peak {peak:,.0f} MB; runs {eng.layout().target}; "
          f"reference budget {budget}")


if __name__ == "__main__":
    main()
