"""``dspark bench serve`` without a server: percentiles, goodput, workload, dataset, sweep output files."""

from __future__ import annotations

import csv
import json
import random
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from dspark.llm.api import default_model_path
from dspark.server.loadgen.bench import (BenchRequest, LoadConfig, default_workload, disconnect_plan, load_dataset)
from dspark.server.loadgen.stats import Dist, RequestResult, meets_slo, percentile, summarize
from dspark.server.loadgen.sweep import SweepRow, parse_sweep, plot, server_command, write_csv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101])
def test_percentile_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-15)


def test_percentile_rejects_empty_and_bad_q() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_dist_is_in_ms_and_empty_is_none() -> None:
    d = Dist.of_seconds([0.001, 0.002, 0.004])
    assert (d.n, d.mean, d.p50) == (3, pytest.approx(7 / 3), pytest.approx(2.0))
    assert d.p90 == pytest.approx(float(np.percentile([1, 2, 4], 90)))
    assert Dist.of_seconds([]) == Dist()


def _ok(i: int, ttft: float, e2e: float, tokens: int, max_tokens: int | None = None,
        finish: str = "length") -> RequestResult:
    gaps = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(index=i, max_tokens=max_tokens or tokens, ok=True, ttft_s=ttft, e2e_s=e2e, itl_s=gaps,
                         chunks=tokens, output_tokens=tokens, finish_reason=finish, usage_reported=True,
                         prompt_tokens=10)


def test_summarize_throughput_goodput_and_errors() -> None:
    rng = np.random.default_rng(7)
    n_ok = 40
    ttft = rng.uniform(0.01, 0.5, n_ok)
    tokens = rng.integers(1, 30, n_ok)
    tpot = rng.uniform(0.005, 0.05, n_ok)
    e2e = ttft + tpot * np.maximum(tokens - 1, 0)
    results = [_ok(i, float(ttft[i]), float(e2e[i]), int(tokens[i])) for i in range(n_ok)]
    results.append(RequestResult(index=40, max_tokens=5, error="http_503", detail="busy"))
    results.append(RequestResult(index=41, max_tokens=5, error="http_503", detail="busy again"))
    results.append(RequestResult(index=42, max_tokens=5, error="timeout"))
    results.append(RequestResult(index=43, max_tokens=5, disconnected=True, chunks=2, ttft_s=0.1))
    # An early stop may be short; a "length" finish must be exactly max_tokens.
    results.append(_ok(44, 0.1, 0.2, 3, max_tokens=9, finish="stop"))
    results.append(_ok(45, 0.1, 0.2, 3, max_tokens=9, finish="length"))
    duration = 12.5
    s = summarize(results, duration, slo_ttft_ms=250, slo_tpot_ms=30)

    assert (s.num_requests, s.completed, s.disconnected, s.failed) == (46, 42, 1, 3)
    assert s.errors == {"http_503": 2, "timeout": 1}
    assert s.error_samples["http_503"] == "busy"
    assert s.finish_reasons == {"length": 41, "stop": 1}
    assert s.length_mismatches == 1
    total_tokens = int(tokens.sum()) + 6
    assert s.total_output_tokens == total_tokens
    assert s.total_prompt_tokens == 42 * 10
    assert s.request_throughput == pytest.approx(42 / duration)
    assert s.output_token_throughput == pytest.approx(total_tokens / duration)

    all_ttft = np.concatenate([ttft, [0.1, 0.1]]) * 1e3
    assert s.ttft_ms.p50 == pytest.approx(np.percentile(all_ttft, 50))
    assert s.ttft_ms.p99 == pytest.approx(np.percentile(all_ttft, 99))
    multi = tokens > 1
    all_tpot = np.concatenate([tpot[multi], [0.05, 0.05]]) * 1e3
    assert s.tpot_ms.n == len(all_tpot)
    assert s.tpot_ms.p90 == pytest.approx(np.percentile(all_tpot, 90))
    assert s.e2e_ms.p99 == pytest.approx(np.percentile(np.concatenate([e2e, [0.2, 0.2]]) * 1e3, 99))
    assert s.itl_ms.n == int((tokens - 1).sum()) + 4

    # Independent count: TTFT within 250 ms and (single token or TPOT within 30 ms); requests 44 and 45
    # have a TPOT of 50 ms and miss.
    met = int(np.sum((ttft * 1e3 <= 250) & ((tokens < 2) | (tpot * 1e3 <= 30 + 1e-9))))
    assert s.slo_met == met
    assert s.goodput == pytest.approx(met / duration)
    assert 0 < s.slo_met < s.completed  # the targets cut somewhere in the middle, so the test can fail either way
    assert json.loads(json.dumps(s.to_json_dict()))["ttft_ms"]["p50"] == pytest.approx(s.ttft_ms.p50)


