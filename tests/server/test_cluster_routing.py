"""The cluster's routing decision and config, without starting Ray (tests/server/test_cluster.py runs a cluster)."""

from __future__ import annotations

import pytest

from dspark.server.cluster.routing import PREFIX_PAGE, TokenLoad, route_info
from dspark.server.config import ConfigError, load_config


def test_least_outstanding_tokens_not_requests() -> None:
    book = TokenLoad()
    # a: one long request; b: three short ones. Requests would say b is busier; tokens say a is.
    book.chosen("r1", "a", route_info("r1", list(range(3000)), 1000, affinity=False))
    for i in range(3):
        book.chosen(f"s{i}", "b", route_info(f"s{i}", [1, 2, 3], 5, affinity=False))
    assert book.rank(["a", "b"], None) == ["b", "a"]
    book.release("r1")
    assert book.inflight == {"b": 24}
    assert book.rank(["a", "b"], None) == ["a", "b"]


def test_reported_load_counts_what_other_ingresses_sent() -> None:
    book = TokenLoad()
    book.chosen("r1", "a", route_info("r1", [1] * 10, 10, affinity=False))
    assert book.rank(["a", "b"], None, reported={"b": 500}) == ["a", "b"]
    assert book.rank(["a", "b"], None, reported={"a": 5}) == ["b", "a"]  # local 20 > b's 0


def test_a_burst_spreads_when_counted_at_choice() -> None:
    book = TokenLoad()
    picks = []
    for i in range(8):
        info = route_info(f"r{i}", [7] * 20, 20, affinity=False)
        best = book.rank(["a", "b"], info)[0]
        book.chosen(f"r{i}", best, info)
        picks.append(best)
    assert picks.count("a") == picks.count("b") == 4
    book.chosen("r0", "b", route_info("r0", [7] * 20, 20, affinity=False))  # routed elsewhere after all: moved
    assert book.inflight == {"a": 120, "b": 200}


def test_a_choice_never_sent_is_released_after_its_ttl() -> None:
    book = TokenLoad(unconfirmed_ttl_s=30)
    info = route_info("r", [1] * 10, 10, affinity=False)
    book.chosen("r", "a", info, sent=False, now=0.0)
    book.chosen("s", "a", info, sent=False, now=0.0)
    book.chosen("s", "a", info)  # s was sent: confirmed, kept until it completes
    book._expire(now=10.0)
    assert book.inflight == {"a": 40}
    book._expire(now=31.0)  # r waited at the router and was cancelled: never sent, never completed
    assert book.inflight == {"a": 20}
    book.release("s")
    assert book.inflight == {}


def test_prefix_hashes_are_chained_per_page() -> None:
    a = route_info("a", list(range(64)), 1, affinity=True).prefix_hashes
    b = route_info("b", list(range(48)) + [0] * 16, 1, affinity=True).prefix_hashes
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    c = route_info("c", [5] + list(range(1, 64)), 1, affinity=True).prefix_hashes
    assert not set(a) & set(c)  # a different first page changes every later hash


def test_prefix_affinity_follows_the_conversation_until_overloaded() -> None:
    book = TokenLoad(affinity=True, slack_tokens=100)
    turn1 = list(range(40))
    first = route_info("t1", turn1, 10, affinity=True)
    assert len(first.prefix_hashes) == 40 // PREFIX_PAGE
    book.chosen("t1", "b", first)
    book.release("t1")
    book.chosen("other", "b", route_info("other", [9] * 30, 20, affinity=False))  # b: 50 tokens, a: 0
    turn2 = route_info("t2", turn1 + list(range(100, 140)), 10, affinity=True)
    assert book.rank(["a", "b"], turn2)[0] == "b"  # within the slack: the prefix's replica
    book.chosen("big", "b", route_info("big", [9] * 200, 0, affinity=False))
    assert book.rank(["a", "b"], turn2)[0] == "a"  # 250 > 0 + 100: load wins
    unrelated = route_info("u", list(range(500, 540)), 10, affinity=True)
    assert book.rank(["a", "b"], unrelated)[0] == "a"
    book.forget("b")
    assert "b" not in book.inflight and book.rank(["a", "c"], turn2) == ["a", "c"]


