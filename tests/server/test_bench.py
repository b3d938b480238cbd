"""``dspark bench serve`` against the real server process (tests/server/conftest.py's ``server``)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dspark.server.loadgen.bench import BenchRequest, LoadConfig, default_workload, disconnect_plan, run
from dspark.server.loadgen.stats import Dist

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXACT = {"ignore_eos": True}  # every request yields exactly its max_tokens


def ordered(d: Dist) -> bool:
    return d.n > 0 and d.p50 is not None and d.p90 is not None and d.p99 is not None and d.p50 <= d.p90 <= d.p99


def test_small_run_counts_every_token(server: Any) -> None:
    reqs = default_workload(12, seed=5, prompt_tokens=(8, 64), max_tokens=(2, 12))
    before = server.metrics().value("dspark_generation_tokens_total")
    res = run(LoadConfig(url=server.base_url, concurrency=4, seed=5, extra_body=EXACT), reqs)
    after = server.metrics().value("dspark_generation_tokens_total")
    assert res.model == server.model
    assert [r.index for r in res.results] == list(range(12))
    for r, q in zip(res.results, reqs):
        assert r.ok, (r.error, r.detail)
        assert r.usage_reported and r.finish_reason == "length"
        assert r.output_tokens == q.max_tokens
        assert 0 < r.ttft_s <= r.e2e_s  # type: ignore[operator]
        assert len(r.itl_s) == r.chunks - 1 and r.chunks <= r.output_tokens
    s = res.summary()
    assert (s.completed, s.failed, s.length_mismatches) == (12, 0, 0)
    assert s.total_output_tokens == sum(q.max_tokens for q in reqs) == after - before  # client and server agree
    assert s.output_token_throughput == pytest.approx(s.total_output_tokens / s.duration_s)
    for d in (s.ttft_ms, s.tpot_ms, s.itl_ms, s.e2e_ms):
        assert ordered(d), d
    assert s.ttft_ms.p99 <= s.e2e_ms.p99  # type: ignore[operator]


def test_without_ignore_eos_finish_reason_matches_token_count(server: Any) -> None:
    reqs = default_workload(8, seed=9, prompt_tokens=(8, 32), max_tokens=(4, 24))
    s = run(LoadConfig(url=server.base_url, concurrency=4), reqs).summary()
    assert (s.completed, s.failed, s.length_mismatches) == (8, 0, 0)
    assert set(s.finish_reasons) <= {"length", "stop"}


def test_chat_endpoint(server: Any) -> None:
    reqs = [BenchRequest("Write a function that adds two numbers.", 5), BenchRequest("import os\n", 3)]
    res = run(LoadConfig(url=server.api_url, concurrency=2, chat=True, extra_body=EXACT), reqs)
    assert [(r.ok, r.output_tokens, r.finish_reason) for r in res.results] == [(True, 5, "length"), (True, 3, "length")]


def test_open_loop_follows_seeded_poisson_arrivals(server: Any) -> None:
    import random

    reqs = [BenchRequest("def f(x):", 2)] * 8
    rate = 10.0
    res = run(LoadConfig(url=server.base_url, concurrency=None, request_rate=rate, seed=3, extra_body=EXACT), reqs)
    assert all(r.ok for r in res.results)
    rng = random.Random("arrivals-3")  # the generator's documented seeding, recomputed here
    due, expected = 0.0, []
    for _ in reqs:
        expected.append(due)
        due += rng.expovariate(rate)
    starts = [r.start_s for r in res.results]
    for got, want in zip(starts, expected):
        assert want - 0.01 <= got <= want + 0.5, (starts, expected)  # never early; late only by loop lag


def test_disconnecting_clients_are_counted_and_free_their_pages(server: Any) -> None:
    reqs = default_workload(16, seed=2, prompt_tokens=(8, 32), max_tokens=(6, 24))
    plan = disconnect_plan(reqs, 0.5, seed=2)
    res = run(LoadConfig(url=server.base_url, concurrency=8, seed=2, disconnect_fraction=0.5, extra_body=EXACT), reqs)
    hung_up = 0
    for r, k in zip(res.results, plan):
        if k is not None and (k == 0 or r.disconnected):  # hung up after k chunks (0: right after the headers)
            assert r.disconnected and not r.ok and r.error is None and r.chunks == k
            hung_up += 1
        else:  # not planned to, or the stream ended in fewer chunks (greedy runs stream several tokens a chunk)
            assert r.ok and r.output_tokens == r.max_tokens and (k is None or 1 < r.chunks < k), (r.error, r.detail)
    s = res.summary()
    assert s.disconnected == hung_up > 0
    assert s.completed + s.disconnected == 16 and s.failed == 0
    server.wait_idle()


def test_errors_are_counted_by_kind(server: Any) -> None:
    reqs = [BenchRequest("x", 2)] * 3
    s = run(LoadConfig(url=server.base_url, model="no-such-model", concurrency=2), reqs).summary()
    assert (s.completed, s.failed, s.errors) == (0, 3, {"http_404": 3})
    assert "no-such-model" in s.error_samples["http_404"]
    s = run(LoadConfig(url="http://127.0.0.1:9", model="m", concurrency=1, timeout_s=5), reqs[:1]).summary()
    assert s.errors == {"connect": 1}


def test_cli_json_output(server: Any, tmp_path: Path) -> None:
    ds = tmp_path / "d.jsonl"
    ds.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": m}) for p, m in
                            (("def add(a, b):", 3), ("class Foo:", 4), ("import sys\n", 2))))
    cmd = [sys.executable, "-m", "dspark.cli", "bench", "serve", "--url", server.base_url, "--dataset", str(ds),
           "--num-requests", "6", "--concurrency", "3", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
           "--extra-body", json.dumps(EXACT), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["num_requests"], out["completed"], out["failed"]) == (6, 6, 0)
    assert out["total_output_tokens"] == 2 * (3 + 4 + 2)
    assert out["slo_met"] == 6 and out["goodput"] == pytest.approx(6 / out["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert out[key]["p50"] <= out[key]["p90"] <= out[key]["p99"]


def test_cli_unreachable_server_fails_cleanly() -> None:
    p = subprocess.run([sys.executable, "-m", "dspark.cli", "bench", "serve", "--url", "http://127.0.0.1:9",
                        "--num-requests", "1", "--max-tokens", "2"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "error" in p.stderr


@pytest.mark.slow
def test_sweep_starts_a_server_per_value_and_writes_csv_and_png(tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"dtype": "float32"}, "resources": {"cpu_cores_per_worker": 1}}))
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "dspark.cli", "bench", "serve", "--sweep", "max_batch_size=1,4", "--config", str(cfg),
           "--out", str(out), "--num-requests", "8", "--concurrency", "4", "--prompt-tokens", "8-32",
           "--max-tokens", "2-8", "--extra-body", json.dumps(EXACT), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert [r["value"] for r in res["rows"]] == ["1", "4"]
    assert all(r["completed"] == 8 and r["failed"] == 0 for r in res["rows"])
    rows = list(csv.DictReader(open(out / "sweep.csv")))
    assert [r["max_batch_size"] for r in rows] == ["1", "4"]
    assert all(float(r["output_token_throughput"]) > 0 and float(r["e2e_p99_ms"]) > 0 for r in rows)
    assert (out / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    # Each value really ran on its own server with that setting.
    for v in ("1", "4"):
        log = (out / f"server-max_batch_size-{v}.log").read_text()
        assert f'"max_batch_size": {v}' in log
