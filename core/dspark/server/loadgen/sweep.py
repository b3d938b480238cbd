"""``dspark bench serve --sweep PARAM=V1,V2,...``: one server process per value, same load on each.

For each value the server is started afresh (so nothing carries over: KV
pool, allocator, warmed caches), warmed with a few requests, loaded, and
stopped. The rows go to ``sweep.csv`` and the throughput-vs-P99-latency curve
to ``sweep.png`` under the output directory; the server logs stay beside them.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType

import httpx

from dspark.server.loadgen.bench import BenchRequest, LoadConfig, RunResult, run
from dspark.server.loadgen.stats import Summary


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def server_command(*, port: int, metrics_port: int, host: str = "127.0.0.1", config: Path | None = None,
                   overrides: Sequence[tuple[str, str]] = ()) -> list[str]:
    """``python -m dspark.server`` with CLI flags; an override ``max_batch_size=4`` becomes ``--max-batch-size 4``."""
    cmd = [sys.executable, "-m", "dspark.server", "--host", host, "--port", str(port),
           "--metrics-port", str(metrics_port)]
    if config is not None:
        cmd += ["--config", str(config)]
    for name, value in overrides:
        cmd += [f"--{name.replace('_', '-')}", value]
    return cmd


class ServerProcess:
    """A server subprocess on loopback; ``with`` starts it and waits for ``/health``, leaving stops it."""

    def __init__(self, cmd: Sequence[str], *, url: str, log: Path | None = None,
                 startup_timeout_s: float = 180.0, env: dict[str, str] | None = None) -> None:
        self.cmd, self.url, self.log = list(cmd), url, log
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> ServerProcess:
        out = open(self.log, "wb") if self.log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(self.env or {})})
        finally:
            if self.log is not None:
                out.close()  # type: ignore[union-attr]  # the child holds its own descriptor
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before it was healthy: "
                                   f"{' '.join(self.cmd)}{self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.startup_timeout_s:.0f} s: {' '.join(self.cmd)}{self._tail()}")

    def _tail(self) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n--- server log (tail) ---\n" + self.log.read_text(errors="replace")[-2000:]

    def stop(self, timeout_s: float = 20.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)  # graceful: uvicorn drains, the app aborts what is left
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def parse_sweep(spec: str) -> tuple[str, list[str]]:
    """``"max_batch_size=1,4,16"`` -> ``("max_batch_size", ["1", "4", "16"])``."""
    name, sep, vals = spec.partition("=")
    values = [v.strip() for v in vals.split(",") if v.strip()]
    if not sep or not name.strip() or not values:
        raise ValueError(f"--sweep wants NAME=V1,V2,..., got {spec!r}")
    return name.strip(), values


@dataclass
class SweepRow:
    param: str
    value: str
    summary: Summary

    def csv_dict(self) -> dict[str, object]:
        s = self.summary
        return {
            self.param: self.value,
            "requests": s.num_requests, "completed": s.completed, "failed": s.failed,
            "duration_s": round(s.duration_s, 3),
            "request_throughput": round(s.request_throughput, 4),
            "output_token_throughput": round(s.output_token_throughput, 2),
            "ttft_p50_ms": s.ttft_ms.p50, "ttft_p99_ms": s.ttft_ms.p99,
            "tpot_p50_ms": s.tpot_ms.p50, "tpot_p99_ms": s.tpot_ms.p99,
            "e2e_p50_ms": s.e2e_ms.p50, "e2e_p99_ms": s.e2e_ms.p99,
            "goodput": round(s.goodput, 4),
        }


def write_csv(rows: Sequence[SweepRow], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].csv_dict()))
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.csv_dict().items()})


def plot(rows: Sequence[SweepRow], path: Path, title: str = "") -> None:
    """Output token throughput (x) against P99 e2e and P99 TTFT (y), each point labelled with its value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), dpi=100)
    for ax, key, label in ((axes[0], "e2e_ms", "P99 end-to-end latency (ms)"),
                           (axes[1], "ttft_ms", "P99 time to first token (ms)")):
        pts = [(r.summary.output_token_throughput, getattr(r.summary, key).p99, r.value) for r in rows]
        pts = [p for p in pts if p[1] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        for k, (x, y, v) in enumerate(pts):  # alternate above/below so neighbours do not overprint
            ax.annotate(v, (x, y), textcoords="offset points", xytext=(5, 5 if k % 2 == 0 else -11), fontsize=8)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"throughput vs P99 latency; each point one server, labelled with its {rows[0].param}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def sweep(param: str, values: Sequence[str], load: LoadConfig, reqs: Sequence[BenchRequest], out_dir: Path, *,
          config: Path | None = None, warmup: int = 4, progress: bool = False,
          on_row: Callable[[SweepRow, RunResult], None] | None = None,
          server_env: dict[str, str] | None = None) -> list[SweepRow]:
    """Run ``reqs`` against a fresh server for each value of ``param``; writes sweep.csv and sweep.png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for v in values:
        port, mport = free_port(), free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = server_command(port=port, metrics_port=mport, config=config, overrides=[(param, v)])
        with ServerProcess(cmd, url=url, log=out_dir / f"server-{param}-{v}.log", env=server_env):
            cfg = replace(load, url=url)
            if warmup:  # first requests pay one-off costs (allocations, lazy init) that are not the setting's
                run(replace(cfg, disconnect_fraction=0.0, concurrency=min(warmup, cfg.concurrency or warmup),
                            request_rate=None), reqs[:warmup])
            res = run(cfg, reqs, progress=progress, description=f"{param}={v}")
        row = SweepRow(param, v, res.summary())
        rows.append(row)
        if on_row is not None:
            on_row(row, res)
    write_csv(rows, out_dir / "sweep.csv")
    plot(rows, out_dir / "sweep.png")
    return rows
