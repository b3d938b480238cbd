"""/metrics on the metrics port, parsed with prometheus-client's parser, against what requests did."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from dspark.llm import SamplingParams

PROMPT = "def quick_sort(arr):"
FAMILIES = {
    "dspark_requests_running": "gauge", "dspark_requests_waiting": "gauge",
    "dspark_kv_cache_used_bytes": "gauge", "dspark_kv_cache_total_bytes": "gauge",
    "dspark_kv_cache_usage_ratio": "gauge", "dspark_kv_cache_fragmentation_ratio": "gauge",
    "dspark_preemptions": "counter",
    "dspark_time_to_first_token_seconds": "histogram", "dspark_time_per_output_token_seconds": "histogram",
    "dspark_e2e_request_latency_seconds": "histogram",
    "dspark_prompt_tokens": "counter", "dspark_generation_tokens": "counter",
    "dspark_spec_decode_drafts": "counter", "dspark_spec_decode_draft_tokens": "counter",
    "dspark_spec_decode_accepted_tokens": "counter", "dspark_spec_decode_acceptance_rate": "gauge",
    "dspark_device_memory_used_bytes": "gauge", "dspark_device_memory_total_bytes": "gauge",
    "dspark_partition_latency_seconds": "histogram", "dspark_requests_finished": "counter",
    "dspark_http_requests": "counter",
}


def test_families_and_types(server: Any) -> None:
    m = server.metrics()
    assert {n: m.families[n].type for n in FAMILIES if n in m.families} == FAMILIES
    # The API port serves the same registry.
    assert set(FAMILIES) <= set(server.metrics(api_port=True).families)


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
