"""Prometheus metrics under Triton's names (``nv_inference_*``, labels ``model`` and ``version``).

The counters are read from each model's :class:`ModelStats` at scrape time,
so serving a request costs no metric updates beyond the stats it keeps anyway.
Triton exposes its counters without the ``_total`` suffix prometheus_client
gives every counter family (``# TYPE nv_inference_count counter`` followed by
``nv_inference_count{...}``); :func:`render` keeps Triton's exposition so
dashboards and alerts written for Triton read ours unchanged. The endpoint is
a small HTTP server on its own thread and port, as Triton's (and the LLM
server's) metrics port is.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dspark.server.oip.stats import ModelStats

# Triton's counter families: (name, the counters() key it reads, help); durations are in microseconds.
COUNTERS: list[tuple[str, str, str]] = [
    ("nv_inference_request_success", "success", "Number of successful inference requests, all batch sizes"),
    ("nv_inference_count", "inference_count", "Number of inferences performed (a batch of n is n inferences)"),
    ("nv_inference_exec_count", "execution_count", "Number of model executions performed (a batch is one)"),
    ("nv_inference_request_duration_us", "request_ns", "Cumulative inference request duration in microseconds"),
    ("nv_inference_queue_duration_us", "queue_ns", "Cumulative inference queuing duration in microseconds"),
    ("nv_inference_compute_input_duration_us", "compute_input_ns",
     "Cumulative compute input duration in microseconds"),
    ("nv_inference_compute_infer_duration_us", "compute_infer_ns",
     "Cumulative compute inference duration in microseconds"),
    ("nv_inference_compute_output_duration_us", "compute_output_ns",
     "Cumulative inference compute output duration in microseconds"),
]
FAILURE = "nv_inference_request_failure"
PENDING = "nv_inference_pending_request_count"
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")
METRIC_NAMES = [FAILURE, PENDING, *(name for name, _, _ in COUNTERS)]


class _StatsCollector(Collector):
    def __init__(self, models: Callable[[], Iterable[ModelStats]]) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        views = [(m.name, m.version, m.counters()) for m in self.models()]
        for name, key, doc in COUNTERS:
            fam = Metric(name, doc, "counter")
            for model, version, c in views:
                value = c[key] / 1000 if key.endswith("_ns") else c[key]
                fam.add_sample(name, {"model": model, "version": version}, value)
            yield fam
        fail = Metric(FAILURE, "Number of failed inference requests, all batch sizes", "counter")
        for model, version, c in views:
            for reason in FAILURE_REASONS:
                fail.add_sample(FAILURE, {"model": model, "version": version, "reason": reason},
                                c["fail_reasons"].get(reason, 0))
        yield fail
        pending = GaugeMetricFamily(PENDING, "Instantaneous number of pending requests awaiting execution per-model.",
                                    labels=["model", "version"])
        for model, version, c in views:
            pending.add_metric([model, version], c["pending"])
        yield pending


def build_registry(models: Callable[[], Iterable[ModelStats]]) -> CollectorRegistry:
    """The server's own registry: the model counters plus the process's (CPU, memory, GC) collectors."""
    r = CollectorRegistry(auto_describe=False)
    r.register(_StatsCollector(models))
    ProcessCollector(registry=r)
    PlatformCollector(registry=r)
    GCCollector(registry=r)
    return r


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text format, with Triton's counter names (no ``_total``) in the HELP and TYPE lines."""
    text = generate_latest(registry).decode()
    for name in (FAILURE, *(n for n, _, _ in COUNTERS)):
        text = text.replace(f"# HELP {name}_total ", f"# HELP {name} ", 1)
        text = text.replace(f"# TYPE {name}_total counter", f"# TYPE {name} counter", 1)
    return text.encode()


class MetricsServer:
    """``GET /metrics`` on its own port and thread (a scrape never waits on the event loop)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = render(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass  # scrapes every few seconds would drown the log

        server = type("_MetricsHTTPServer", (ThreadingHTTPServer,),
                      {"address_family": socket.AF_INET6 if ":" in host else socket.AF_INET, "daemon_threads": True})
        self.httpd = server((host, port), Handler)
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="oip-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
