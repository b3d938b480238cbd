"""OpenTelemetry traces of the server's requests (off unless an OTLP endpoint is configured).

One span per HTTP request, ``dspark.request`` (kind SERVER), started and ended
when the observability middleware saw the request come in and its response
end, so it is recorded after the fact, in one go, per HTTP request. Its
children come from each engine sequence's
:class:`~dspark.server.metrics.SequenceTimer` (the timings the metrics
already take, ``time.perf_counter()`` values, turned into epoch nanoseconds
through an offset taken once):

* ``queue``   -- request arrival to the engine first scheduling the sequence,
* ``prefill`` -- first scheduled to the first output token,
* ``decode``  -- first output token to the last.

A request with several sequences (``n`` > 1, several prompts) gets these three
per sequence, told apart by ``dspark.sequence.index``. An incoming W3C
``traceparent`` header makes the request span a child of the caller's span.

Spans go through a ``BatchSpanProcessor`` to an ``OTLPSpanExporter`` (OTLP over
HTTP, protobuf) at the configured endpoint, e.g. ``http://collector:4318/v1/traces``;
``OTEL_BSP_*`` environment variables tune the batching as usual.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from dspark.host.log import get_logger

log = get_logger("dspark.server")

_PROPAGATOR = TraceContextTextMapPropagator()


class RequestTracer:
    """Turns a finished request's timings into spans; ``shutdown()`` flushes what is still queued."""

    def __init__(self, processor: SpanProcessor, *, service_name: str = "dspark", model_name: str = "",
                 device: str = "", plugin: str = "", target: str = "") -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(processor)
        # A provider of our own, not the global one: an embedding application's tracing is left alone.
        self.tracer = self.provider.get_tracer("dspark.server")
        self.model_name, self.device, self.plugin, self.target = model_name, device, plugin, target
        # perf_counter seconds -> epoch nanoseconds, measured once so every span shares one clock.
        self._offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

    @classmethod
    def otlp(cls, endpoint: str, **kw: Any) -> RequestTracer:
        """Export in batches over OTLP/HTTP to ``endpoint`` (the full URL, ``.../v1/traces``)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)), **kw)

    def epoch_ns(self, perf: float) -> int:
        return self._offset_ns + int(perf * 1e9)

    def record_request(self, *, request_id: str, headers: Mapping[str, str], start: float, duration_s: float,
                       timers: Sequence[Any] = (), method: str = "", path: str = "", route: str | None = None,
                       status: int | None = None, usage: tuple[int, int] | None = None,
                       error: str | None = None) -> None:
        """Record one request span, and its sequences' phases, after the fact.

        ``start``: the request's arrival (``time.perf_counter()``); ``duration_s``: until its response ended;
        ``timers``: its SequenceTimers; ``usage``: (prompt, completion) tokens as the response reported
        them (else the timers' sum); ``headers``: lower-cased request headers (``traceparent``).
        """
        parent = _PROPAGATOR.extract(carrier=dict(headers))
        start_ns = self.epoch_ns(start)
        end_ns = start_ns + max(int(duration_s * 1e9), 0)
        reasons = [t.finish_reason for t in timers if getattr(t, "finish_reason", None)]
        if usage is None and timers:
            usage = (sum(t.prompt for t in timers), sum(t.tokens for t in timers))
        attrs: dict[str, Any] = {
            "dspark.request_id": request_id, "gen_ai.request.id": request_id,
            "gen_ai.response.model": self.model_name, "dspark.model_name": self.model_name,
            "dspark.device": self.device, "dspark.plugin": self.plugin, "dspark.target": self.target,
            "http.request.method": method, "url.path": path,
        }
        if route:
            attrs["http.route"] = route
        if status is not None:
            attrs["http.response.status_code"] = int(status)
        if usage is not None:
            attrs["gen_ai.usage.prompt_tokens"], attrs["gen_ai.usage.completion_tokens"] = int(usage[0]), int(usage[1])
        if reasons:
            attrs["gen_ai.response.finish_reasons"] = reasons
            attrs["dspark.finish_reason"] = reasons[0] if len(set(reasons)) == 1 else ",".join(reasons)
        firsts = [t.first for t in timers if t.first is not None]
        if firsts:
            attrs["gen_ai.latency.time_to_first_token"] = min(firsts) - min(t.arrival for t in timers)
        span = self.tracer.start_span("dspark.request", context=parent, kind=SpanKind.SERVER, attributes=attrs,
                                      start_time=start_ns)
        if error is not None or (status is not None and status >= 500):
            span.set_status(Status(StatusCode.ERROR, error or f"HTTP {status}"))
        ctx = trace.set_span_in_context(span)
        for i, t in enumerate(timers):
            self._phases(ctx, i, t, end_ns)
        span.end(end_time=end_ns)

    def _phases(self, ctx: Any, index: int, t: Any, request_end_ns: int) -> None:
        end = t.end if t.end is not None else t.last
        sched = t.scheduled
        if t.first is not None and sched is None:
            sched = t.first
        common = {"dspark.sequence.index": index, "dspark.sequence.prompt_tokens": int(t.prompt)}

        def child(name: str, a: float, b: float, **extra: Any) -> None:
            s_ns = self.epoch_ns(a)
            e_ns = min(max(self.epoch_ns(b), s_ns), max(request_end_ns, s_ns))
            self.tracer.start_span(name, context=ctx, start_time=s_ns,
                                   attributes={**common, **extra}).end(end_time=e_ns)

        if t.first is None:  # never produced a token: it waited (or was prefilling) until it ended
            child("queue", t.arrival, sched if sched is not None else end,
                  **({"dspark.finish_reason": t.finish_reason} if t.finish_reason else {}))
            if sched is not None:
                child("prefill", sched, end)
            return
        child("queue", t.arrival, sched)
        child("prefill", sched, t.first)
        child("decode", t.first, t.last, **{"dspark.sequence.completion_tokens": int(t.tokens),
                                            "dspark.finish_reason": t.finish_reason or ""})

    def shutdown(self) -> None:
        try:
            self.provider.shutdown()  # flushes the batch processor
        except Exception as e:
            log.warning("tracing shutdown failed", error=repr(e))


def build_tracer(endpoint: str | None, *, service_name: str = "dspark", model_name: str = "",
                 device: str = "", plugin: str = "", target: str = "") -> RequestTracer | None:
    """The server's tracer from its config: None (tracing off) without an endpoint."""
    if not endpoint:
        return None
    return RequestTracer.otlp(endpoint, service_name=service_name, model_name=model_name, device=device,
                              plugin=plugin, target=target)


__all__ = ["RequestTracer", "build_tracer"]