def test_no_affinity_no_hashes() -> None:
    assert route_info("r", list(range(100)), 5, affinity=False).prefix_hashes == ()
    assert route_info("r", list(range(15)), 5, affinity=True).prefix_hashes == ()  # shorter than one page


def test_cluster_config_is_validated_with_field_paths() -> None:
    assert not load_config(None).cluster.enabled
    c = load_config(None, {"replicas": 3})
    assert c.cluster.enabled and c.cluster.replicas == 3
    with pytest.raises(ConfigError, match=r"cluster\.replicas"):
        load_config(None, {"replicas": 0})
    with pytest.raises(ConfigError, match=r"cluster: .*either replicas or autoscaling"):
        _load({
            "cluster": {"replicas": 2, "autoscaling": {"max_replicas": 3}}})
    with pytest.raises(ConfigError, match=r"cluster\.autoscaling: .*min_replicas \(5\) exceeds max_replicas"):
        _load({"cluster": {"autoscaling": {"min_replicas": 5, "max_replicas": 3}}})
    with pytest.raises(ConfigError, match=r"cluster\.router"):
        _load({"cluster": {"replicas": 1, "router": "random"}})
    with pytest.raises(ConfigError, match=r"cluster\.resources_per_replica\.num_gpu: unknown field"):
        _load({"cluster": {"replicas": 1, "resources_per_replica": {"num_gpu": 1}}})


def _load(raw: dict[str, object]) -> object:
    import tempfile
    from pathlib import Path

    import yaml

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.yaml"
        p.write_text(yaml.safe_dump(raw))
        return load_config(p)


def test_engine_deployment_options_from_the_config() -> None:
    pytest.importorskip("ray.serve")
    from dspark.server.cluster.deploy import engine_options, replica_threads
    from dspark.server.cluster.router import TokenAwareRouter

    c = _load({"cluster": {"autoscaling": {"min_replicas": 1, "max_replicas": 6, "target_ongoing_requests": 8},
                           "resources_per_replica": {"num_cpus": 2, "custom": {"npu": 1}, "memory_bytes": 2**30},
                           "router": "prefix_affinity", "max_ongoing_requests": 48}})
    opts = engine_options(c)  # type: ignore[arg-type]
    assert opts["autoscaling_config"]["max_replicas"] == 6 and opts["autoscaling_config"]["target_ongoing_requests"] == 8
    assert "num_replicas" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 0, "resources": {"npu": 1}, "memory": 2**30}
    assert opts["max_ongoing_requests"] == 48
    rc = opts["request_router_config"]
    assert rc.request_router_kwargs["affinity"] is True
    assert rc.get_request_router_class() is TokenAwareRouter
    assert replica_threads(c) == 2  # type: ignore[arg-type]
    p2 = engine_options(_load({"cluster": {"replicas": 2, "router": "power_of_two"}}))  # type: ignore[arg-type]
    assert p2["num_replicas"] == 2 and "request_router_config" not in p2


def test_the_ingress_sums_its_replicas_decoders_and_failovers() -> None:
    from dspark.llm.engine import EngineStats
    from dspark.server.cluster.frontend import _sum_stats

    def entry(decoder: str, failovers: int) -> dict[str, object]:
        s = EngineStats(kv_used_bytes=0, kv_total_bytes=0, kv_used_pages=0, kv_free_pages=4, kv_total_pages=4,
                        kv_usage=0.0, kv_fragmentation=0.0, page_size=16, num_running=0, num_waiting=0,
                        num_preemptions=0, effective_max_batch=8, decoder=decoder, decoder_failovers=failovers)
        return {"stats": s.__dict__}  # as a replica reports it (replica.record_routing_stats)

    same = _sum_stats([entry("cpu@cpu", 0), entry("cpu@cpu", 0)])
    assert (same.decoder, same.decoder_failovers) == ("cpu@cpu", 0)
    mixed = _sum_stats([entry("torch", 1), entry("cpu@cpu", 0), entry("llamacpp@cpu", 2)])
    assert (mixed.decoder, mixed.decoder_failovers) == ("cpu@cpu,llamacpp@cpu,torch", 3)
