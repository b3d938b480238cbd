"""The real server, as a separate process, for every test under tests/server.

``start_server(tmp_path, **sections)`` starts ``python -m dspark.server`` on
free ports (port 0; the actual ports are read from its JSON startup log) and
returns a :class:`ServerHandle`; ``server`` is one such process shared by the
session (embedded model, float32, one torch thread), checked at the end for
leaked KV pages and a clean exit.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "stdlib-llama"
DEFAULT_CONFIG: dict[str, Any] = {
    "model": {"path": "default", "name": MODEL_NAME, "dtype": "float32"},
    "server": {"host": "127.0.0.1", "port": 0, "timeout_graceful_shutdown_s": 2},
    "engine": {"continuous_batching": {"max_batch_size": 16}},
    # One torch thread: the box has two cores and the test's client threads need one.
    "resources": {"metrics_port": 0, "cpu_cores_per_worker": 1, "enable_metrics": True},
}


def wait_for(cond: Callable[[], Any], timeout: float, what: str, *, poll: float = 0.05,
             context: Callable[[], Any] | None = None) -> Any:
    """Wait until ``cond()`` is truthy and return it; fail naming ``what`` (and ``context()``) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            extra = f"; {context()}" if context is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(poll)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class Metrics:
    """One scrape, parsed with prometheus-client's own parser."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``."""
        hits = [s.value for s in self.samples
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        if not hits:
            if default is None:
                raise KeyError(f"no sample {name}{labels or ''} in the scrape")
            return default
        return float(sum(hits))


@dataclass
class ServerHandle:
    proc: subprocess.Popen[bytes]
    base_url: str  # http://127.0.0.1:PORT
    metrics_url: str | None  # http://127.0.0.1:PORT/metrics on the metrics port
    model: str
    api_key: str | None
    log_path: Path
    config_path: Path
    startup_log: list[dict[str, Any]] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"{self.base_url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def openai(self, **kw: Any) -> Any:
        import openai

        kw.setdefault("timeout", 60.0)
        return openai.OpenAI(base_url=self.api_url, api_key=self.api_key or "no-key-required", max_retries=0, **kw)

    def http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=kw.pop("timeout", 60.0), **kw)

    def metrics(self, api_port: bool = False) -> Metrics:
        """Scrape the metrics port (or /metrics on the API port)."""
        url = f"{self.base_url}/metrics" if api_port or not self.metrics_url else self.metrics_url
        return Metrics(httpx.get(url, timeout=10).text)

    def log(self) -> list[dict[str, Any]]:
        """Every JSON log line the server wrote so far."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                out.append({"event": line, "level": "raw"})
        return out

    def wait_idle(self, timeout: float = 10.0) -> Metrics:
        """Until nothing runs, waits or holds KV pages; AssertionError if that never happens."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            state = {n: m.value(f"dspark_{n}") for n in ("requests_running", "requests_waiting", "kv_cache_used_bytes")}
            if not any(state.values()):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s: {state}")
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)


