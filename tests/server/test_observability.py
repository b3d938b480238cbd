"""Request ids, the access log line, the stats line, the startup lines (the real server), and the
middleware's own corner cases (in process)."""

from __future__ import annotations

import json
import re
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
from fastapi import Request  # at module level: the handlers' string annotations resolve here

from dspark.server.observability import RequestObservability, StatsLogger, describe_runtime, start_stats_logger
from conftest import wait_for

PROMPT = "def quick_sort(arr):"
HEX32 = re.compile(r"[0-9a-f]{32}")


def _access_line(server: Any, rid: str, timeout: float = 5.0) -> dict[str, Any]:
    """The access line of request ``rid`` (written when its response ended, so maybe just after the client saw it)."""
    deadline = time.monotonic() + timeout
    while True:
        hits = [e for e in server.log() if e.get("logger") == "dspark.access" and e.get("request_id") == rid]
        if hits or time.monotonic() > deadline:
            assert len(hits) == 1, hits
            return hits[0]
        time.sleep(0.05)


def test_request_id_is_echoed_or_made(server: Any) -> None:
    with server.http() as c:
        r = c.get("/v1/models", headers={"X-Request-Id": "my-id-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "my-id-1"
        made = c.get("/v1/models").headers["x-request-id"]
        assert HEX32.fullmatch(made)
        assert c.get("/v1/models").headers["x-request-id"] != made
        # Not an id we echo (control characters, too long): a fresh one instead.
        for bad in ("x" * 200, "a b"):
            got = c.get("/health", headers={"X-Request-Id": bad}).headers["x-request-id"]
            assert HEX32.fullmatch(got)


@pytest.mark.parametrize("case", ["unknown model", "bad json", "unknown path", "wrong method", "too long"])
def test_request_id_on_errors(server: Any, case: str) -> None:
    rid = f"err-{uuid.uuid4().hex[:8]}"
    h = {"X-Request-Id": rid}
    with server.http() as c:
        r = {
            "unknown model": lambda: c.post("/v1/completions", json={"model": "nope", "prompt": "x"}, headers=h),
            "bad json": lambda: c.post("/v1/completions", content=b"{",
                                       headers={**h, "content-type": "application/json"}),
            "unknown path": lambda: c.get("/v2/nothing", headers=h),
            "wrong method": lambda: c.get("/v1/completions", headers=h),
            "too long": lambda: c.post("/v1/completions", headers=h, json={
                "model": server.model, "prompt": "word " * 5000, "max_tokens": 1}),
        }[case]()
    assert r.status_code >= 400 and "error" in r.json()
    assert r.headers["x-request-id"] == rid
    line = _access_line(server, rid)
    assert line["status"] == r.status_code and line["level"] == "info"


def test_request_id_and_access_line_of_a_stream(server: Any) -> None:
    rid = f"stream-{uuid.uuid4().hex[:8]}"
    with server.http() as c, c.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": rid}, json={
            "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        assert r.headers["x-request-id"] == rid
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    line = _access_line(server, rid)
    # No include_usage asked for, and the line has the counts all the same.
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions", 200)
    assert line["completion_tokens"] == 5 and line["prompt_tokens"] > 0


def test_access_line_fields(server: Any) -> None:
    rid = f"acc-{uuid.uuid4().hex[:8]}"
    with server.http() as c:
        t0 = time.perf_counter()
        r = c.post("/v1/completions", headers={"X-Request-Id": rid}, json={
            "model": server.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    usage = r.json()["usage"]
    line = _access_line(server, rid)
    # The server times the request after it arrives and logs the line after timing it: the span from before
    # sending to after the line is read holds it whatever the machine's load (the response can reach the
    # client before the server stops its clock, so the client's own round trip does not).
    took_ms = (time.perf_counter() - t0) * 1e3
    assert line["event"] == "POST /v1/completions 200"
    assert {k: line[k] for k in ("method", "path", "route", "status", "request_id", "prompt_tokens",
                                 "completion_tokens")} == {
        "method": "POST", "path": "/v1/completions", "route": "/v1/completions", "status": 200, "request_id": rid,
        "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]}
    assert 0 < line["latency_ms"] <= took_ms
    assert line["client"].startswith("127.0.0.1:") and line["level"] == "info" and "timestamp" in line
    # Probes and scrapes are DEBUG: not in an INFO log. A request after the probe is logged at INFO, after
    # the probe's line would have been: once its line is there, the probe's would be too.
    with server.http() as c:
        c.get("/health", headers={"X-Request-Id": rid + "-health"})
        c.get("/v1/models", headers={"X-Request-Id": rid + "-after"})
    assert _access_line(server, rid + "-after")["path"] == "/v1/models"
    assert not [e for e in server.log() if e.get("request_id") == rid + "-health"]


def test_startup_names_devices_plugins_and_target(server: Any) -> None:
    events = {e["event"].split(":")[0]: e for e in server.startup_log}
    plugins = events["Active plugins"]
    # The shared server runs decoder='auto': the winner of the decoder bids is the plugin used besides torch.
    winner = next(e for e in server.startup_log if e.get("event") == "llm.decoder.choice")["chosen"]
    plugin, _, device = winner.partition("@")
    used = ["torch"] if winner == "torch" else ["torch", plugin]
    assert "torch" in plugins["plugins"] and plugins["plugins_used"] == used
    assert plugins["seconds"] >= 0  # reported; how long it took is the machine's, not a verdict
    target = next(e for e in server.startup_log if e["event"].startswith("Model runs on"))
    if winner == "torch":
        assert target["devices"] == ["cpu"] and target["target"].startswith("torch on cpu")
    else:
        assert target["devices"] == [device] and target["target"].startswith(f"{winner} (")
    assert not [e for e in server.startup_log if e["event"].startswith("Tracing")]  # off by default


def _active(line: dict[str, Any]) -> bool:
    """A stats line of a server with work (the rule StatsLogger logs INFO by)."""
    return bool(line["running"] or line["waiting"] or line["prompt_throughput_tps"] or line["generation_throughput_tps"])


def test_stats_line(observed_server: Any) -> None:
    srv = observed_server  # it logs at DEBUG: the idle server's stats lines are in its log too, as "debug"

    def stats() -> list[dict[str, Any]]:
        return [e for e in srv.log() if e.get("logger") == "dspark.stats"]

    def until(cond: Any, what: str, timeout: float = 15.0) -> None:
        wait_for(cond, timeout, what, context=lambda: f"last lines {stats()[-6:]}")

    def idle_again(start: int) -> bool:
        """A line after ``start`` of a tick that found the server idle after an idle one (DEBUG): every
        token counted before ``start`` was reported by the lines before it."""
        return any(e["level"] == "debug" for e in stats()[start:])

    until(stats, "a first stats line")
    first = stats()[0]
    assert re.fullmatch(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                        r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%", first["event"])
    assert first["level"] == "info"  # the first line always is
    assert {"prompt_throughput_tps", "generation_throughput_tps", "running", "waiting", "kv_cache_usage_pct",
            "preemptions_total", "interval_s"} <= set(first)
    srv.wait_idle()
    start = len(stats())
    until(lambda: idle_again(start), "an idle line after an idle one")  # what follows is this test's request alone
    seen = len(stats())
    r = srv.openai().completions.create(model=srv.model, prompt=PROMPT, max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40
    # The engine can report no running request a line before the server has counted the last tokens it
    # streamed out; every token was counted before the answer came, so a tick after it that finds the
    # server idle twice comes after the line that reported the last of them.
    answered = len(stats())
    until(lambda: idle_again(answered), "an idle line after an idle one, after the answer")

    def generated(lines: list[dict[str, Any]]) -> float:
        return sum(e["generation_throughput_tps"] * e["interval_s"] for e in lines)

    # The log is read as the server writes it: wait until its lines report the request's tokens and
    # end on an idle tick after an idle one (DEBUG).
    until(lambda: (t := stats()[seen:]) and generated(t) >= 39 and t[-1]["level"] == "debug",
          "stats lines reporting the request's 40 tokens, then idle ones")
    tail = stats()[seen:]
    active = [i for i, e in enumerate(tail) if _active(e)]
    assert active and any(tail[i]["generation_throughput_tps"] > 0 for i in active), tail
    assert all(tail[i]["level"] == "info" for i in active), tail
    assert generated(tail) == pytest.approx(40, abs=1)
    assert sum(e["prompt_throughput_tps"] * e["interval_s"] for e in tail) == pytest.approx(
        r.usage.prompt_tokens, abs=1)
    # Idle again: the first idle line is INFO, the ones after it DEBUG (not in an INFO log).
    after = tail[active[-1] + 1:]
    assert after[0]["level"] == "info" and len(after) >= 2, tail
    assert all(e["level"] == "debug" for e in after[1:]), tail


# -- in process ---------------------------------------------------------------------------------


@pytest.fixture
def logs() -> Any:
    """Every structlog event at any level, as dicts (the default level, WARNING, would drop INFO)."""
    from dspark.host import log

    log.configure(level="DEBUG")
    try:
        with structlog.testing.capture_logs(processors=[structlog.contextvars.merge_contextvars]) as captured:
            yield captured
    finally:
        log.configure()


def _app(tracer: Any = None) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"error": {"message": "internal server error"}}, status_code=500)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    @app.get("/state")
    async def state(request: Request) -> dict[str, Any]:
        structlog.get_logger("t").info("inside")
        return {"request_id": request.state.request_id}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body() -> Any:
            yield b"a"
            yield b"b"

        return StreamingResponse(body())

    app.add_middleware(RequestObservability, access_log=True, tracer=tracer)
    return app


def test_unhandled_error_is_a_500_with_the_id(logs: list[dict[str, Any]]) -> None:
    from fastapi.testclient import TestClient

    with TestClient(_app(), raise_server_exceptions=False) as c:
        r = c.get("/boom", headers={"X-Request-Id": "crash-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "crash-1"
    assert r.json() == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                                  "code": None}}
    access = [e for e in logs if e.get("logger") == "dspark.access"]
    assert [(e["status"], e["request_id"]) for e in access] == [(500, "crash-1")]


def test_handlers_see_the_id_and_log_lines_carry_it(logs: list[dict[str, Any]]) -> None:
    from fastapi.testclient import TestClient

    with TestClient(_app()) as c:
        assert c.get("/state", headers={"X-Request-Id": "st-1"}).json() == {"request_id": "st-1"}
        r = c.get("/stream", headers={"X-Request-Id": "st-2"})
    assert r.text == "ab" and r.headers["x-request-id"] == "st-2"
    inside = next(e for e in logs if e["event"] == "inside")
    assert inside["request_id"] == "st-1"


class _FakeEngine:
    def __init__(self) -> None:
        self.running = 0

    def stats(self) -> Any:
        return SimpleNamespace(num_running=self.running, num_waiting=2, kv_usage=0.25, num_preemptions=3,
                               spec_draft_tokens=10, spec_accepted_tokens=7)


def test_stats_logger_rates_and_stop(logs: list[dict[str, Any]]) -> None:
    eng, metrics = _FakeEngine(), SimpleNamespace(live_prompt_tokens=0, live_generation_tokens=0)
    assert start_stats_logger(eng, metrics, 0) is None
    eng.running = 1
    s = start_stats_logger(eng, metrics, 0.05)
    assert isinstance(s, StatsLogger)

    def stats_lines() -> list[dict[str, Any]]:
        return [e for e in list(logs) if e.get("logger") == "dspark.stats"]

    def reported(key: str) -> float:
        return sum(e[key] * e["interval_s"] for e in stats_lines())

    def until(cond: Any, what: str) -> None:
        wait_for(cond, 30, what, poll=0.01, context=stats_lines)

    # Tokens come once the logger has read its starting counts (its first line is written after that).
    until(stats_lines, "a first stats line")
    metrics.live_prompt_tokens, metrics.live_generation_tokens = 100, 50
    until(lambda: reported("prompt_throughput_tps") > 90 and reported("generation_throughput_tps") > 45,
          "the tokens reported")
    s.stop()
    assert s._thread is not None and not s._thread.is_alive()  # stopped means stopped: nothing logs any more
    lines = stats_lines()
    assert len(lines) > 1
    assert sum(e["prompt_throughput_tps"] * e["interval_s"] for e in lines) == pytest.approx(100, rel=0.02)
    assert sum(e["generation_throughput_tps"] * e["interval_s"] for e in lines) == pytest.approx(50, rel=0.02)
    e = lines[0]
    assert (e["running"], e["waiting"], e["kv_cache_usage_pct"], e["spec_acceptance_rate"]) == (1, 2, 25.0, 0.7)
    assert "Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%" in e["event"]


def test_describe_runtime_of_a_plain_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from pathlib import Path

    from dspark.host.plugin_manager import PluginHost
    from dspark.llm import AsyncLLMEngine

    hooks: list[str] = []  # every hook asked of the plugins: none (an import each, no device probing)
    real_call, real_call_all = PluginHost.call, PluginHost.call_all

    def call(self: PluginHost, name: str, hook: str, **kwargs: Any) -> Any:
        hooks.append(hook)
        return real_call(self, name, hook, **kwargs)

    def call_all(self: PluginHost, hook: str, names: Any = None, **kwargs: Any) -> dict[str, Any]:
        hooks.append(hook)
        return real_call_all(self, hook, names, **kwargs)

    monkeypatch.setattr(PluginHost, "call", call)
    monkeypatch.setattr(PluginHost, "call_all", call_all)
    model = Path(__file__).resolve().parents[2] / "core" / "dspark" / "assets" / "models" / "stdlib-llama"
    engine = AsyncLLMEngine.from_pretrained(model, dtype="float32", decoder="torch")
    try:
        rt = describe_runtime(engine)  # through the engine's own layout(), nothing read off its insides
    finally:
        engine.shutdown()
    assert hooks == []
    assert rt.devices == ["cpu"] and rt.plugins_used == ["torch"] and rt.target == "torch on cpu (float32)"
    assert "torch" in rt.plugins and rt.device == "cpu" and rt.plugin == "torch"


def test_describe_runtime_of_a_placed_engine() -> None:
    from dspark.llm.assembly.layout import describe
    from dspark.llm.device_map.pieces import DeviceMap, Piece

    def piece(dev: str, plugin: str) -> Piece:
        return Piece("p", dev, plugin, plugin, weight_bytes=1)

    placed = DeviceMap(embed=piece("cpu", "torch"), layers=[piece("cuda:0", "cuda"), piece("cpu", "cpu")],
                       head=piece("cuda:0", "cuda"), runs={"cpu": "torch", "cuda:0": "torch"})
    host = SimpleNamespace(active=lambda: ["torch", "cuda", "cpu"])
    spec = SimpleNamespace(host=host, handles=[SimpleNamespace(plugin="ngram")])
    eng = SimpleNamespace(device_map=placed, dense_offload=None, dense_offload_decision=None,
                          runner=SimpleNamespace(dtype="torch.float16"), quant_plan=None, spec=spec,
                          plugin_host=host)
    rt = describe_runtime(SimpleNamespace(layout=lambda: describe(eng)))
    assert rt.devices == ["cpu", "cuda:0"] and rt.plugins == ["torch", "cuda", "cpu"]
    assert rt.plugins_used == ["torch", "cuda", "cpu", "ngram"]
    assert rt.target == ("torch on cpu+cuda:0 (layers mapped by the placer: torch@cuda:0[0:1] + torch@cpu[1:2]) "
                         "(float16)")
    assert json.dumps(rt.__dict__)  # plain strings: fit for logs and span attributes
