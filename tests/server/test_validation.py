"""Validation as OpenAI and vLLM do it, through the real server: context limits, strict types, finite
numbers, body size, huge prompts that must not stall other clients, and the tokenizer endpoints."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import wait_for

COMPLETION = {"model": "stdlib-llama", "prompt": "def add(a, b):", "max_tokens": 2}
CHAT = {"model": "stdlib-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server: Any, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60, **kw)


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {**COMPLETION, "max_tokens": 100000}),
    ("/v1/completions", {**COMPLETION, "max_tokens": 2**70}),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 100000}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**64}),
], ids=["completion-1e5", "completion-2^70", "chat-1e5", "chat-2^64"])
def test_max_tokens_beyond_the_context_is_400(server: Any, route: str, body: dict[str, Any]) -> None:
    def idle() -> bool:
        m = server.metrics()
        return m.value("dspark_requests_running") + m.value("dspark_requests_waiting") == 0

    wait_for(idle, 60, "the shared server to finish earlier tests' requests")
    before = server.metrics().value("dspark_generation_tokens_total")
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "maximum context length is 1024 tokens" in err["message"] and "in the completion" in err["message"]
    # Refused up front, not after generating: no token was generated (a count, not a clock).
    assert server.metrics().value("dspark_generation_tokens_total") == before


def test_max_tokens_that_fits_exactly_is_accepted(server: Any) -> None:
    ids = [5, 6, 7]
    r = post(server, "/v1/completions", {**COMPLETION, "prompt": ids, "max_tokens": 1024 - len(ids),
                                         "stream": True})
    assert r.status_code == 200


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {**COMPLETION, "stream": "yes"}, "stream"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "echo": "no"}, "echo"),
    ("/v1/completions", {**COMPLETION, "n": "2"}, "n"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages.0"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "system", "content": None}]}, "messages.0"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 5}, "min_tokens"),  # more than max_tokens
    ("/v1/completions", {**COMPLETION, "guided_regex": "[a-z]+", "guided_choice": ["a"]}, None),
], ids=["stream-str", "max_tokens-str", "echo-str", "n-str", "logprobs-str", "no-content", "null-content",
        "top_logprobs-without-logprobs", "bias-key", "bias-id", "min_tokens", "two-constraints"])
def test_strict_types_and_consistency_are_400(server: Any, route: str, body: dict[str, Any],
                                              param: str | None) -> None:
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_400_saying_so(server: Any, field: str, value: str) -> None:
    raw = f'{{"model": "stdlib-llama", "prompt": "x", "max_tokens": 2, "{field}": {value}}}'.encode()
    r = httpx.post(f"{server.base_url}/v1/completions", content=raw,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "finite number" in err["message"], err


def test_huge_prompt_is_refused_without_stalling_others(server: Any) -> None:
    """A 5 MB prompt: a quick 400, and /health answers promptly meanwhile."""
    prompt = "def f(x):\n    return x + 1\n" * (5_000_000 // 27)
    got: dict[str, Any] = {}

    def send() -> None:
        t0 = time.perf_counter()
        got["r"] = post(server, "/v1/completions", {**COMPLETION, "prompt": prompt})
        got["s"] = time.perf_counter() - t0

    th = threading.Thread(target=send)
    th.start()
    worst = 0.0
    while th.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.01)
    th.join()
    assert got["r"].status_code == 400 and got["r"].json()["error"]["code"] == "context_length_exceeded"
    # Judged against the request's own time, not a clock budget: a loop held by the 5 MB prompt
    # would keep /health waiting about as long as the request itself.
    assert worst < max(0.5 * got["s"], 1.0), (worst, got["s"])


def test_tokenizing_a_big_text_runs_off_the_event_loop(server: Any) -> None:
    """/tokenize takes seconds on 2 MB of text; the server keeps answering others meanwhile."""
    text = "import os\nprint(os.getcwd())\n" * (2_000_000 // 30)
    got: dict[str, Any] = {}

    def send() -> None:
        t0 = time.perf_counter()
        got["r"] = post(server, "/tokenize", {"prompt": text})
        got["s"] = time.perf_counter() - t0

    th = threading.Thread(target=send)
    th.start()
    lat: list[float] = []
    while th.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200
        lat.append(time.perf_counter() - t0)
        time.sleep(0.02)
    th.join()
    assert got["r"].status_code == 200 and got["r"].json()["count"] > 100_000
    # Tokenizing on the event loop would hold every /health call for its whole duration.
    assert len(lat) >= 3 and max(lat) < max(0.5 * got["s"], 0.3), (max(lat), got["s"], len(lat))


def test_tokenize_detokenize_version(server: Any, reference: Any) -> None:
    prompt = "def quick_sort(arr):"
    r = post(server, "/tokenize", {"model": "stdlib-llama", "prompt": prompt, "return_token_strs": True}).json()
    ids = reference.engine.encode(prompt)
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 1024
    assert "".join(r["token_strs"]) == "<s>" + prompt
    plain = post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == ids[1:]
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    back = post(server, "/detokenize", {"tokens": plain["tokens"]}).json()
    assert back["prompt"] == prompt
    bad = post(server, "/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    wrong = post(server, "/tokenize", {"model": "gpt-4", "prompt": "x"})
    assert wrong.status_code == 404
    import dspark

    v = httpx.get(f"{server.base_url}/version", timeout=10).json()
    assert v == {"version": dspark.__version__}


@pytest.fixture(scope="module")
def small_server(server_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return server_factory(tmp_path_factory.mktemp("limits"),
                          server={"host": "127.0.0.1", "port": 0, "timeout_graceful_shutdown_s": 2,
                                  "max_body_bytes": 65536, "cors_allow_origins": ["http://app.example"]})


def test_body_size_limit_is_413(small_server: Any) -> None:
    big = {**COMPLETION, "prompt": "x" * 70000}
    r = post(small_server, "/v1/completions", big)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "65536" in err["message"]

    def chunks() -> Any:  # no Content-Length: counted as it arrives
        import json

        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    r2 = httpx.post(f"{small_server.base_url}/v1/completions", content=chunks(),
                    headers={"Content-Type": "application/json"}, timeout=60)
    assert r2.status_code == 413
    ok = post(small_server, "/v1/completions", {**COMPLETION, "prompt": "x" * 1000})
    assert ok.status_code == 200  # under the limit: served as usual


def test_cors_when_configured(small_server: Any, server: Any) -> None:
    pre = httpx.options(f"{small_server.base_url}/v1/completions", timeout=10, headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    r = post(small_server, "/v1/completions", COMPLETION, headers={"Origin": "http://app.example"})
    assert r.headers["access-control-allow-origin"] == "http://app.example"
    other = post(small_server, "/v1/completions", COMPLETION, headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    off = post(server, "/v1/completions", COMPLETION, headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in off.headers  # off by default


def test_max_model_len_above_the_models_positions_fails_at_startup(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    cfg = tmp_path / "server_config.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"path": "default", "dtype": "float32"}, "server": {"port": 0},
                                   "engine": {"max_model_len": 999999}, "resources": {"enable_metrics": False}}))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dspark.server", "--config", str(cfg)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    assert "max_model_len 999999 exceeds the model's max_position_embeddings 1024" in out, out[-2000:]
    assert "Traceback" not in out
    assert time.perf_counter() - t0 < 60