def start_server(tmp_path: Path, *, api_key: str | None = None, args: Sequence[str] = (),
                 entry: Sequence[str] = ("-m", "dspark.server"), config: dict[str, Any] | None = None,
                 timeout: float = 90.0, env: dict[str, str] | None = None, **sections: Any) -> ServerHandle:
    """Start a server process; ``sections`` (model=..., engine=...) are merged into DEFAULT_CONFIG,
    ``config`` replaces it outright, ``args`` are extra CLI flags (they override the file)."""
    cfg = copy.deepcopy(config) if config is not None else _merge(DEFAULT_CONFIG, sections)
    if api_key is not None:
        cfg.setdefault("server", {})["api_key"] = api_key
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg_path = tmp_path / "server_config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    log_path = tmp_path / "server.log"
    penv = {**os.environ, "DSPARK_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as logf:  # a file, not a pipe: nobody has to drain it
        proc = subprocess.Popen([sys.executable, *entry, "--config", str(cfg_path), *args],
                                stdout=logf, stderr=subprocess.STDOUT, env=penv)
    handle = ServerHandle(proc, "", None, cfg.get("model", {}).get("name") or MODEL_NAME, api_key, log_path, cfg_path)
    deadline = time.monotonic() + timeout
    metrics_on = cfg.get("resources", {}).get("enable_metrics", True) and "--no-metrics" not in args
    try:
        while True:
            lines = handle.log()
            listen = next((x for x in lines if str(x.get("event", "")).startswith("DSpark server is listening")), None)
            mline = next((x for x in lines if str(x.get("event", "")).startswith("Metrics endpoint")), None)
            if listen is not None and (mline is not None or not metrics_on):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} during startup:\n{log_path.read_text()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not start in {timeout}s:\n{log_path.read_text()}")
            time.sleep(0.05)
        handle.base_url = f"http://127.0.0.1:{listen['port']}"
        handle.metrics_url = f"http://127.0.0.1:{mline['metrics_port']}/metrics" if mline else None
        while True:  # bound before it logged; serving once /health answers
            try:
                if httpx.get(f"{handle.base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server never became healthy:\n{log_path.read_text()}")
            time.sleep(0.05)
    except BaseException:
        handle.stop(signal.SIGKILL)
        raise
    handle.startup_log = handle.log()
    return handle


@pytest.fixture(scope="session")
def server_factory() -> Iterator[Callable[..., ServerHandle]]:
    """``server_factory(tmp_path, **sections)``: start extra servers; all are stopped at session end."""
    started: list[ServerHandle] = []

    def make(tmp_path: Path, **kw: Any) -> ServerHandle:
        h = start_server(tmp_path, **kw)
        started.append(h)
        return h

    yield make
    for h in started:
        h.stop()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """The shared server (no API key). At the end: idle, no KV pages held, exit code 0 on SIGTERM.
    It runs the engine's default decoder choice ('auto': the plugins' compiled decoders bid and the
    fastest measured runs), so the API tests go through whichever target wins here."""
    h = start_server(tmp_path_factory.mktemp("server"), env={"DSPARK_DECODER": "auto"})
    try:
        yield h
        h.wait_idle()
    finally:
        code = h.stop()
    assert code == 0, f"server exited with {code}:\n{h.log_path.read_text()[-4000:]}"


@pytest.fixture(scope="session")
def reference() -> Any:
    """The same model in this process (float32, as the server runs it): the source of expected outputs."""
    import torch

    from dspark.llm import LLM

    torch.set_num_threads(1)
    return LLM(dtype="float32")


class OTLPReceiver:
    """A stand-in OTLP/HTTP collector on 127.0.0.1: keeps every ``POST /v1/traces`` body, decoded."""

    def __init__(self) -> None:
        import gzip
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest, ExportTraceServiceResponse,
        )

        self.requests: list[Any] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    msg = ExportTraceServiceRequest()
                    msg.ParseFromString(body)
                    with receiver._lock:
                        receiver.requests.append(msg)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def spans(self) -> list[tuple[Any, Any]]:
        """(resource, span) for every span received so far."""
        with self._lock:
            reqs = list(self.requests)
        return [(rs.resource, span) for r in reqs for rs in r.resource_spans for ss in rs.scope_spans
                for span in ss.spans]

    def wait_for(self, trace_id: bytes, count: int, timeout: float = 15.0) -> list[tuple[Any, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            got = [(res, s) for res, s in self.spans() if s.trace_id == trace_id]
            if len(got) >= count or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    yield r
    r.close()


@pytest.fixture(scope="session")
def observed_server(tmp_path_factory: pytest.TempPathFactory, server_factory: Callable[..., ServerHandle],
                    otlp_receiver: OTLPReceiver) -> ServerHandle:
    """One more server, for tests/server/test_observability.py and test_tracing.py: a stats line every
    0.3 s and traces exported to ``otlp_receiver`` (batches sent every 0.1 s). It logs at DEBUG, so that
    the stats lines of the idle server (DEBUG after the first) show when it ticked."""
    return server_factory(tmp_path_factory.mktemp("observed"),
                          env={"OTEL_BSP_SCHEDULE_DELAY": "100", "DSPARK_LOG_LEVEL": "DEBUG"},
                          observability={"otlp_traces_endpoint": otlp_receiver.url, "service_name": "dspark-test",
                                         "stats_log_interval_s": 0.3})
