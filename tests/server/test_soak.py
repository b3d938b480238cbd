"""Soak: 2,000 streamed requests at concurrency 64, a fifth of the clients hanging up mid-stream.

Short prompts (4-24 tokens) and outputs (1-16) keep it near a minute on two
cores. Afterwards: nothing lost (each request either completed with exactly
its max_tokens and finish_reason "length", or was hung up by its client),
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

from dspark.server.bench import LoadConfig, default_workload, disconnect_plan, run

N, CONCURRENCY, DISCONNECT = 2000, 64, 0.2


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
    warm = run(cfg, default_workload(320, seed=10, prompt_tokens=(4, 24), max_tokens=(1, 16))).summary()
    assert warm.failed == 0, warm.error_samples
    srv.wait_idle()
    rss_before = proc.memory_info().rss
    counts_before = finished(srv)

    reqs = default_workload(N, seed=11, prompt_tokens=(4, 24), max_tokens=(1, 16))
    plan = disconnect_plan(reqs, DISCONNECT, cfg.seed)
    t0 = time.perf_counter()
    res = run(cfg, reqs)
    soak_s = time.perf_counter() - t0
    s = res.summary()

    assert s.num_requests == N and s.failed == 0, (s.errors, s.error_samples)
    assert s.completed + s.disconnected == N  # nothing lost
    for r, k in zip(res.results, plan):
        if k is None:
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
    assert delta["length"] >= s.completed and delta["stop"] == 0
    assert delta["abort"] > 0, "no hang-up reached the server while its request ran: the abort path went untested"

    rss_after = proc.memory_info().rss
    growth = rss_after / rss_before - 1
    print(f"\nsoak: {N} requests in {soak_s:.1f} s ({N / soak_s:.0f} req/s), {s.completed} completed, "
          f"{s.disconnected} disconnected ({delta['abort']:.0f} aborted server-side), RSS {rss_before / 2**20:.0f} "
          f"-> {rss_after / 2**20:.0f} MiB ({growth:+.1%})")
    assert growth < 0.10, (rss_before, rss_after)
    assert srv.stop() == 0
