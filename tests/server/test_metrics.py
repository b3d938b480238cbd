"""/metrics on the metrics port, parsed with prometheus-client's parser, against what requests did."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from dspark.llm import RequestOutput, SamplingParams

PROMPT = "def quick_sort(arr):"
FAMILIES = {
    "dspark_requests_running": "gauge", "dspark_requests_waiting": "gauge",
    "dspark_kv_cache_used_bytes": "gauge", "dspark_kv_cache_total_bytes": "gauge",
    "dspark_kv_cache_usage_ratio": "gauge", "dspark_kv_cache_fragmentation_ratio": "gauge",
    "dspark_preemptions": "counter", "dspark_decoder_failovers": "counter", "dspark_decoder_info": "gauge",
    "dspark_time_to_first_token_seconds": "histogram", "dspark_time_per_output_token_seconds": "histogram",
    "dspark_e2e_request_latency_seconds": "histogram",
    "dspark_prompt_tokens": "counter", "dspark_generation_tokens": "counter",
    "dspark_spec_decode_drafts": "counter", "dspark_spec_decode_draft_tokens": "counter",
    "dspark_spec_decode_accepted_tokens": "counter", "dspark_spec_decode_acceptance_rate": "gauge",
    "dspark_device_memory_used_bytes": "gauge", "dspark_device_memory_total_bytes": "gauge",
    "dspark_partition_latency_seconds": "histogram", "dspark_requests_finished": "counter",
    "dspark_http_requests": "counter",
    "dspark_inter_token_latency_seconds": "histogram", "dspark_request_queue_time_seconds": "histogram",
    "dspark_request_prefill_time_seconds": "histogram", "dspark_request_decode_time_seconds": "histogram",
    "dspark_request_prompt_tokens": "histogram", "dspark_request_generation_tokens": "histogram",
}


def test_families_and_types(server: Any) -> None:
    m = server.metrics()
    assert {n: m.families[n].type for n in FAMILIES if n in m.families} == FAMILIES
    # The API port serves the same registry.
    assert set(FAMILIES) <= set(server.metrics(api_port=True).families)


def test_the_decoder_running_the_model_and_its_failovers(server: Any) -> None:
    health = httpx.get(f"{server.base_url}/health", timeout=30).json()
    m = server.metrics()
    info = [s for s in m.samples if s.name == "dspark_decoder_info"]
    assert [(s.labels["decoder"], s.value) for s in info] == [(health["decoder"], 1.0)], info  # one target, now
    assert m.value("dspark_decoder_failovers_total") == health["decoder_failovers"] == 0


def test_every_dspark_series_has_model_name(server: Any) -> None:
    server.openai().completions.create(model=server.model, prompt=PROMPT, max_tokens=2, temperature=0)
    m = server.metrics()
    dspark = [s for s in m.samples if s.name.startswith("dspark_")]
    assert len(dspark) > 50
    assert [s for s in dspark if s.labels.get("model_name") != server.model] == []


def test_counters_and_histograms_follow_requests(server: Any) -> None:
    before = server.wait_idle()
    client = server.openai()
    a = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    b = chunks[-1].usage
    after = server.wait_idle()

    def delta(name: str, **labels: str) -> float:
        return after.value(name, 0.0, **labels) - before.value(name, 0.0, **labels)

    assert delta("dspark_generation_tokens_total") == a.usage.completion_tokens + b.completion_tokens
    assert delta("dspark_prompt_tokens_total") == a.usage.prompt_tokens + b.prompt_tokens
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"dspark_{h}_count") == 2 and delta(f"dspark_{h}_sum") > 0
    assert delta("dspark_time_per_output_token_seconds_count") == (a.usage.completion_tokens > 1) + (
        b.completion_tokens > 1)
    reasons = {a.choices[0].finish_reason, [c for c in chunks if c.choices][-1].choices[0].finish_reason}
    assert sum(delta("dspark_requests_finished_total", finish_reason=r) for r in reasons) == 2
    assert delta("dspark_http_requests_total", route="/v1/completions", status="200") == 1
    assert delta("dspark_http_requests_total", route="/v1/chat/completions", status="200") == 1
    # One forward per step at least: 6 tokens, the first from the prefill step.
    assert delta("dspark_partition_latency_seconds_count", plugin="torch", device="cpu", partition="forward") >= 6


def test_request_phases_and_lengths(server: Any) -> None:
    """Queue + prefill = TTFT, inter-token gaps add up to the decode time, the length histograms to the counters."""
    before = server.wait_idle()
    client = server.openai()
    a = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    b = client.completions.create(model=server.model, prompt=[PROMPT, "import os"], max_tokens=4, temperature=0.7,
                                  n=2, seed=1, extra_body={"ignore_eos": True})
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.value(name, 0.0, model_name=server.model) - before.value(name, 0.0, model_name=server.model)

    seqs = 1 + 4  # b: two prompts x n=2
    tokens = a.usage.completion_tokens + b.usage.completion_tokens
    assert tokens == 7 + 4 * 4
    for h in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
              "request_prompt_tokens", "request_generation_tokens", "time_to_first_token_seconds"):
        assert delta(f"dspark_{h}_count") == seqs, h
    # One inter-token sample per gap: tokens - 1 per sequence.
    assert delta("dspark_inter_token_latency_seconds_count") == tokens - seqs
    assert delta("dspark_inter_token_latency_seconds_sum") == pytest.approx(
        delta("dspark_request_decode_time_seconds_sum"), rel=1e-6, abs=1e-6)
    assert delta("dspark_request_queue_time_seconds_sum") + delta("dspark_request_prefill_time_seconds_sum") == \
        pytest.approx(delta("dspark_time_to_first_token_seconds_sum"), rel=1e-6, abs=1e-6)
    assert delta("dspark_request_queue_time_seconds_sum") >= 0
    if "first_scheduled" in {f.name for f in dataclasses.fields(RequestOutput)}:  # else prefill counts as queue
        assert delta("dspark_request_prefill_time_seconds_sum") > 0
    assert delta("dspark_request_decode_time_seconds_sum") > 0
    # e2e covers TTFT and the decode.
    assert delta("dspark_e2e_request_latency_seconds_sum") >= delta("dspark_time_to_first_token_seconds_sum") + \
        delta("dspark_request_decode_time_seconds_sum") - 1e-6
    assert delta("dspark_request_generation_tokens_sum") == tokens == delta("dspark_generation_tokens_total")
    # A prompt prefills once per sequence: b's two prompts twice each (usage counts each once).
    assert delta("dspark_request_prompt_tokens_sum") == delta("dspark_prompt_tokens_total") == \
        a.usage.prompt_tokens + 2 * b.usage.prompt_tokens
    # Every 7-token sequence lands in the 8-token bucket, every 4-token one in the 4-token bucket.
    bucket = {s.labels["le"]: s.value for s in after.samples if s.name == "dspark_request_generation_tokens_bucket"}
    old = {s.labels["le"]: s.value for s in before.samples if s.name == "dspark_request_generation_tokens_bucket"}
    assert bucket["4.0"] - old.get("4.0", 0) == 4 and bucket["8.0"] - old.get("8.0", 0) == 5


def test_kv_gauges_while_a_request_runs(server: Any) -> None:
    server.wait_idle()
    with server.http() as c, c.stream("POST", "/v1/completions", json={
            "model": server.model, "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        lines = r.iter_lines()  # kept alive: closing the iterator would close the connection
        events = 0
        while events < 3:
            events += next(lines).startswith("data: ")
        m = server.metrics()
    running, used, total = (m.value(f"dspark_{n}") for n in ("requests_running", "kv_cache_used_bytes",
                                                             "kv_cache_total_bytes"))
    assert running == 1 and 0 < used < total
    assert m.value("dspark_kv_cache_usage_ratio") == pytest.approx(used / total)
    assert 0 <= m.value("dspark_kv_cache_fragmentation_ratio") < 1
    server.wait_idle()


def test_device_memory_and_speculative_series(server: Any) -> None:
    m = server.metrics()
    used, total = m.value("dspark_device_memory_used_bytes", device="cpu"), m.value(
        "dspark_device_memory_total_bytes", device="cpu")
    assert 0 < used < total
    # No speculative decoding configured: the series exist and read 0.
    for n in ("drafts_total", "draft_tokens_total", "accepted_tokens_total"):
        assert m.value(f"dspark_spec_decode_{n}") == 0
    assert m.value("dspark_spec_decode_acceptance_rate") == 0
    assert m.value("dspark_spec_decode_enabled", strategy="off") == 0


def test_preemptions_counted_and_outputs_unchanged(server_factory: Any, tmp_path: Path, reference: Any) -> None:
    """A KV cache of 8 pages of 16 tokens and four 70-token sequences: someone must be preempted."""
    srv = server_factory(tmp_path, engine={"max_total_tokens": 128,
                                           "continuous_batching": {"max_batch_size": 4, "kv_cache_page_size": 16}})
    prompts = [PROMPT, "import os\n", "class Stack:", "for i in range("]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    refs = [reference.generate(p, params)[0].text for p in prompts]
    client = srv.openai()
    got: dict[int, str] = {}

    def run(i: int) -> None:
        got[i] = client.completions.create(model=srv.model, prompt=prompts[i], max_tokens=64, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(prompts))] == refs
    m = srv.wait_idle()
    assert m.value("dspark_preemptions_total") > 0


def test_grafana_dashboard_queries_only_exported_metrics(server: Any) -> None:
    dash = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|sum|count|total)$", "", n) for e in exprs for n in re.findall(r"dspark_\w+", e)}
    exported = set(server.metrics().families)
    assert len(used) >= 20 and used <= exported, used - exported
    # Every metric the issue asks for is on the dashboard.
    assert set(FAMILIES) <= used
    # ... and every query can be narrowed to a model.
    assert "model_name" in [v["name"] for v in dash["templating"]["list"]]
    assert [e for e in exprs if 'model_name=~"$model_name"' not in e] == []


# -- the per-sequence timer in process -------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _out(tokens: int, finished: bool = False, first_scheduled: float | None = None) -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(token_ids=list(range(tokens)), finished=finished,
                           finish_reason="length" if finished else None, first_scheduled=first_scheduled)


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> Any:
    from types import SimpleNamespace

    from dspark.llm.engine import EngineStats
    from dspark.server import metrics as mod

    clock = _Clock()
    monkeypatch.setattr(mod, "time", SimpleNamespace(perf_counter=clock))
    stats = EngineStats(kv_used_bytes=0, kv_total_bytes=1, kv_used_pages=0, kv_free_pages=1, kv_total_pages=1,
                        kv_usage=0.0, kv_fragmentation=0.0, page_size=16, num_running=0, num_waiting=0,
                        num_preemptions=0, effective_max_batch=1)
    m = mod.ServerMetrics(SimpleNamespace(stats=lambda: stats), model_name="m", devices=[])

    def value(name: str, **labels: str) -> float:
        return m.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0

    return clock, m, value


def test_timer_splits_a_multi_token_gap_evenly(timed: Any) -> None:
    """Speculative decoding: 1 token, then 3 at once 0.3 s later, then 2 at once 0.1 s later."""
    clock, m, value = timed
    t = m.sequence(prompt_tokens=7, arrival=100.0)
    clock.t = 100.5
    t.update(_out(1, first_scheduled=100.2))
    clock.t = 100.8
    t.update(_out(4))
    clock.t = 100.9
    t.update(_out(6, finished=True))
    itl = "dspark_inter_token_latency_seconds"
    assert value(f"{itl}_count") == 5 and value(f"{itl}_sum") == pytest.approx(0.4)
    # Three gaps of 0.1 s (0.3 s over 3 tokens), two of 0.05 s (0.1 s over 2).
    assert value(f"{itl}_bucket", le="0.15") == 5
    assert value(f"{itl}_bucket", le="0.04") == 0 and value(f"{itl}_bucket", le="0.06") == 2
    assert value("dspark_request_queue_time_seconds_sum") == pytest.approx(0.2)
    assert value("dspark_request_prefill_time_seconds_sum") == pytest.approx(0.3)
    assert value("dspark_request_decode_time_seconds_sum") == pytest.approx(0.4)
    assert value("dspark_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value("dspark_time_per_output_token_seconds_sum") == pytest.approx(0.4 / 5)
    assert (value("dspark_request_prompt_tokens_sum"), value("dspark_request_generation_tokens_sum")) == (7, 6)
    assert value("dspark_requests_finished_total", finish_reason="length") == 1
    assert (m.live_prompt_tokens, m.live_generation_tokens) == (7, 6)
    t.finish("abort")  # after the end: nothing more
    assert value("dspark_requests_finished_total", finish_reason="abort") == 0


def test_timer_without_first_scheduled_and_a_first_output_of_several_tokens(timed: Any) -> None:
    clock, m, value = timed
    t = m.sequence(prompt_tokens=3, arrival=100.0)
    clock.t = 101.0
    t.update(_out(3))  # an engine without first_scheduled; three tokens in the first output
    clock.t = 101.5
    t.update(_out(4, finished=True))
    itl = "dspark_inter_token_latency_seconds"
    assert value(f"{itl}_count") == 3 and value(f"{itl}_sum") == pytest.approx(0.5)
    assert value(f"{itl}_bucket", le="0.0005") == 2  # the two that came with the first token
    # Queue time falls back to arrival -> first output; the prefill is then 0.
    assert value("dspark_request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert value("dspark_request_prefill_time_seconds_sum") == 0
    assert value("dspark_request_prefill_time_seconds_count") == 1


def test_timer_of_a_sequence_aborted_in_the_queue(timed: Any) -> None:
    clock, m, value = timed
    t = m.sequence(prompt_tokens=3, arrival=100.0)
    clock.t = 102.0
    t.finish("abort")
    assert value("dspark_requests_finished_total", finish_reason="abort") == 1
    for h in ("request_queue_time_seconds", "time_to_first_token_seconds", "request_prompt_tokens",
              "e2e_request_latency_seconds"):
        assert value(f"dspark_{h}_count") == 0, h
    assert value("dspark_prompt_tokens_total") == 0 and (t.end, t.finish_reason) == (102.0, "abort")
