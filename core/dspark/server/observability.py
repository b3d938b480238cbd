"""Request ids, the per-request access log line, the periodic stats line, and what runs the model.

* :class:`RequestObservability` -- pure ASGI middleware (no ``BaseHTTPMiddleware``,
  which would get between the handlers and ``receive``): takes the client's
  ``X-Request-Id`` (or makes one, a uuid4 hex), stores it in
  ``scope["state"]["request_id"]`` (``request.state.request_id`` in handlers),
  binds it into structlog's context vars for the request's log lines, echoes it
  on every response (errors and streams included), logs one access line when
  the response ends and, with a tracer, hands the request's timings to it.
* :func:`start_stats_logger` -- a thread that logs running / waiting sequences,
  KV cache use and prompt / generation throughput every ``interval_s`` (vLLM's
  "Avg prompt throughput ..." line).
* :func:`describe_runtime` -- the devices, plugins and target behind the engine,
  read from what the engine already built (no device probing).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dspark.host.log import get_logger

log = get_logger("dspark.server")

REQUEST_ID_HEADER = "x-request-id"
# A client's id is taken as it is when it is 1-128 visible ASCII characters; anything else gets a fresh one.
_VALID_ID = re.compile(r"[\x21-\x7e]{1,128}")
# The generation routes: their access line carries the token counts the handler set.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# Probes and scrapes would drown the log at INFO: their lines are DEBUG.
QUIET_PATHS = ("/health", "/metrics")
_CRASH_BODY = json.dumps({"error": {"message": "internal server error", "type": "server_error", "param": None,
                                    "code": None}}, separators=(",", ":")).encode()


@dataclass
class Observability:
    """What ``create_app`` installs besides the routes (built from the config's ``observability`` section)."""

    access_log: bool = True
    stats_log_interval_s: float = 0.0  # 0 = no stats line
    tracer: Any = None  # dspark.server.tracing.RequestTracer, or None: tracing off


def request_id_of(scope: Scope) -> str | None:
    state = scope.get("state")
    return state.get("request_id") if isinstance(state, dict) else None


class RequestObservability:
    """Request id in and out, one access log line per request, the request's trace (see the module doc)."""

    def __init__(self, app: ASGIApp, access_log: bool = True, tracer: Any = None) -> None:
        self.app, self.access_log, self.tracer = app, access_log, tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get(REQUEST_ID_HEADER, "")
        rid = given if _VALID_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        raw_id = rid.encode("latin-1")
        status = 500
        started = False

        async def send_(msg: Message) -> None:
            nonlocal status, started
            if msg["type"] == "http.response.start":
                started = True
                status = msg["status"]
                hdrs = [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"x-request-id"]
                msg = {**msg, "headers": [*hdrs, (b"x-request-id", raw_id)]}
            await send(msg)

        error: BaseException | None = None
        try:
            with structlog.contextvars.bound_contextvars(request_id=rid):
                await self.app(scope, receive, send_)
        except Exception as e:
            # An unhandled error: Starlette's outermost layer answers it, past this middleware, so its 500
            # would leave without the id. Answer it here (the same body), then let it propagate as before.
            error = e
            if not started:
                try:
                    await send_({"type": "http.response.start", "status": 500,
                                 "headers": [(b"content-type", b"application/json"),
                                             (b"content-length", str(len(_CRASH_BODY)).encode())]})
                    await send_({"type": "http.response.body", "body": _CRASH_BODY})
                except Exception:  # the connection is gone: nothing left to answer
                    pass
            status = 500
            raise
        finally:
            self._done(scope, headers, rid, status, t0, error)

    def _done(self, scope: Scope, headers: dict[str, str], rid: str, status: int, t0: float,
              error: BaseException | None) -> None:
        latency = time.perf_counter() - t0
        state = scope.get("state") or {}
        path = scope.get("path", "")
        usage = state.get("usage_tokens")
        if self.access_log:
            fields: dict[str, Any] = {
                "logger": "dspark.access", "method": scope.get("method", ""), "path": path,
                "route": getattr(scope.get("route"), "path", None), "status": status, "request_id": rid,
                "latency_ms": round(latency * 1e3, 3),
            }
            client = scope.get("client")
            if client:
                fields["client"] = f"{client[0]}:{client[1]}"
            if path in GENERATION_PATHS and usage is not None:
                fields["prompt_tokens"], fields["completion_tokens"] = int(usage[0]), int(usage[1])
            line = f'{fields["method"]} {path} {status}'
            (log.debug if path in QUIET_PATHS else log.info)(line, **fields)
        if self.tracer is not None:
            try:
                self.tracer.record_request(
                    request_id=rid, headers=headers, method=scope.get("method", ""), path=path,
                    route=getattr(scope.get("route"), "path", None), status=status, start=t0,
                    duration_s=latency, timers=state.get("sequence_timers") or [], usage=usage,
                    error=repr(error) if error is not None else None)
            except Exception as e:  # tracing must never fail a request
                log.warning("tracing failed", error=repr(e), request_id=rid)


# -- the periodic stats line ------------------------------------------------------------------------


@dataclass
class StatsLogger:
    """A daemon thread logging the engine's state every ``interval_s``; ``stop()`` ends it."""

    engine: Any
    metrics: Any
    interval_s: float
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StatsLogger:
        self._thread = threading.Thread(target=self._loop, name="dspark-stats-log", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        last_t = time.perf_counter()
        last_p, last_g = self.metrics.live_prompt_tokens, self.metrics.live_generation_tokens
        was_active: bool | None = None  # None: nothing logged yet (the first line is always INFO)
        while not self._stop.wait(self.interval_s):
            now = time.perf_counter()
            p, g = self.metrics.live_prompt_tokens, self.metrics.live_generation_tokens
            try:
                s = self.engine.stats()
            except Exception as e:  # an engine that is shutting down
                log.debug("stats unavailable", error=repr(e))
                continue
            dt = max(now - last_t, 1e-9)
            prompt_tps, gen_tps = (p - last_p) / dt, (g - last_g) / dt
            last_t, last_p, last_g = now, p, g
            kv_pct = 100.0 * float(s.kv_usage)
            active = bool(s.num_running or s.num_waiting or prompt_tps or gen_tps)
            fields: dict[str, Any] = {
                "logger": "dspark.stats", "prompt_throughput_tps": round(prompt_tps, 2),
                "generation_throughput_tps": round(gen_tps, 2), "running": int(s.num_running),
                "waiting": int(s.num_waiting), "kv_cache_usage_pct": round(kv_pct, 2),
                "preemptions_total": int(s.num_preemptions), "interval_s": round(dt, 3)}
            drafted = int(getattr(s, "spec_draft_tokens", 0) or 0)
            if drafted:
                fields["spec_acceptance_rate"] = round(float(getattr(s, "spec_accepted_tokens", 0)) / drafted, 4)
            msg = (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} "
                   f"tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                   f"KV cache usage: {kv_pct:.1f}%")
            # Idle and idle before: DEBUG, so a quiet server does not fill its log (vLLM does the same).
            (log.info if active or was_active in (None, True) else log.debug)(msg, **fields)
            was_active = active


def start_stats_logger(engine: Any, metrics: Any, interval_s: float) -> StatsLogger | None:
    """Start the stats line every ``interval_s`` seconds; None (nothing started) when ``interval_s`` <= 0."""
    if interval_s <= 0:
        return None
    return StatsLogger(engine, metrics, float(interval_s)).start()


# -- what runs the model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeInfo:
    """The strings the startup log, and each trace's request span, report."""

    devices: list[str]  # devices holding a piece of the model: "cpu", "cuda:0" ...
    plugins: list[str]  # plugins loaded and taking calls
    plugins_used: list[str]  # plugins the engine's pieces run through (placement, dense offload, drafters)
    target: str  # e.g. "torch on cpu", "torch on cuda:0+cpu (placed)"

    @property
    def device(self) -> str:
        return "+".join(self.devices)

    @property
    def plugin(self) -> str:
        return "+".join(self.plugins_used)


def describe_runtime(engine: Any) -> RuntimeInfo:
    """What the engine reports of itself (:meth:`dspark.llm.AsyncLLMEngine.layout`), as the log and traces say it."""
    lay = engine.layout()
    return RuntimeInfo(devices=lay.devices, plugins=lay.plugins, plugins_used=lay.plugins_used, target=lay.target)


__all__ = ["GENERATION_PATHS", "Observability", "RequestObservability", "RuntimeInfo", "StatsLogger",
           "describe_runtime", "request_id_of", "start_stats_logger"]
