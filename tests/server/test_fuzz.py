"""Fuzz the HTTP API of the real server process: no input may produce a 5xx or take the server down.

Two sources of input:

* schemathesis, from the server's own OpenAPI spec (``/openapi.json``):
  positive cases (valid by the schema) and negative ones (each violating it
  somewhere), for every operation, a bounded, derandomized number of each.
  Bodies are bounded before sending (max_tokens, n and prompt-list length)
  so a valid case generates a handful of tokens, not a context's worth.
* hand-written malformed requests: invalid JSON, wrong top-level types,
  wrong types for every field, huge and negative numbers, unknown model, odd
  content types and encodings. These must be a 4xx with OpenAI's error body.

After each group the server must answer /health, and end idle with no KV page held.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

MAX_TOKENS = 4  # what a valid fuzzed request may generate at most, per sequence
TINY = 1e-30  # a temperature below ~1.4e-45 breaks the sampler (see test_tiny_sampling_values_are_not_5xx)


def bound(body: Any, model: str | None) -> None:
    """Keep a schema-valid body cheap to serve; leave everything the server should reject untouched.

    ``model``: the served name, put into positive cases (the schema allows any string; nearly all would be 404).
    """
    if not isinstance(body, dict):
        return
    if model is not None and isinstance(body.get("model"), str):
        body["model"] = model
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        # Huge values are a 400 (test_wrong_types_and_values_are_4xx covers them without generating them out).
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_TOKENS:
            body[key] = MAX_TOKENS
    for key in ("temperature", "top_p"):
        v = body.get(key)
        if isinstance(v, (int, float)) and 0 < v < TINY:
            body[key] = 0.0  # known engine fault, pinned by test_tiny_sampling_values_are_not_5xx
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # chat's default is the rest of the context
    if type(body.get("min_tokens")) is int and body["min_tokens"] > MAX_TOKENS:
        body["min_tokens"] = MAX_TOKENS
    if type(body.get("n")) is int and body["n"] > 2:
        body["n"] = 2
    if isinstance(body.get("prompt"), list) and len(body["prompt"]) > 3:
        body["prompt"] = body["prompt"][:3]


@pytest.fixture(scope="module")
def api_schema(server: Any) -> Any:
    spec = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    return schemathesis.openapi.from_dict(spec)


def alive(server: Any) -> None:
    r = httpx.get(f"{server.base_url}/health", timeout=30)
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert server.proc.poll() is None


P, N = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
# The GET routes have no body or query; negative data exists only for the POST bodies.
OPERATIONS = [("POST", "/v1/completions", 50, P), ("POST", "/v1/completions", 50, N),
              ("POST", "/v1/chat/completions", 50, P), ("POST", "/v1/chat/completions", 50, N),
              ("GET", "/v1/models/{model_id}", 20, P), ("GET", "/v1/models", 3, P), ("GET", "/health", 3, P)]


@pytest.mark.slow
@pytest.mark.parametrize("method,path,examples,mode", OPERATIONS, ids=[f"{m} {p} {g}" for m, p, _, g in OPERATIONS])
def test_schemathesis_cases_never_5xx(server: Any, api_schema: Any, method: str, path: str, examples: int,
                                      mode: GenerationMode) -> None:
    op = api_schema[path][method]
    statuses: Counter[int] = Counter()

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        bound(case.body, server.model if mode == P else None)
        resp = case.call(base_url=server.base_url, timeout=60)
        statuses[resp.status_code] += 1
        assert resp.status_code < 500, (resp.status_code, resp.text[:500], case.as_curl_command(
            base_url=server.base_url))

    check()
    alive(server)
    # The cases reached the server's logic, not just its router: valid ones succeeded, invalid ones were refused.
    if mode == P and path != "/v1/models/{model_id}":
        assert statuses[200] > 0, statuses
    if mode == N and method == "POST":
        assert sum(v for k, v in statuses.items() if 400 <= k < 500) > 0, statuses


COMPLETION = {"model": "stdlib-llama", "prompt": "def add(a, b):", "max_tokens": 2}
CHAT = {"model": "stdlib-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# Field -> values that are wrong for it (type or range); each is sent in an otherwise valid body and must be a 4xx.
WRONG_COMPLETION: dict[str, list[Any]] = {
    "model": [None, 123, ["stdlib-llama"], {"id": "stdlib-llama"}, "", "gpt-4o"],
    "prompt": [None, 123, 1.5, {"text": "x"}, [], [[]], [None], [1.5], [-1], [2**31], [2**31 - 1],
               [[1, 2], "mixed"], "x " * 4000],
    "max_tokens": [1.5, -1, 0, [8], {"n": 8}, "8", 2000, 2**31, 2**64, 10**30],
    "temperature": ["hot", -0.1, 2.5, 1e308, [1]],
    "top_p": ["all", -1, 1.01, {}],
    "n": [0, -3, 65, 1.5, 10**20, "2"],
    "stream": [2, [True], {}, "yes"],
    "stream_options": [True, "x", [], {"include_usage": "maybe"}, {"bogus": 1}],
    "stop": ["", [""], [1], ["x"] * 17, "x" * 600, {"s": 1}],
    "seed": [2**63, -(2**63) - 1, 10**30, 1.5, "1"],
    "top_k": [-2, 2.5, "3"],
    "ignore_eos": [[1], {}, "yes"],
    "stop_token_ids": [[-1], "1", [1.5], [None], list(range(100))],
    "logit_bias": [{"x": 5}, {"1": 101}, {"99999": 1}, {"1": "5"}, [1], "x"],
    "logprobs": [21, -1, True, "x", 1.5],
    "echo": [[1], "no"],
    "best_of": [2, 0, "x"],
    "suffix": ["tail", 5],
    "presence_penalty": [2.5, -3, "x"],
    "frequency_penalty": [-2.5, [], "0.5"],
    "repetition_penalty": [0, -1, 101, "x"],
    "min_tokens": [-1, 3, 1.5],  # 3 > max_tokens 2
    "response_format": [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {}},
                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
                        "json"],
    "guided_regex": ["(unclosed", "", 5],
    "guided_grammar": ["root ::= ", "not a grammar", 5],
    "guided_choice": [[], [""], "a", [1]],
    "guided_json": [5, "{not json"],
    "user": [5, []],
    "unknown_field": [1, "x", None],
}
WRONG_CHAT: dict[str, list[Any]] = {
    "messages": [None, [], "hi", [None], ["hi"], [{"role": "user"}, 5], [{"role": "bogus", "content": "x"}],
                 [{"role": "user", "content": 123}], [{"role": "user", "content": [{"type": "image_url"}]}],
                 [{"content": "x"}], [{"role": "user", "content": "x", "extra": 1}]],
    "max_tokens": [-1, 0],
    "max_completion_tokens": [-1, 0, 1.5, 10**30, 2000, "2"],
    "tools": [[{"type": "function"}], "x"],
    "tool_choice": ["auto", 1],
    "response_format": [{"type": "xml"}, "json", {}],
    "logprobs": ["true", 1],
    "top_logprobs": [3, "x", 21],  # 3 without logprobs: true
    "n": [0, 100],
    "add_generation_prompt": ["x", [1]],
}


def _cases() -> list[tuple[str, str, Any]]:
    cases: list[tuple[str, str, Any]] = []
    for path, base, wrong in (("/v1/completions", COMPLETION, WRONG_COMPLETION),
                              ("/v1/chat/completions", CHAT, WRONG_CHAT)):
        for field, values in wrong.items():
            for v in values:
                cases.append((path, f"{field}={json.dumps(v)[:40]}", {**base, field: v}))
        for top in (None, [], [base], "string", 123, True):  # not an object
            cases.append((path, f"body={json.dumps(top)[:40]}", top))
        cases.append((path, "missing model", {k: v for k, v in base.items() if k != "model"}))
    return cases


def _ids(cases: list[tuple[str, str, Any]]) -> list[str]:
    return [f"{p.rsplit('/', 1)[1]}-{w}" for p, w, _ in cases]


@pytest.mark.parametrize("path,what,body", _cases(), ids=_ids(_cases()))
def test_wrong_types_and_values_are_4xx(server: Any, path: str, what: str, body: Any) -> None:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and err["type"], err


# Valid requests using the sampling and output-constraint parameters, each alone and mixed.
MIX: list[dict[str, Any]] = [
    {"logprobs": 3}, {"logprobs": 0, "echo": True}, {"presence_penalty": 1.5, "frequency_penalty": -0.5},
    {"repetition_penalty": 1.3, "min_tokens": 2}, {"logit_bias": {"5": 100, "6": -100}},
    {"response_format": {"type": "json_object"}}, {"guided_regex": "[a-z]{1,8}"},
    {"guided_choice": ["yes", "no"]}, {"guided_grammar": 'root ::= "a" | "b"'},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}},
    {"logprobs": 2, "presence_penalty": 0.5, "logit_bias": {"7": 3}, "guided_regex": "[0-9]+", "n": 2,
     "temperature": 0.8, "seed": 3},
]


@pytest.mark.parametrize("extra", MIX, ids=[",".join(m) for m in MIX])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_new_parameters_in_the_mix_are_served(server: Any, extra: dict[str, Any], stream: bool) -> None:
    body = {**COMPLETION, "max_tokens": 3, **extra, "stream": stream}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text[-300:]
    chat = {**CHAT, **{k: v for k, v in extra.items() if k not in ("logprobs", "echo")}, "stream": stream}
    if "logprobs" in extra:
        chat.update(logprobs=True, top_logprobs=extra["logprobs"])
    r2 = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60)
    assert r2.status_code == 200, r2.text[:300]


RAW: list[tuple[str, bytes, str]] = [
    ("/v1/completions", b'{"model": "stdlib-llama", "prompt": ', "application/json"),  # truncated
    ("/v1/completions", b"", "application/json"),
    ("/v1/completions", b"not json at all", "application/json"),
    ("/v1/completions", b'{"model": "stdlib-llama", "prompt": "x",}', "application/json"),  # trailing comma
    ("/v1/completions", b'{"model": "stdlib-llama", "prompt": "x", "max_tokens": 2, "temperature": NaN}',
     "application/json"),
    ("/v1/completions", b'{"model": "stdlib-llama", "prompt": "x", "max_tokens": Infinity}', "application/json"),
    ("/v1/completions", b'{"model": "\xff\xfe", "prompt": "x"}', "application/json"),  # not UTF-8
    ("/v1/completions", json.dumps(COMPLETION).encode(), "text/plain"),
    ("/v1/completions", b"model=stdlib-llama&prompt=x", "application/x-www-form-urlencoded"),
    ("/v1/completions", b'{"model": ' + b"[" * 20000 + b"]" * 20000 + b"}", "application/json"),  # deep nesting
    ("/v1/chat/completions", b'{"messages": [', "application/json"),
    ("/v1/chat/completions", b"[1, 2, 3]", "application/json"),
    ("/v1/chat/completions", json.dumps(CHAT).encode(), "application/xml"),
]


# A lone UTF-16 surrogate is valid JSON (RFC 8259 allows the escape) but no Unicode text.
SURROGATES: list[tuple[str, bytes]] = [
    ("/v1/completions", b'{"model": "stdlib-llama", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("/v1/completions", b'{"model": "stdlib-llama", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"model": "stdlib-llama", "messages": [{"role": "user", "content": "\\ud83d"}], '
                             b'"max_tokens": 2}'),
]


@pytest.mark.parametrize("path,raw", SURROGATES, ids=["prompt", "prompt-list", "chat"])
def test_lone_surrogate_in_text_is_4xx(server: Any, path: str, raw: bytes) -> None:
    r = httpx.post(f"{server.base_url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {**CHAT, "temperature": 1e-39}),  # logits / T would overflow float32
    ("/v1/completions", {**COMPLETION, "top_p": 1e-50}),  # rounds to 0: every token would be dropped
    ("/v1/completions", {**COMPLETION, "temperature": 1e-300}),  # 0 in float32: greedy, never 0/0
], ids=["temperature-overflow", "top_p-underflow", "temperature-underflow"])
def test_tiny_sampling_values_are_not_5xx(server: Any, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert r.status_code < 500, (r.status_code, r.text[:300])


def test_one_clients_bad_request_does_not_fail_another(server: Any) -> None:
    import threading

    got: list[str] = []

    def stream_long() -> None:
        body = {**COMPLETION, "max_tokens": 64, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            got.extend(line for line in r.iter_lines() if line.startswith("data:"))

    th = threading.Thread(target=stream_long)
    th.start()
    deadline = time.monotonic() + 30
    while not got and time.monotonic() < deadline:  # the long request is being decoded
        time.sleep(0.01)
    httpx.post(f"{server.base_url}/v1/completions", json={**COMPLETION, "temperature": 1e-300}, timeout=60)
    th.join(60)
    assert got and got[-1] == "data: [DONE]"
    assert not [x for x in got if '"error"' in x], [x for x in got if '"error"' in x]
    server.wait_idle(timeout=15)


@pytest.mark.parametrize("path,raw,ctype", RAW, ids=[f"{i}-{p.rsplit('/', 1)[1]}" for i, (p, _, _) in enumerate(RAW)])
def test_malformed_bodies_are_4xx(server: Any, path: str, raw: bytes, ctype: str) -> None:
    r = httpx.post(f"{server.base_url}{path}", content=raw, headers={"Content-Type": ctype}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.json()["error"]["message"]


@pytest.mark.parametrize("method,path", [("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"),
                                         ("DELETE", "/v1/models"), ("POST", "/health"), ("GET", "/v1/nope"),
                                         ("GET", "/v1/models/no-such-model"), ("GET", "/v1/models/%ff%fe")])
def test_wrong_method_or_route_is_4xx(server: Any, method: str, path: str) -> None:
    r = httpx.request(method, f"{server.base_url}{path}", timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])


def test_server_survives_and_ends_idle(server: Any) -> None:
    # Runs after the cases above (file order): the process is up, serves a normal request, and holds nothing.
    alive(server)
    r = httpx.post(f"{server.base_url}/v1/completions", json={**COMPLETION, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    server.wait_idle(timeout=15)
