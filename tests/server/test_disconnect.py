"""A client that goes away mid-request aborts its sequences and their KV pages come back."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

BODY = {"prompt": "def quick_sort(arr):", "max_tokens": 800, "temperature": 0, "ignore_eos": True}


def _aborts(m: Any) -> float:
    return m.value("dspark_requests_finished_total", 0.0, finish_reason="abort")


@pytest.mark.parametrize(("route", "extra", "n"), [
    ("completions", {}, 1),
    ("completions", {"n": 3}, 3),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 1),
])
def test_closing_a_stream_aborts_and_frees_pages(server: Any, route: str, extra: dict[str, Any], n: int) -> None:
    before = _aborts(server.wait_idle())
    body = {"model": server.model, "stream": True, **BODY, **extra}
    if route.startswith("chat"):
        body.pop("prompt")
    with server.http() as c, c.stream("POST", f"/v1/{route}", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = 0
        while events < 2 + n:
            events += next(lines).startswith("data: ")
        busy = server.metrics()
        assert busy.value("dspark_requests_running") == n and busy.value("dspark_kv_cache_used_bytes") > 0
    # Closed after a few chunks, long before 800 tokens: everything is released within moments.
    after = server.wait_idle(timeout=5)
    assert _aborts(after) - before == n


def test_non_streaming_client_timeout_aborts(server: Any) -> None:
    before = _aborts(server.wait_idle())
    with server.http(timeout=0.5) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"model": server.model, **BODY})
    after = server.wait_idle(timeout=5)
    assert _aborts(after) - before == 1


def test_server_keeps_serving_after_disconnects(server: Any) -> None:
    r = server.openai().completions.create(model=server.model, prompt="import os\n", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
