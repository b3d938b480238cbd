"""Measured runtime hand-over costs, and the placer counting them."""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark.host import cache
from dspark.cli.demo import demo_graph
from dspark.host.inventory import probe
from dspark.placement.placer import build_problem, collect_op_bids
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.placement.switching import NAMESPACE, switch_matrix, switch_overhead


def test_switch_overhead_is_measured_cached_and_symmetric() -> None:
    host = PluginHost(PluginSettings.from_env(env={})).load()
    inv = probe(host)
    ov = next(d for d in inv.drivers() if d.plugin == "cpu")
    ort = next(d for d in inv.drivers() if d.plugin == "npu")
    cache.clear(NAMESPACE)
    compiled: list[str] = []
    real_call = host.call

    def call(name: str, hook: str, **kwargs: Any) -> Any:
        compiled.append(f"{name}.{hook}")
        return real_call(name, hook, **kwargs)

    host.call = call  # type: ignore[method-assign]
    first = switch_overhead(host, ov, ort)
    assert first >= 0.0
    assert compiled == ["cpu.dspark_compile", "npu.dspark_compile"]  # measured: both runtimes compiled the probe
    assert switch_overhead(host, ort, ov) == first  # one figure per unordered pair, from the cache...
    assert len(compiled) == 2  # ...nothing compiled (or timed) again
    assert switch_overhead(host, ov, ov) == 0.0


def test_placer_charges_hand_overs_between_host_runtimes() -> None:
    host = PluginHost(PluginSettings.from_env(env={})).load()
    inv = probe(host)
    graph = demo_graph()
    table = collect_op_bids(host, inv, graph)
    switch = switch_matrix(host, table.targets, [True] * len(table.targets))
    plain = build_problem(graph, inv, table)
    charged = build_problem(graph, inv, table, switch=switch)
    a, b = 0, 1
    s = next(i for i, tf in enumerate(plain.tensors) if tf.producer >= 0)
    assert np.isclose(charged.transfer[s, a, b] - plain.transfer[s, a, b], switch[a, b])
    assert np.allclose(np.diagonal(charged.transfer[s]), 0.0)
