"""A partition whose compile or run fails is planned around, through the Python API, with real bad plugins."""

from __future__ import annotations

import numpy as np
import pytest
from bad_plugins import CompileFailsOnSoftmax, RaisesAtRun
from dspark import PluginStatus
from dspark.cli.demo import demo_graph
from dspark.host.inventory import Inventory, probe
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.placement import placer
from dspark.placement.executor import PartitionFailed, forced_plan, random_inputs, reference_outputs
from dspark.placement.fallback import compile_with_fallback, plan_around


def host_with(plugin: object, name: str) -> tuple[PluginHost, Inventory]:
    host = PluginHost(PluginSettings(autoload=False, blocked={"ngram", "drafters"})).load()
    host.register(plugin, name)
    return host, probe(host)


def check_outputs(graph: object, resilient: object) -> None:
    feed = random_inputs(graph)  # type: ignore[arg-type]
    out = resilient.run(feed)  # type: ignore[attr-defined]
    ref = reference_outputs(graph, feed)  # type: ignore[arg-type]
    for name, value in ref.items():
        np.testing.assert_allclose(out[name], value, rtol=1e-4, atol=1e-5)


def test_failed_compile_is_planned_around_and_the_run_finishes() -> None:
    graph = demo_graph()
    host, inv = host_with(CompileFailsOnSoftmax(), "picky")
    first = placer.plan(graph, host, inv)
    assert {p.target.plugin for p in first.partitions} == {"picky"}  # its bids are the cheapest
    resilient = compile_with_fallback(graph, host, inv, first)
    try:
        check_outputs(graph, resilient)
        [fb] = resilient.fallbacks
        assert fb.stage == "compile" and fb.target == "picky@cpu" and "softmax" in fb.ops
        assert "cannot lower Softmax" in fb.reason
        softmax_part = next(p for p in resilient.plan.partitions if "softmax" in p.ops)
        assert softmax_part.target.plugin != "picky"
        record = host.records["picky"]
        assert record.status == PluginStatus.ACTIVE  # one odd subgraph does not cost the plugin
        [fault] = record.faults
        assert fault.hook == "dspark_compile" and fault.device == "cpu" and fault.charged_to == "subgraph"
        assert "Softmax" in fault.ops and fault.subgraph == graph.subgraph(fb.ops).signature()
        assert inv.faults() == [fault]  # the inventory's records are the host's, kept up to date
    finally:
        resilient.close()


def test_only_the_failing_partition_moves_in_a_split_plan() -> None:
    graph = demo_graph()
    host, inv = host_with(CompileFailsOnSoftmax(), "picky")
    plan = forced_plan(graph, inv, lambda op: "picky@cpu" if op == "softmax" else "torch@cpu")
    resilient = compile_with_fallback(graph, host, inv, plan)
    try:
        check_outputs(graph, resilient)
        [fb] = resilient.fallbacks
        assert fb.ops == ["softmax"] and fb.stage == "compile"
        assert all(p.target.key != "picky@cpu" for p in resilient.plan.partitions if "softmax" in p.ops)
        # The plugin keeps bidding on (and compiling) subgraphs without a Softmax.
        mm = graph.subgraph(["q_proj"])
        device = next(d for d in inv.drivers() if d.plugin == "picky")
        assert host.call("picky", "dspark_bid", subgraph=mm, device=device) is not None
        assert host.call("picky", "dspark_compile", subgraph=mm, device=device) is not None
    finally:
        resilient.close()


def test_executable_raising_at_run_time_is_planned_around() -> None:
    graph = demo_graph()
    host, inv = host_with(RaisesAtRun(), "flaky")
    resilient = compile_with_fallback(graph, host, inv)
    assert {p.target.plugin for p in resilient.plan.partitions} == {"flaky"}
    try:
        check_outputs(graph, resilient)
        run_fallbacks = [f for f in resilient.fallbacks if f.stage == "run"]
        assert run_fallbacks and all(f.target == "flaky@cpu" for f in run_fallbacks)
        assert "kernel launch failed" in run_fallbacks[0].reason
        assert all(p.target.plugin != "flaky" for p in resilient.plan.partitions)
        run_faults = [f for f in host.records["flaky"].faults if f.hook == "run"]
        assert run_faults and all("kernel launch failed" in f.reason for f in run_faults)
        check_outputs(graph, resilient)  # later runs go straight to the new plan
        assert len([f for f in resilient.fallbacks if f.stage == "run"]) == len(run_fallbacks)
    finally:
        resilient.close()


def test_no_target_left_names_the_op_and_the_failures() -> None:
    graph = demo_graph()
    host = PluginHost(PluginSettings(autoload=False, blocked={"ngram", "drafters", "torch"})).load()
    host.register(CompileFailsOnSoftmax(), "picky")
    inv = probe(host)
    with pytest.raises(placer.PlacementError, match=r"no plugin bids on op 'ln1'.*after planning around "
                       r"failures: compile of partition 0 on picky@cpu.*cannot lower Softmax"):
        compile_with_fallback(graph, host, inv)


def test_plan_around_takes_out_the_failed_bids_and_all_of_a_plugin_that_failed_as_a_whole() -> None:
    """The one re-plan routine (placement.fallback.plan_around), which the adaptive runner shares: a run
    failure is charged and that target's bids for the partition's ops leave the table; a plugin that has
    failed as a whole loses every bid, wherever they were."""
    graph = demo_graph()
    host = PluginHost(PluginSettings(autoload=False, blocked={"ngram", "drafters"})).load()
    host.register(RaisesAtRun(), "flaky")
    host.register(CompileFailsOnSoftmax(), "picky")
    inv = probe(host)
    table = placer.collect_op_bids(host, inv, graph)
    assert all({"flaky@cpu", "picky@cpu"} <= set(table.op_bids[op.name]) for op in graph.ops)
    plan = forced_plan(graph, inv, lambda op: "flaky@cpu" if op in ("q_proj", "k_proj") else "torch@cpu")
    part = next(p for p in plan.partitions if p.target.key == "flaky@cpu")
    try:
        raise RuntimeError("kernel launch failed")
    except RuntimeError as cause:
        exc = PartitionFailed(part, "raised")
        exc.__cause__ = cause
    reason = plan_around(host, graph, table, exc, "run")
    assert reason == "RuntimeError: kernel launch failed"
    assert [f.hook for f in host.records["flaky"].faults] == ["run"]
    for op in graph.ops:
        assert ("flaky@cpu" in table.op_bids[op.name]) == (op.name not in part.ops), op.name
    host.fail("picky", "lost its device")
    plan_around(host, graph, table, exc, "compile")  # a compile failure is charged by the host call: not again
    assert [f.hook for f in host.records["flaky"].faults] == ["run"]
    assert not any("picky@cpu" in bids for bids in table.op_bids.values())
