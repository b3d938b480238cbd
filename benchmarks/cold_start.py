"""Cold start of `dspark devices`: wall time of fresh processes, median of N.

Usage: .venv/bin/python benchmarks/cold_start.py [--runs 7]

The first run fills the on-disk microbenchmark cache (reported separately);
the rest are what a user sees on every call afterwards. The peer is a bare
`python -c "import onnxruntime, openvino"`, the floor any listing that asks
the runtimes themselves has to pay.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def wall(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    env = dict(os.environ, DSPARK_CACHE_DIR=tempfile.mkdtemp(prefix="dspark-bench-"))
    devices = [sys.executable, "-m", "dspark.cli", "devices", "--json"]
    first = wall(devices, env)
    ours = statistics.median(wall(devices, env) for _ in range(args.runs))
    floor = statistics.median(
        wall([sys.executable, "-c", "import onnxruntime, openvino"], env) for _ in range(args.runs))
    print(f"{'what':<44} {'median s':>9}")
    print(f"{'dspark devices --json, empty cache (1 run)':<44} {first:9.3f}")
    print(f"{'dspark devices --json, cached':<44} {ours:9.3f}")
    print(f"{'python -c import onnxruntime, openvino':<44} {floor:9.3f}")
    print(f"{'ratio dspark / import floor':<44} {ours / floor:9.2f}")


if __name__ == "__main__":
    main()
