"""OpenTelemetry traces: the tracing module in process (InMemorySpanExporter), then the real server
exporting over OTLP/HTTP to a local receiver (``otlp_receiver`` in conftest)."""

from __future__ import annotations

import os
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from dspark.server.tracing import RequestTracer, build_tracer

PROMPT = "def quick_sort(arr):"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


def _timer(arrival: float, scheduled: float | None, first: float | None, last: float, end: float, tokens: int,
           prompt: int = 5, reason: str | None = "length") -> Any:
    return SimpleNamespace(arrival=arrival, scheduled=scheduled, first=first, last=last, end=end, tokens=tokens,
                           prompt=prompt, finish_reason=reason)


@pytest.fixture
def traced() -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(SimpleSpanProcessor(exporter), service_name="svc", model_name="m", device="cpu",
                           plugin="torch", target="torch on cpu (float32)")
    return tracer, exporter


def _by_name(spans: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_request_span_and_phases(traced: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = traced
    t = time.perf_counter()
    timer = _timer(t + 0.001, t + 0.002, t + 0.010, t + 0.050, t + 0.051, tokens=8)
    tracer.record_request(request_id="r1", headers={"traceparent": TRACEPARENT}, start=t, duration_s=0.060,
                          timers=[timer], method="POST", path="/v1/completions", route="/v1/completions",
                          status=200, usage=(5, 8))
    spans = _by_name(exporter.get_finished_spans())
    assert sorted(spans) == ["decode", "dspark.request", "prefill", "queue"]
    (req,), (queue,), (prefill,), (decode,) = (spans[n] for n in ("dspark.request", "queue", "prefill", "decode"))
    # A child of the caller's span, in the caller's trace.
    assert f"{req.context.trace_id:032x}" == TRACE_ID and f"{req.parent.span_id:016x}" == PARENT_ID
    assert req.parent.is_remote and req.kind == SpanKind.SERVER
    for child in (queue, prefill, decode):
        assert child.parent.span_id == req.context.span_id and child.context.trace_id == req.context.trace_id
    a = dict(req.attributes)
    assert {k: a[k] for k in ("dspark.request_id", "gen_ai.response.model", "dspark.device", "dspark.plugin",
                              "dspark.target", "gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens",
                              "dspark.finish_reason", "http.response.status_code")} == {
        "dspark.request_id": "r1", "gen_ai.response.model": "m", "dspark.device": "cpu", "dspark.plugin": "torch",
        "dspark.target": "torch on cpu (float32)", "gen_ai.usage.prompt_tokens": 5,
        "gen_ai.usage.completion_tokens": 8, "dspark.finish_reason": "length", "http.response.status_code": 200}
    assert req.resource.attributes["service.name"] == "svc"
    assert req.status.status_code == StatusCode.UNSET

    def ms(ns: int) -> float:
        return (ns - req.start_time) / 1e6

    # perf_counter timings on the span clock: one offset, so the gaps are exact to the nanosecond.
    assert (ms(req.end_time), ms(queue.start_time), ms(queue.end_time)) == pytest.approx((60, 1, 2), abs=1e-3)
    assert (prefill.start_time, prefill.end_time) == (queue.end_time, decode.start_time)
    assert (ms(decode.start_time), ms(decode.end_time)) == pytest.approx((10, 50), abs=1e-3)
    # On the wall clock, not perf_counter's (which starts near boot): "now" to within a few seconds.
    assert abs(req.start_time - (time.time_ns() - (time.perf_counter() - t) * 1e9)) < 5e9
    assert dict(decode.attributes)["dspark.sequence.completion_tokens"] == 8


def test_without_traceparent_a_new_trace(traced: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = traced
    t = time.perf_counter()
    tracer.record_request(request_id="r2", headers={}, start=t, duration_s=0.01, timers=[], status=400)
    (req,) = exporter.get_finished_spans()
    assert req.parent is None and req.name == "dspark.request" and f"{req.context.trace_id:032x}" != TRACE_ID
    assert "gen_ai.usage.prompt_tokens" not in req.attributes  # no sequences, no usage given


def test_several_sequences_an_unscheduled_one_and_an_error(
        traced: tuple[RequestTracer, InMemorySpanExporter]) -> None:
    tracer, exporter = traced
    t = time.perf_counter()
    timers = [_timer(t, t + 0.001, t + 0.002, t + 0.004, t + 0.004, tokens=3, reason="stop"),
              _timer(t, t + 0.001, t + 0.003, t + 0.005, t + 0.005, tokens=2, reason="length"),
              _timer(t, None, None, t, t + 0.006, tokens=0, reason="abort")]  # aborted while queued
    tracer.record_request(request_id="r3", headers={"traceparent": TRACEPARENT}, start=t, duration_s=0.01,
                          timers=timers, status=500, error="RuntimeError('x')")
    spans = _by_name(exporter.get_finished_spans())
    assert {n: len(v) for n, v in spans.items()} == {"dspark.request": 1, "queue": 3, "prefill": 2, "decode": 2}
    (req,) = spans["dspark.request"]
    assert req.status.status_code == StatusCode.ERROR
    a = dict(req.attributes)
    # Without the handler's usage: the sequences' sums.
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (15, 5)
    assert list(a["gen_ai.response.finish_reasons"]) == ["stop", "length", "abort"]
    assert sorted(dict(s.attributes)["dspark.sequence.index"] for s in spans["queue"]) == [0, 1, 2]
    aborted = next(s for s in spans["queue"] if dict(s.attributes)["dspark.sequence.index"] == 2)
    assert (aborted.end_time - aborted.start_time) / 1e6 == pytest.approx(6, abs=1e-3)
    assert dict(aborted.attributes)["dspark.finish_reason"] == "abort"


def test_build_tracer_is_off_without_an_endpoint() -> None:
    assert build_tracer(None) is None and build_tracer("") is None
    t = build_tracer("http://127.0.0.1:9/v1/traces", service_name="x", model_name="m")
    assert isinstance(t, RequestTracer)
    t.shutdown()  # nothing queued: returns at once


# -- the real server --------------------------------------------------------------------------------


def _attrs(span: Any) -> dict[str, Any]:
    def value(v: Any) -> Any:
        kind = v.WhichOneof("value")
        return [value(x) for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)

    return {kv.key: value(kv.value) for kv in span.attributes}


def test_server_exports_the_request_trace(observed_server: Any, otlp_receiver: Any) -> None:
    srv = observed_server
    rid = f"tr-{uuid.uuid4().hex[:8]}"
    with srv.http() as c:
        r = c.post("/v1/completions", headers={"traceparent": TRACEPARENT, "X-Request-Id": rid}, json={
            "model": srv.model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    usage = r.json()["usage"]
    got = otlp_receiver.wait_for(bytes.fromhex(TRACE_ID), 4)
    mine = [(res, s) for res, s in got if s.name == "dspark.request" and _attrs(s)["dspark.request_id"] == rid]
    assert len(mine) == 1, [s.name for _, s in got]
    res, req = mine[0]
    children = {s.name: s for _, s in got if s.parent_span_id == req.span_id}
    assert sorted(children) == ["decode", "prefill", "queue"]
    assert req.parent_span_id.hex() == PARENT_ID
    assert {kv.key: kv.value.string_value for kv in res.attributes}["service.name"] == "dspark-test"
    a = _attrs(req)
    assert (a["gen_ai.response.model"], a["dspark.device"], a["dspark.plugin"]) == (srv.model, "cpu", "torch")
    assert a["dspark.target"].startswith("torch on cpu")
    assert (a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert (a["dspark.finish_reason"], a["http.response.status_code"]) == ("length", 200)
    q, p, d = children["queue"], children["prefill"], children["decode"]
    assert req.start_time_unix_nano <= q.start_time_unix_nano <= q.end_time_unix_nano == p.start_time_unix_nano
    assert p.end_time_unix_nano == d.start_time_unix_nano <= d.end_time_unix_nano <= req.end_time_unix_nano
    assert p.end_time_unix_nano > p.start_time_unix_nano  # a prefill takes time
    assert abs(req.start_time_unix_nano - time.time_ns()) < 60e9


def test_server_request_without_traceparent_starts_a_trace(observed_server: Any, otlp_receiver: Any) -> None:
    srv = observed_server
    rid = f"tr-{uuid.uuid4().hex[:8]}"
    with srv.http() as c:
        r = c.post("/v1/chat/completions", headers={"X-Request-Id": rid}, json={
            "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        mine = [s for _, s in otlp_receiver.spans() if s.name == "dspark.request"
                and _attrs(s).get("dspark.request_id") == rid]
        if mine:
            break
        time.sleep(0.05)
    (span,) = mine
    assert span.parent_span_id == b"" and _attrs(span)["http.response.status_code"] == 404
    assert [s for _, s in otlp_receiver.spans() if s.parent_span_id == span.span_id] == []  # no sequences ran


def test_tracing_is_off_by_default(server: Any) -> None:
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in os.environ
    assert not [e for e in server.startup_log if str(e.get("event", "")).startswith("Tracing requests")]
