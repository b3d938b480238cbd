"""The server on a two-node Ray cluster: ``dspark serve --replicas 2 --ray-address`` against real nodes.

A head and a worker node run on this machine's loopback (``ray start --block``
processes), declaring different resources; the worker is started without the
npu plugin. The tests run in file order on one deployment: the openai client
through the ingress, both replicas' own metrics, the soak (2,000 requests, a
fifth of the clients hanging up), a replica killed mid-load, and last a third
node joining and the worker leaving (its replica moves to the new node). One
CPU per node and per replica keeps the placement deterministic. Everything is
bounded in time and stopped by the fixtures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the cluster extra (pip install 'dspark[cluster]') is not installed")

from dspark.llm import SamplingParams  # noqa: E402
from dspark.server.cluster.local import LocalCluster  # noqa: E402
from dspark.server.loadgen.bench import LoadConfig, default_workload, disconnect_plan, run  # noqa: E402
from dspark.server.loadgen.sweep import free_port  # noqa: E402

from conftest import DEFAULT_CONFIG, MODEL_NAME, Metrics, ServerHandle, _merge, start_server, wait_for  # noqa: E402

KEY = "cluster-test-key"
PROMPT = "def quick_sort(arr):"
pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("ray"), port=free_port())
    try:
        # One CPU per node and per replica: one replica per node, and a restarted one returns to its node.
        c.start(num_cpus=1, resources={"dspark_head": 1})
        c.add_node(num_cpus=1, resources={"dspark_worker": 1}, env={"DSPARK_PLUGINS": "no:npu"})
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def served(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    cfg = _merge(DEFAULT_CONFIG, {"engine": {"continuous_batching": {"max_batch_size": 32}},
                                  "cluster": {"resources_per_replica": {"num_cpus": 1}, "max_ongoing_requests": 32}})
    h = start_server(tmp_path_factory.mktemp("cluster-server"), config=cfg, api_key=KEY, env=cluster.env,
                     args=["--replicas", "2", "--ray-address", cluster.address], timeout=240)
    try:
        wait_for(lambda: len(replicas(h)) == 2, 60, "two registered replicas")
        yield h
    finally:
        code = h.stop(timeout=60)
    assert code == 0, h.log_path.read_text()[-4000:]


def replicas(h: ServerHandle) -> list[dict[str, Any]]:
    return list(httpx.get(f"{h.base_url}/cluster/replicas", timeout=10).json()["replicas"])


def replicas_settled(h: ServerHandle) -> list[dict[str, Any]] | None:
    """The replicas, or None while a node's departure is still being absorbed: the ingress may answer 500
    once, when it asks a replica actor that died with its node."""
    r = httpx.get(f"{h.base_url}/cluster/replicas", timeout=10)
    return list(r.json()["replicas"]) if r.status_code == 200 else None


def scrape(entry: dict[str, Any]) -> Metrics:
    return Metrics(httpx.get(entry["metrics_url"], timeout=10).text)


def mid_stream(entry: dict[str, Any]) -> float:
    """Sequences on this replica that have sent their first token and not finished (first tokens - decode spans)."""
    m = scrape(entry)
    return m.value("dspark_time_to_first_token_seconds_count", 0.0) - m.value("dspark_request_decode_time_seconds_count",
                                                                                0.0)


def idle(h: ServerHandle) -> bool:
    reps = replicas(h)
    return len(reps) == 2 and all(e["stats"]["kv_used_pages"] == 0 and e["stats"]["num_running"] == 0
                                  and e["stats"]["num_waiting"] == 0 and e["outstanding_tokens"] == 0 for e in reps)


def load(h: ServerHandle, n: int, concurrency: int, *, disconnect: float = 0.0, max_tokens: tuple[int, int] = (1, 16),
         seed: int = 0) -> Any:
    cfg = LoadConfig(url=h.base_url, concurrency=concurrency, disconnect_fraction=disconnect, seed=seed,
                     extra_body={"ignore_eos": True}, timeout_s=120, api_key=KEY)
    reqs = default_workload(n, seed=seed, prompt_tokens=(4, 24), max_tokens=max_tokens)
    return reqs, run(cfg, reqs)


def test_devices_cluster_probes_each_node_with_its_own_plugins(cluster: LocalCluster) -> None:
    out = subprocess.run([sys.executable, "-m", "dspark.cli", "devices", "--cluster", "--ray-address", cluster.address,
                          "--json"], capture_output=True, text=True, timeout=240, env=cluster.env)
    assert out.returncode == 0, out.stderr[-3000:]
    nodes = json.loads(out.stdout)["nodes"]
    assert len(nodes) == 2
    by_role = {("worker" if "dspark_worker" in n["resources"] else "head"): n for n in nodes}
    npu = {role: next(p for p in n["plugins"] if p["name"] == "npu") for role, n in by_role.items()}
    assert npu["worker"]["status"] == "blocked" and "no:npu" in npu["worker"]["reason"]
    assert npu["head"]["status"] != "blocked"
    for n in nodes:
        assert any(d["id"] == "cpu" for d in n["devices"]), n
        assert next(p for p in n["plugins"] if p["name"] == "cpu")["status"] == "active"


def test_openai_client_through_the_ingress(served: ServerHandle, reference: Any) -> None:
    import openai

    client = openai.OpenAI(api_key=KEY, base_url=f"{served.base_url}/v1", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    want = reference.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))[0]
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(model=MODEL_NAME, max_tokens=12, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": "Sort a list."}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=f"{served.base_url}/v1", max_retries=0).completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:  # checked at the ingress, as the single server does
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt=PROMPT, max_tokens=4)


def test_replicas_on_both_nodes_each_with_labelled_metrics(served: ServerHandle, cluster: LocalCluster) -> None:
    reps = replicas(served)
    assert len({e["node_id"] for e in reps}) == 2, "Serve should spread the two replicas over the two nodes"
    targets = httpx.get(f"{served.base_url}/cluster/metrics-targets", timeout=10).json()
    assert sorted(t["targets"][0] for t in targets) == sorted(
        e["metrics_url"].removeprefix("http://").removesuffix("/metrics") for e in reps)
    before = {e["replica"]: scrape(e).value("dspark_generation_tokens_total", 0.0, replica=e["replica"]) for e in reps}
    reqs, res = load(served, 24, 12, max_tokens=(8, 16), seed=3)
    s = res.summary()
    assert s.failed == 0 and s.completed == 24, s.error_samples
    after = {e["replica"]: scrape(e).value("dspark_generation_tokens_total", 0.0, replica=e["replica"]) for e in reps}
    delta = {r: after[r] - before[r] for r in after}
    assert sum(delta.values()) == sum(q.max_tokens for q in reqs)
    assert all(d > 0 for d in delta.values()), f"the router sent everything to one replica: {delta}"
    for e in reps:  # each sample carries the replica's own labels
        m = scrape(e)
        info = [x for x in m.samples if x.name == "dspark_model_info"]
        assert info and all(x.labels["replica"] == e["replica"] and x.labels["node"] == e["node_id"][:12]
                            for x in info)
    ingress = Metrics(httpx.get(f"{served.base_url}/metrics", timeout=10).text)
    assert ingress.value("dspark_http_requests_total", route="/v1/completions", status="200") >= 24
    # The ingress names what its replicas run (each replica's own /metrics says its own) and their failovers.
    runs = sorted({x.labels["decoder"] for e in reps for x in scrape(e).samples if x.name == "dspark_decoder_info"})
    health = httpx.get(f"{served.base_url}/health", timeout=10).json()
    assert runs and health["decoder"] == ",".join(runs) and health["decoder_failovers"] == 0, (runs, health)
    assert [x.labels["decoder"] for x in ingress.samples if x.name == "dspark_decoder_info"] == [health["decoder"]]


def test_soak_two_replicas_disconnects_lose_nothing_and_free_every_kv_page(served: ServerHandle) -> None:
    n = 2000
    counts = {e["replica"]: scrape(e) for e in replicas(served)}
    aborts_before = sum(m.value("dspark_requests_finished_total", 0.0, finish_reason="abort") for m in counts.values())
    reqs, res = load(served, n, 64, disconnect=0.2, seed=11)
    s = res.summary()
    plan = disconnect_plan(reqs, 0.2, 11)
    assert s.num_requests == n and s.failed == 0, (s.errors, s.error_samples)
    assert s.completed + s.disconnected == n
    for r, k in zip(res.results, plan, strict=True):
        if k is not None and (k == 0 or r.disconnected):  # hung up after k chunks (0: right after the headers)
            assert r.disconnected and r.chunks == k, r
        else:  # not planned to, or the stream ended in fewer chunks (greedy runs stream several tokens a chunk)
            assert r.ok and r.finish_reason == "length" and r.output_tokens == r.max_tokens, r
            assert k is None or r.chunks < k, r
    assert s.disconnected > 0
    wait_for(lambda: idle(served), 30, "every replica idle with no KV page held")
    aborts = sum(scrape(e).value("dspark_requests_finished_total", 0.0, finish_reason="abort")
                 for e in replicas(served))
    assert aborts > aborts_before, "no hang-up reached a replica while its sequence ran: the abort path went untested"
    print(f"\ncluster soak: {n} requests in {res.duration_s:.1f} s ({n / res.duration_s:.0f} req/s), "
          f"{s.completed} completed, {s.disconnected} disconnected ({aborts - aborts_before:.0f} aborted on replicas)")


def test_replica_killed_mid_load_fails_only_its_own_streams_and_comes_back(served: ServerHandle) -> None:
    # The kill waits until the victim streams (by its own metrics), but a sequence whose first tokens the
    # ingress has not received yet is sent again to the other replica, not failed: on a loaded machine every
    # stream the victim had started could still be in flight to the ingress (a fresh-clone CI run saw all 160
    # complete). So the scenario runs again, with the replica back, until a kill lands mid-stream (at most 3).
    for attempt in range(3):
        s, res, restarted_s = _kill_one_replica_under_load(served, seed=5 + attempt)
        if s.failed:
            break
    else:
        pytest.fail("in 3 kills no stream the ingress had started was on the killed replica")
    assert set(s.errors) == {"stream_error"}, s.errors
    assert "engine_unavailable" in s.error_samples["stream_error"]
    print(f"\nreplica killed under 16 clients: {s.failed} streams failed (engine_unavailable), {s.completed} "
          f"completed; replica back after {restarted_s:.0f} s (kill {attempt + 1})")
    _, after = load(served, 8, 4, seed=6)
    assert after.summary().completed == 8


def _kill_one_replica_under_load(served: ServerHandle, seed: int) -> tuple[Any, Any, float]:
    """SIGKILL one replica while it streams under 160 requests from 16 clients; returns the load's summary
    and results, checked, once the replica is back and both are idle, with the seconds it took to come back."""
    victim = replicas(served)[0]
    tokens_before = scrape(victim).value("dspark_generation_tokens_total", 0.0)
    box: dict[str, Any] = {}

    def go() -> None:
        box["reqs"], box["res"] = load(served, 160, 16, max_tokens=(24, 48), seed=seed)

    t = threading.Thread(target=go)
    t.start()
    # Killed once it has served a few sequences and, at that moment, streams at least two (the router may leave
    # a replica idle for a moment; sequences still in prefill would be sent again instead, not fail).
    wait_for(lambda: scrape(victim).value("dspark_generation_tokens_total", 0.0) >= tokens_before + 60
             and mid_stream(victim) >= 2, 60, "the victim replica to stream tokens")
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    t.join(180)
    assert not t.is_alive(), "the load never finished: something hung after the replica died"
    s = box["res"].summary()
    assert s.completed + s.failed == 160 and s.disconnected == 0
    # Only what had started streaming on the killed replica fails: at most its share of the clients.
    assert s.failed <= 16, s
    assert set(s.errors) <= {"stream_error"}, s.errors
    for r in box["res"].results:
        assert (r.ok and r.output_tokens == r.max_tokens) or r.error == "stream_error", r

    def restarted() -> list[dict[str, Any]] | None:  # one listing read once: two reads can straddle a change
        reps = replicas(served)
        return reps if len(reps) == 2 and all(e["pid"] != victim["pid"] for e in reps) else None

    back = wait_for(restarted, 120, "Ray to restart the killed replica")
    assert len(back) == 2
    restarted_s = time.monotonic() - killed_at
    wait_for(lambda: idle(served), 30, "both replicas idle after the kill")
    return s, box["res"], restarted_s


def test_node_joining_then_one_leaving_moves_its_replica(served: ServerHandle, cluster: LocalCluster) -> None:
    cluster.add_node(num_cpus=1, resources={"dspark_spare": 1})  # a node joins: room for one more replica
    worker, spare, head = (_node_with(r, cluster) for r in ("dspark_worker", "dspark_spare", "dspark_head"))
    assert {e["node_id"] for e in replicas(served)} == {head, worker}
    t0 = time.monotonic()
    cluster.nodes[1].leave()
    cluster.wait_nodes(2)
    wait_for(lambda: (reps := replicas_settled(served)) is not None and len(reps) == 2
             and {e["node_id"] for e in reps} == {head, spare}, 120,
             "the departed worker's replica rescheduled on the new node")
    print(f"\nworker node left: its replica serving again on the new node after {time.monotonic() - t0:.0f} s")
    _, res = load(served, 16, 8, seed=7)
    assert res.summary().completed == 16


def _node_with(resource: str, cluster: LocalCluster) -> str:
    """The id of the live node that declares ``resource``, asked of Ray."""
    out = subprocess.run([sys.executable, "-c", (
        "import ray, json; ray.init(address=%r, log_to_driver=False); "
        "print(json.dumps([n['NodeID'] for n in ray.nodes() if n['Alive'] and %r in n['Resources']]))"
    ) % (cluster.address, resource)], capture_output=True, text=True, timeout=60, env=cluster.env)
    assert out.returncode == 0, out.stderr[-2000:]
    ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(ids) == 1, ids
    return str(ids[0])
