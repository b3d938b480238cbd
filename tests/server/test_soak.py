"""Soak: 2,000 streamed requests at concurrency 64, a fifth of the clients hanging up mid-stream.

Short prompts (4-24 tokens) and outputs (1-16) keep it near a minute on two
cores. The requests mix the sampling parameters (logprobs, penalties,
logit_bias) and, on a share of those whose clients stay, a grammar. Afterwards:
nothing lost (each request either completed with exactly its max_tokens and
finish_reason "length", or, constrained, a valid output that ended early by
its grammar, or was hung up by its client),
the server's own counters account for every sequence, no KV page is held,
nothing runs or waits, and the server's RSS grew under 10% from the end of
a warm-up load to the end of the soak.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from dspark.server.loadgen.bench import BenchRequest, LoadConfig, default_workload, disconnect_plan, run

N, CONCURRENCY, DISCONNECT = 2000, 64, 0.2
REGEX = r"[a-z_]{1,12}( [a-z_]{1,12}){0,40}"
SAMPLING_MIX: list[dict[str, Any]] = [
    {}, {"logprobs": 2}, {"presence_penalty": 0.6, "frequency_penalty": 0.3}, {"repetition_penalty": 1.15},
    {"logit_bias": {"5": 2.0, "6": -50}}, {"logprobs": 0, "presence_penalty": -0.5, "min_tokens": 1},
]


def mixed(reqs: list[BenchRequest], plan: list[int | None]) -> list[BenchRequest]:
    """The parameter mix; every fifth request whose client stays is also held to REGEX."""
    out = []
    for i, (r, k) in enumerate(zip(reqs, plan)):
        extra = dict(SAMPLING_MIX[i % len(SAMPLING_MIX)])
        if k is None and i % 5 == 0:
            extra["guided_regex"] = REGEX
        out.append(BenchRequest(r.prompt, r.max_tokens, extra))
    return out


def finished(server: Any) -> dict[str, float]:
    m = server.metrics()
    return {r: m.value("dspark_requests_finished_total", 0.0, finish_reason=r) for r in ("length", "stop", "abort")}


@pytest.mark.slow
@pytest.mark.timeout(280)
def test_soak_disconnects_lose_nothing_and_leak_nothing(server_factory: Any, tmp_path: Path) -> None:
    srv = server_factory(tmp_path, engine={"continuous_batching": {"max_batch_size": CONCURRENCY}})
    proc = psutil.Process(srv.proc.pid)
    cfg = LoadConfig(url=srv.base_url, concurrency=CONCURRENCY, disconnect_fraction=DISCONNECT, seed=11,
                     extra_body={"ignore_eos": True}, timeout_s=120)

    # Warm-up with the same mix (disconnects included): allocator pools, batch shapes, HTTP buffers.
    warm_reqs = default_workload(320, seed=10, prompt_tokens=(4, 24), max_tokens=(1, 16))
    warm = run(cfg, mixed(warm_reqs, disconnect_plan(warm_reqs, DISCONNECT, cfg.seed))).summary()
    assert warm.failed == 0, warm.error_samples
    srv.wait_idle()
    rss_before = proc.memory_info().rss
    counts_before = finished(srv)

    reqs = default_workload(N, seed=11, prompt_tokens=(4, 24), max_tokens=(1, 16))
    plan = disconnect_plan(reqs, DISCONNECT, cfg.seed)
    reqs = mixed(reqs, plan)
    t0 = time.perf_counter()
    res = run(cfg, reqs)
    soak_s = time.perf_counter() - t0
    s = res.summary()

    assert s.num_requests == N and s.failed == 0, (s.errors, s.error_samples)
    assert s.completed + s.disconnected == N  # nothing lost
    for r, k, q in zip(res.results, plan, reqs):
        if k is None and "guided_regex" in (q.extra_body or {}):
            assert r.ok and r.finish_reason in ("length", "stop") and 1 <= r.output_tokens <= r.max_tokens, r
        elif k is None:
            assert r.ok and r.finish_reason == "length" and r.output_tokens == r.max_tokens, r
        else:  # ignore_eos: the stream always outlasts the chunk it hangs up after
            assert r.disconnected and r.chunks == k, r
    assert s.disconnected == sum(k is not None for k in plan)
    assert 0.15 * N < s.disconnected < 0.25 * N

    # Server side: every sequence ended (a hung-up one as "abort", or as "length" if it finished first),
    # and once idle no KV page is held.
    idle = srv.wait_idle(timeout=15)
    assert idle.value("dspark_kv_cache_used_bytes") == 0
    assert idle.value("dspark_requests_running") == 0 and idle.value("dspark_requests_waiting") == 0
    counts = finished(srv)
    delta = {k: counts[k] - counts_before[k] for k in counts}
    assert sum(delta.values()) == N, delta
    stopped = sum(r.finish_reason == "stop" for r in res.results if r.ok)
    assert delta["length"] >= s.completed - stopped and delta["stop"] == stopped
    assert delta["abort"] > 0, "no hang-up reached the server while its request ran: the abort path went untested"

    rss_after = proc.memory_info().rss
    growth = rss_after / rss_before - 1
    print(f"\nsoak: {N} requests in {soak_s:.1f} s ({N / soak_s:.0f} req/s), {s.completed} completed, "
          f"{s.disconnected} disconnected ({delta['abort']:.0f} aborted server-side), RSS {rss_before / 2**20:.0f} "
          f"-> {rss_after / 2**20:.0f} MiB ({growth:+.1%})")
    assert growth < 0.10, (rss_before, rss_after)
    assert srv.stop() == 0
