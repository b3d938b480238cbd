"""Graceful shutdown of the real server: SIGTERM drains, then ends what is left in-band, exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import wait_for

COMPLETION = {"model": "stdlib-llama", "prompt": "def add(a, b):", "temperature": 0, "ignore_eos": True}


@pytest.mark.timeout(120)
def test_sigterm_drains_then_ends_streams_with_an_error_and_done(server_factory: Any, tmp_path: Path) -> None:
    srv = server_factory(tmp_path, server={"host": "127.0.0.1", "port": 0, "timeout_graceful_shutdown_s": 2})
    long_events: list[str] = []
    short: dict[str, Any] = {}
    started = threading.Event()

    def long_stream() -> None:  # far longer than the drain time: it must be cut, cleanly
        body = {**COMPLETION, "max_tokens": 1000, "stream": True}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    long_events.append(line[5:].strip())
                    started.set()

    def short_request() -> None:  # finishes well inside the drain time
        short["r"] = httpx.post(f"{srv.base_url}/v1/completions", json={**COMPLETION, "max_tokens": 24}, timeout=60)

    def long_plain() -> None:  # not streamed and too long: answered 503
        short["plain"] = httpx.post(f"{srv.base_url}/v1/completions", json={**COMPLETION, "max_tokens": 1000},
                                    timeout=60)

    def in_engine() -> int:
        m = srv.metrics()
        return int(m.value("dspark_requests_running") + m.value("dspark_requests_waiting"))

    def until(cond: Any, what: str, timeout: float = 30.0) -> None:
        wait_for(cond, timeout, what, poll=0.02)

    t_long = threading.Thread(target=long_stream)
    t_long.start()
    assert started.wait(30)
    t_short = threading.Thread(target=short_request)
    t_short.start()
    t_plain = threading.Thread(target=long_plain)
    t_plain.start()
    # All three in the engine (the short one may have finished already: it is served either way).
    until(lambda: in_engine() >= (2 if "r" in short else 3), "the short and plain requests in flight")
    srv.proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            httpx.post(f"{srv.base_url}/v1/completions", json={**COMPLETION, "max_tokens": 2}, timeout=5)
        except httpx.TransportError:
            return True
        return False

    until(refused, "new connections refused")  # no longer accepting...
    assert t_long.is_alive()  # ...while the drain still holds the long stream open
    t_short.join(30)
    t_plain.join(30)
    t_long.join(30)
    code = srv.proc.wait(30)

    assert short["r"].status_code == 200 and short["r"].json()["usage"]["completion_tokens"] == 24
    plain = short["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "server_shutting_down", plain.text
    assert long_events[-1] == "[DONE]", long_events[-3:]
    err = json.loads(long_events[-2])["error"]
    assert err["code"] == "server_shutting_down" and err["type"] == "server_error"
    assert len(long_events) > 3  # it did stream before it was cut
    assert code == 0, code  # srv.proc.wait(30) above is the hang guard; the cut stream shows the drain ended it
    log = srv.log()
    text = srv.log_path.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    events = [e.get("event") for e in log]
    assert "Shutdown requested: draining open requests" in events
    assert "drain time over: ending the requests still open" in events
    stopped = log[-1]
    assert stopped["event"] == "DSpark server stopped"
    assert stopped["kv_cache_used_bytes"] == 0 and stopped["requests_running"] == 0  # the KV cache was released


@pytest.mark.timeout(60)
def test_sigterm_when_idle_or_with_work_that_finishes_exits_at_once(server_factory: Any, tmp_path: Path) -> None:
    srv = server_factory(tmp_path, server={"host": "127.0.0.1", "port": 0, "timeout_graceful_shutdown_s": 30})
    r = httpx.post(f"{srv.base_url}/v1/completions", json={**COMPLETION, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    t0 = time.monotonic()
    assert srv.stop() == 0
    assert time.monotonic() - t0 < 10  # the 30 s drain time is a bound, not a wait
    assert "Drained: every open request finished" in [e.get("event") for e in srv.log()]