def test_goodput_without_slo_counts_every_completed_request() -> None:
    s = summarize([_ok(0, 0.1, 0.3, 4), RequestResult(index=1, max_tokens=4, error="connect")], 2.0)
    assert (s.slo_met, s.goodput) == (1, 0.5)


def test_meets_slo_single_token_has_no_tpot() -> None:
    one = _ok(0, 0.05, 0.05, 1)
    assert one.tpot_s is None
    assert meets_slo(one, 100, 0.001)
    assert not meets_slo(one, 10, None)


def test_disconnect_plan_is_seeded_and_in_range() -> None:
    reqs = [BenchRequest("x", 1 + i % 7) for i in range(2000)]
    plan = disconnect_plan(reqs, 0.2, seed=3)
    assert plan == disconnect_plan(reqs, 0.2, seed=3)
    assert plan != disconnect_plan(reqs, 0.2, seed=4)
    chosen = [(k, r) for k, r in zip(plan, reqs) if k is not None]
    assert 0.17 < len(chosen) / len(reqs) < 0.23
    assert all(0 <= k < r.max_tokens for k, r in chosen)
    assert {k for k, _ in chosen} == set(range(7))  # every point of the stream gets hit, including "before any chunk"
    assert disconnect_plan(reqs, 0.0, seed=3) == [None] * len(reqs)


def test_load_config_validates() -> None:
    with pytest.raises(ValueError):
        LoadConfig(url="http://x", concurrency=None, request_rate=None)
    with pytest.raises(ValueError):
        LoadConfig(url="http://x", concurrency=0)
    with pytest.raises(ValueError):
        LoadConfig(url="http://x", disconnect_fraction=1.5)
    assert LoadConfig(url="http://h:1/v1/").base == "http://h:1"


def test_load_dataset(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "def f(", "max_tokens": 5}\n\n{"prompt": "import os"}\n')
    assert load_dataset(p) == [BenchRequest("def f(", 5), BenchRequest("import os", 16)]
    for bad in ('{"prompt": 3}', '{"prompt": "x", "max_tokens": 0}', '{"prompt": "x", "max_tokens": true}',
                "[1]", "{not json", ""):
        p.write_text(bad + "\n")
        with pytest.raises(ValueError):
            load_dataset(p)


def test_default_workload_is_seeded_mixed_and_cut_from_heldout_files() -> None:
    reqs = default_workload(60, seed=1, prompt_tokens=(16, 64), max_tokens=(4, 32))
    assert reqs == default_workload(60, seed=1, prompt_tokens=(16, 64), max_tokens=(4, 32))
    assert reqs != default_workload(60, seed=2, prompt_tokens=(16, 64), max_tokens=(4, 32))
    assert all(4 <= r.max_tokens <= 32 for r in reqs)
    assert len({r.max_tokens for r in reqs}) > 10 and len({len(r.prompt) for r in reqs}) > 30
    model = default_model_path()
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = [(root / ln.strip()).read_text(errors="replace")
               for ln in (model / "heldout_files.txt").read_text().splitlines() if ln.strip()]
    for r in reqs:
        assert any(r.prompt in s for s in sources)
        # Cut on token boundaries: re-tokenizing gives the drawn length up to merges across the cut.
        assert 12 <= len(tok.encode(r.prompt, add_special_tokens=False).ids) <= 68


def test_parse_sweep_and_server_command() -> None:
    assert parse_sweep("max_batch_size=1, 4,16") == ("max_batch_size", ["1", "4", "16"])
    for bad in ("max_batch_size", "=1,2", "x="):
        with pytest.raises(ValueError):
            parse_sweep(bad)
    cmd = server_command(port=5, metrics_port=6, config=Path("c.yaml"), overrides=[("max_batch_size", "4")])
    assert cmd[1:3] == ["-m", "dspark.server"]
    assert cmd[cmd.index("--max-batch-size") + 1] == "4" and cmd[cmd.index("--config") + 1] == "c.yaml"
    assert cmd[cmd.index("--port") + 1] == "5" and cmd[cmd.index("--metrics-port") + 1] == "6"


