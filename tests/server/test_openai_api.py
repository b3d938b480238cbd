"""The /v1 API through the official ``openai`` client against the real server process.

Expected texts come from the same model run in this process (``reference``),
never from literals: the server must return exactly what the engine generates.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import openai
import pytest

from dspark.llm import SamplingParams

PROMPT = "def quick_sort(arr):"
CHAT = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]


def greedy(reference: Any, prompt: str | list[int], max_tokens: int = 24, **kw: Any) -> Any:
    return reference.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, **kw))[0]


def sse_events(resp: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    body = resp.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), body[:500]
    return [e[len("data: "):] for e in events]


def test_the_decoder_target_is_chosen_and_logged(server: Any) -> None:
    line = next(x for x in server.startup_log if str(x.get("event", "")).startswith("Model runs on "))
    choice = next(x for x in server.startup_log if x.get("event") == "llm.decoder.choice")
    ranked = [r[0] for r in choice["ranked"]]
    assert choice["chosen"] == ranked[0] and "torch" in ranked, choice
    assert line["target"].startswith(choice["chosen"]), line  # the start-up line names the winner and why
    if choice["chosen"] != "torch":
        assert "measured fastest (beat" in line["target"]


def test_models_and_health(server: Any) -> None:
    choice = next(x for x in server.startup_log if x.get("event") == "llm.decoder.choice")
    client = server.openai()
    assert [m.id for m in client.models.list().data] == [server.model]
    card = client.models.retrieve(server.model)
    assert card.id == server.model and card.object == "model"
    h = httpx.get(f"{server.base_url}/health").json()
    assert h["status"] == "ok" and h["model"] == server.model
    assert h["decoder"] == choice["chosen"] and h["decoder_failovers"] == 0, h  # what runs the model now
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_matches_engine(server: Any, reference: Any) -> None:
    ref = greedy(reference, PROMPT)
    r = server.openai().completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.model == server.model and len(r.choices) == 1
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (ref.usage.prompt_tokens, ref.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_stream_matches_engine(server: Any, reference: Any) -> None:
    """The seed's client call, streamed: deltas join to the engine's text; a usage chunk; [DONE]."""
    ref = greedy(reference, PROMPT, max_tokens=32)
    stream = server.openai().completions.create(model=server.model, prompt=PROMPT, max_tokens=32, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "text_completion" for c in chunks) and len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == ref.finish_reason and not any(reasons[:-1])
    assert len(chunks) >= 3, "text must arrive in pieces, not all at the end"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens


def test_sse_wire_format(server: Any) -> None:
    with server.http() as c, c.stream("POST", "/v1/completions", json={
            "model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    assert parsed[-1]["choices"][0]["finish_reason"] == "length"
    assert all(set(p) >= {"id", "object", "created", "model", "choices"} for p in parsed)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_uses_the_checkpoint_template(server: Any, reference: Any, stream: bool) -> None:
    """The prompt is the tokenizer's own chat template, as transformers renders it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(_model_dir())
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    ref = greedy(reference, ids, max_tokens=20)
    client = server.openai()
    if not stream:
        r = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=20, temperature=0)
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
        return
    chunks = list(client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.prompt_tokens == len(ids)


def _model_dir() -> str:
    from dspark.llm import default_model_path

    return str(default_model_path())


def test_chat_content_parts_equal_plain_content(server: Any) -> None:
    """Text parts are joined; top_k=1 (an extension) is greedy whatever the temperature."""
    client = server.openai()
    kw: dict[str, Any] = dict(model=server.model, max_completion_tokens=8, temperature=1.0, extra_body={"top_k": 1})
    parts = [{"type": "text", "text": "Sort "}, {"type": "text", "text": "a list."}]
    a = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **kw)
    b = client.chat.completions.create(messages=[{"role": "user", "content": "Sort a list."}], **kw)
    assert a.choices[0].message.content == b.choices[0].message.content and a.usage == b.usage
    assert 1 <= a.usage.completion_tokens <= 8


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_before_it(server: Any, reference: Any, stream: bool) -> None:
    full = greedy(reference, PROMPT, max_tokens=40).text
    stop = full[12:15]
    cut = full[: full.find(stop)]
    assert stop and len(cut) < len(full)
    client = server.openai()
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "\x00never"])
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (text, reason) == (cut, "stop")


def test_seeded_sampling_n_choices(server: Any, reference: Any) -> None:
    """n choices use seeds seed, seed+1, ...: reproducible, each equal to the engine's own seeded run."""
    client = server.openai()
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95)
    a = client.completions.create(n=3, seed=7, **kw)
    b = client.completions.create(n=3, seed=7, **kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2] and texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1, "different seeds per choice"
    ref = [reference.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i))[0]
           for i in range(3)]
    assert texts == [o.text for o in ref]
    assert a.usage.completion_tokens == sum(len(o.token_ids) for o in ref)
    assert a.usage.prompt_tokens == ref[0].usage.prompt_tokens  # a prompt counts once, however many choices
    single = client.completions.create(n=1, seed=8, **kw)
    assert single.choices[0].text == texts[1]


def test_max_tokens_ignore_eos_and_echo(server: Any, reference: Any) -> None:
    client = server.openai()
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True}, echo=True)
    ref = greedy(reference, PROMPT, max_tokens=7, ignore_eos=True)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    assert r.choices[0].text == PROMPT + ref.text


