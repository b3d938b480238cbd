"""Per-model inference statistics: Triton's statistics extension and the source of its Prometheus counters.

Counted as Triton counts (docs/user_guide/metrics.md, docs/protocol/
extension_statistics.md): a request is one success or failure however many
rows it holds; ``inference_count`` adds the rows, ``execution_count`` the
model executions (a dynamically formed batch is one); queue and compute
durations are per request (each request of a batch is charged the batch's
compute time), and ``batch_stats`` counts executions per batch size.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, n: int = 1) -> None:
        self.count += n
        self.ns += ns * n


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(frozen=True)
class Execution:
    """One model execution: its batch (requests, rows) and the time of each of its phases."""

    requests: int
    rows: int
    input_ns: int
    infer_ns: int
    output_ns: int


class ModelStats:
    """Counters of one model, updated from the event loop and the instance threads (hence the lock)."""

    def __init__(self, name: str, version: str = "1") -> None:
        self.name, self.version = name, version
        self._lock = threading.Lock()
        self.success, self.fail = Duration(), Duration()
        self.fail_reasons: dict[str, int] = {}
        self.queue, self.compute_input, self.compute_infer, self.compute_output = (Duration() for _ in range(4))
        self.inference_count = self.execution_count = 0
        self.last_inference_ms = 0
        self.pending = 0
        self.batches: dict[int, BatchStats] = {}

    def enqueued(self, n: int = 1) -> None:
        with self._lock:
            self.pending += n

    def dequeued(self, queue_ns: list[int]) -> None:
        """Requests leave the queue for an instance: no longer pending, their queue time counted."""
        with self._lock:
            self.pending -= len(queue_ns)
            for ns in queue_ns:
                self.queue.add(ns)

    def executed(self, e: Execution) -> None:
        with self._lock:
            self.execution_count += 1
            self.inference_count += e.rows
            self.last_inference_ms = int(time.time() * 1000)
            self.compute_input.add(e.input_ns, e.requests)
            self.compute_infer.add(e.infer_ns, e.requests)
            self.compute_output.add(e.output_ns, e.requests)
            b = self.batches.setdefault(e.rows, BatchStats())
            b.compute_input.add(e.input_ns)
            b.compute_infer.add(e.infer_ns)
            b.compute_output.add(e.output_ns)

    def finished(self, ok: bool, duration_ns: int, reason: str = "OTHER") -> None:
        """A request ended (its response built, or its error known); ``reason`` is Triton's failure label."""
        with self._lock:
            if ok:
                self.success.add(duration_ns)
            else:
                self.fail.add(duration_ns)
                self.fail_reasons[reason] = self.fail_reasons.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """The statistics extension's ``$model_stat`` JSON object (also the gRPC message's fields)."""
        def d(x: Duration) -> dict[str, int]:
            return {"count": x.count, "ns": x.ns}

        with self._lock:
            return {
                "name": self.name, "version": self.version, "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "inference_stats": {
                    "success": d(self.success), "fail": d(self.fail), "queue": d(self.queue),
                    "compute_input": d(self.compute_input), "compute_infer": d(self.compute_infer),
                    "compute_output": d(self.compute_output), "cache_hit": d(Duration()),
                    "cache_miss": d(Duration())},
                "batch_stats": [{"batch_size": size, "compute_input": d(b.compute_input),
                                 "compute_infer": d(b.compute_infer), "compute_output": d(b.compute_output)}
                                for size, b in sorted(self.batches.items())],
                "memory_usage": [], "response_stats": {},
            }

    def counters(self) -> dict[str, Any]:
        """What the Prometheus collector reads: one consistent view of every counter."""
        with self._lock:
            return {
                "success": self.success.count, "fail_reasons": dict(self.fail_reasons),
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "pending": self.pending, "request_ns": self.success.ns + self.fail.ns, "queue_ns": self.queue.ns,
                "compute_input_ns": self.compute_input.ns, "compute_infer_ns": self.compute_infer.ns,
                "compute_output_ns": self.compute_output.ns,
            }