def test_sweep_csv_and_plot_from_synthetic_rows(tmp_path: Path) -> None:
    rows = []
    for v, scale in (("1", 1.0), ("8", 3.0)):
        res = [_ok(i, 0.1 * scale, 0.5 * scale, 10) for i in range(20)]
        rows.append(SweepRow("max_batch_size", v, summarize(res, 10 / scale)))
    write_csv(rows, tmp_path / "s.csv")
    plot(rows, tmp_path / "s.png")
    got = list(csv.DictReader(open(tmp_path / "s.csv")))
    assert [r["max_batch_size"] for r in got] == ["1", "8"]
    assert float(got[1]["output_token_throughput"]) == pytest.approx(3 * float(got[0]["output_token_throughput"]))
    assert float(got[1]["e2e_p99_ms"]) == pytest.approx(1500)
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG_MAGIC


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def _text(t: str, finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


# Canned server answers, keyed by prompt: the client's parsing and error kinds, without a server.
CANNED = {
    "usage": (200, _sse(_text("a"), _text(""), _text("bc"), _text("", "length"),
                        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}, "[DONE]")),
    "no-usage": (200, _sse(_text("a"), _text(""), _text("b"), _text("", "stop"), "[DONE]")),
    "not-an-object": (200, _sse(_text("a"), [1, 2], "[DONE]")),
    "not-json": (200, _sse(_text("a"), "{oops", "[DONE]")),
    "error-event": (200, _sse(_text("a"), {"error": {"message": "boom"}}, "[DONE]")),
    "cut": (200, _sse(_text("a"), _text("b"))),
    "no-finish": (200, _sse(_text("a"), "[DONE]")),
    "refused": (429, b'{"error": {"message": "slow down"}}'),
}


def test_client_parses_streams_and_classifies_failures() -> None:
    import asyncio

    import httpx

    from dspark.server.loadgen.bench import run_load

    def handler(request: httpx.Request) -> httpx.Response:
        status, body = CANNED[json.loads(request.content)["prompt"]]
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})

    reqs = [BenchRequest(p, 3) for p in CANNED]
    res = asyncio.run(run_load(LoadConfig(url="http://canned", model="m", concurrency=2), reqs,
                               transport=httpx.MockTransport(handler)))
    by = {q.prompt: r for q, r in zip(reqs, res.results)}
    u = by["usage"]
    assert (u.ok, u.output_tokens, u.prompt_tokens, u.chunks, u.finish_reason, len(u.itl_s)) == \
        (True, 3, 4, 2, "length", 1)  # empty chunks are neither tokens of their own nor first tokens
    n = by["no-usage"]
    assert (n.ok, n.usage_reported, n.output_tokens, n.finish_reason) == (True, False, 2, "stop")
    assert {p: by[p].error for p in CANNED if not by[p].ok} == {
        "not-an-object": "bad_chunk", "not-json": "bad_chunk", "error-event": "stream_error", "cut": "incomplete",
        "no-finish": "incomplete", "refused": "http_429"}
    assert "slow down" in by["refused"].detail
    s = res.summary()
    assert (s.completed, s.failed, s.length_mismatches) == (2, 6, 0)


@pytest.mark.parametrize("slo", [(None, None), (300.0, None), (None, 40.0), (300.0, 40.0)])
def test_report_tables_render(slo: tuple[float | None, float | None]) -> None:
    from rich.console import Console

    from dspark.server.loadgen.report import latency_table, summary_table

    results = [_ok(0, 0.1, 0.5, 5), RequestResult(index=1, max_tokens=3, error="http_503", detail="busy"),
               RequestResult(index=2, max_tokens=3, disconnected=True)]
    s = summarize(results, 2.0, slo_ttft_ms=slo[0], slo_tpot_ms=slo[1])
    con = Console(record=True, width=200)
    con.print(summary_table(s))
    con.print(latency_table(summarize([], 1.0)))  # nothing measured: dashes, not a crash
    text = con.export_text()
    assert "http_503" in text and "disconnected by the client" in text
    assert ("TTFT <= 300 ms" in text) == (slo[0] is not None) and ("TPOT <= 40 ms" in text) == (slo[1] is not None)
    assert ("no SLO set" in text) == (slo == (None, None))