def test_batched_prompts_and_token_ids(server: Any, reference: Any) -> None:
    """OpenAI's batch form: choices are prompt-major, n per prompt; token-id prompts work too."""
    prompts = [PROMPT, "import os\n"]
    r = server.openai().completions.create(model=server.model, prompt=prompts, max_tokens=10, temperature=0, n=2)
    refs = [greedy(reference, p, max_tokens=10).text for p in prompts]
    assert [c.text for c in r.choices] == [refs[0], refs[0], refs[1], refs[1]]
    ids = reference.engine.encode(PROMPT)
    r2 = server.openai().completions.create(model=server.model, prompt=ids, max_tokens=10, temperature=0)
    assert r2.choices[0].text == refs[0] and r2.usage.prompt_tokens == len(ids)


def test_top_p_zero_is_greedy(server: Any, reference: Any) -> None:
    r = server.openai().completions.create(model=server.model, prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0)
    assert r.choices[0].text == greedy(reference, PROMPT, max_tokens=10).text


def test_concurrent_streams_complete_with_the_sequential_output(server: Any, reference: Any) -> None:
    prompts = [PROMPT, "import os\n", "class Stack:", "for i in range(", "def __init__(self",
               "# Copyright", "return self.", "try:\n    import"]
    refs = [greedy(reference, p, max_tokens=24).text for p in prompts]
    client = server.openai()
    got: dict[int, str] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        try:
            barrier.wait()
            parts = [c.choices[0].text for c in client.completions.create(
                model=server.model, prompt=prompts[i], max_tokens=24, temperature=0, stream=True)]
            got[i] = "".join(parts)
        except BaseException as e:  # surfaced below, with the others
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [got.get(i) for i in range(len(prompts))] == refs
    server.wait_idle()


# -- errors ------------------------------------------------------------------------------------------


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize(("route", "body", "param", "code"), [
    ("completions", {"prompt": "x", "max_tokens": "lots"}, "max_tokens", None),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature", None),
    ("completions", {"prompt": "x", "n": 1000}, "n", None),
    ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", None),
    ("completions", {"prompt": "x", "max_tokenz": 2}, "max_tokenz", None),
    ("completions", {"prompt": "x", "stop": [""]}, "stop", None),
    ("completions", {"prompt": [99999]}, "prompt", None),
    ("completions", {"prompt": "x", "seed": 2**70}, "seed", None),
    ("completions", {"prompt": "x " * 1500}, "prompt", "context_length_exceeded"),
    ("completions", {"prompt": "x", "max_tokens": 2000, "stream": True}, "max_tokens", "context_length_exceeded"),
    ("completions", {"prompt": "x", "max_tokens": 1000, "stream": True}, None, None),  # fits: served
    ("chat/completions", {"messages": []}, "messages", None),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, "logprobs", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools", None),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 1500}], "stream": True}, "messages",
     "context_length_exceeded"),
])
def test_bad_input_is_a_400_naming_the_field(server: Any, route: str, body: dict[str, Any], param: str | None,
                                             code: str | None) -> None:
    with server.http() as c:
        if param is None:  # the control case: valid and served (closed at once: an abort)
            with c.stream("POST", f"/v1/{route}", json={"model": server.model, **body}) as r:
                assert r.status_code == 200
            server.wait_idle()
            return
        err = _error(c.post(f"/v1/{route}", json={"model": server.model, **body}), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert param.split(".")[0] in err["message"] or code is not None


def test_error_statuses(server: Any) -> None:
    with server.http() as c:
        err = _error(c.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"}), 404)
        assert (err["param"], err["code"]) == ("model", "model_not_found")
        _error(c.post("/v1/completions", content=b'{"model": "x", "prompt": ', headers={"content-type": "application/json"}), 400)
        _error(c.post("/v1/completions", content=b"\xff\xfe", headers={"content-type": "application/json"}), 400)
        _error(c.post("/v1/chat/completions", json=[1, 2]), 400)
        _error(c.get("/v1/nothing-here"), 404)
        _error(c.get("/v1/completions"), 405)
        _error(c.post("/v1/completions", content=b"", headers={"content-type": "application/json"}), 400)

        def raw(route: str, body: dict[str, Any]) -> httpx.Response:  # json.dumps escapes lone surrogates
            return c.post(route, content=json.dumps(body).encode(), headers={"content-type": "application/json"})

        assert _error(raw("/v1/completions", {"model": server.model, "prompt": "\ud800"}), 400)["param"] == "prompt"
        chat = {"model": server.model, "messages": [{"role": "user", "content": "\udfff"}]}
        assert _error(raw("/v1/chat/completions", chat), 400)["param"] == "messages"
        _error(raw("/v1/completions", {"model": "m\ud800", "prompt": "x"}), 404)
    with pytest.raises(openai.NotFoundError) as e:
        server.openai().chat.completions.create(model="nope", messages=CHAT)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e2:
        server.openai().completions.create(model=server.model, prompt="x", max_tokens=-5)
    assert e2.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_openapi_spec_documents_400_not_422(server: Any) -> None:
    spec = httpx.get(f"{server.base_url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = spec["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404"} <= set(responses) and "422" not in responses
