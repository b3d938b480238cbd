"""``dspark plan`` / ``dspark run`` end to end, and planning against device profiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from dspark.placement import placer
from dspark.graph.model import Graph
from dspark.placement.placer_ilp import solve
from dspark.placement.profile import ProfileError, load_profile, parse_profile, profile_host
from dspark.testing import demo_graph, demo_onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "tests" / "profiles"


def dspark(*args: str, timeout: float = 240, extra_env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    # Only the CPU runtimes: keeps the subprocesses lean on a shared machine.
    env = {**os.environ, "DSPARK_PLUGINS": "no:cuda,no:ngram", **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "dspark.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "block.onnx"
    onnx.save(demo_onnx(), path)
    return path


@pytest.fixture(scope="module")
def saved_plan(model: Path) -> tuple[Path, dict[str, object]]:
    path = model.parent / "plan.json"
    r = dspark("plan", str(model), "--json", "--save", str(path))
    assert r.returncode == 0, r.stderr
    return path, json.loads(r.stdout)


def test_commands_registered_when_the_console_script_imports_the_cli() -> None:
    import dspark.cli.main

    names = {c.name or c.callback.__name__ for c in dspark.cli.main.app.registered_commands if c.callback}
    assert {"plan", "run", "devices", "demo"} <= names


def test_plan_json_lists_partitions_and_total(saved_plan: tuple[Path, dict[str, object]]) -> None:
    path, data = saved_plan
    parts = data["partitions"]
    assert isinstance(parts, list) and parts
    ops = [op for p in parts for op in p["ops"]]
    assert sorted(ops) == sorted(op.name for op in demo_graph().ops)
    for p in parts:
        assert {"device", "plugin", "ops", "predicted_ms"} <= set(p)
    assert data["predicted_total_ms"] > 0 and data["gate"]
    assert json.loads(path.read_text())["graph_fingerprint"] == data["graph_fingerprint"]


def test_run_reuses_a_matching_saved_plan(model: Path, saved_plan: tuple[Path, dict[str, object]],
                                          tmp_path: Path) -> None:
    path, _ = saved_plan
    x = np.random.default_rng(0).standard_normal((1, 32, 64)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    r = dspark("run", str(model), "--plan", str(path), "--inputs", str(tmp_path / "x.npz"), "--repeat", "2", "--json")
    assert r.returncode == 0, r.stderr + r.stdout[:3000]
    report = json.loads(r.stdout)
    assert report["plan_source"] == "loaded" and report["replan_reason"] is None
    assert report["ok"] and report["max_abs_error"] < 1e-3
    assert all(p["measured_ms"] > 0 for p in report["partitions"])
    assert report["measured_total_ms"] > 0


def test_run_replans_when_the_model_changed(model: Path, saved_plan: tuple[Path, dict[str, object]],
                                            tmp_path: Path) -> None:
    _, data = saved_plan
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({**data, "graph_fingerprint": "0" * 16}))
    r = dspark("run", str(model), "--plan", str(stale), "--repeat", "2", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["plan_source"] == "planned" and "model changed" in report["replan_reason"]
    assert report["ok"]


def test_plan_against_a_profile_uses_its_devices() -> None:
    r = dspark("plan", "demo", "--json", "--devices", str(PROFILES / "edge_box.yaml"))
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {p["device"] for p in data["partitions"]} <= {"cpu", "gpu:0", "npu:0"}
    r = dspark("plan", "demo", "--devices", str(PROFILES / "edge_box.yaml"))
    assert r.returncode == 0 and "predicted total" in r.stdout and "gate" in r.stdout


def test_bad_model_path_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.onnx"
    r = dspark("plan", str(missing), "--json")
    assert r.returncode == 2
    assert str(missing) in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_bad_profile_field_is_a_clear_error(tmp_path: Path) -> None:
    data = yaml.safe_load((PROFILES / "edge_box.yaml").read_text())
    data["devices"][1]["peak_flops"]["float16"] = -1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError, match=r"devices\.1\.peak_flops\.float16"):
        parse_profile(bad)
    r = dspark("plan", "demo", "--devices", str(bad))
    assert r.returncode == 2
    assert str(bad) in r.stderr and "devices.1.peak_flops.float16" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


# -- profiles, in process ------------------------------------------------------

def test_profiles_load_with_units() -> None:
    inv = load_profile(PROFILES / "edge_box.yaml")
    gpu = inv.device("gpu:0")
    assert gpu.memory_total_bytes == 4 * 2**30 and gpu.peak_flops["float16"] == 16e12
    assert {d.plugin for d in inv.drivers()} == {"cpu", "torch", "cuda", "npu"}
    assert inv.device("npu:0").dtypes == ["float16", "int8"]


def mlp_graph(layers: int = 4, dim: int = 1024, batch: int = 256) -> Graph:
    """Compute-heavy MLP, 4 MiB of weights per layer: the GPU is worth using, but cannot hold it all."""
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array(rng.standard_normal((dim, dim), dtype=np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Relu", [f"m{i}"], [f"h{i}"], name=f"relu{i}")]
        x = f"h{i}"
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, dim])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, dim])], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return Graph.from_onnx(model, name="mlp")


def small_gpu_profile(tmp_path: Path) -> Path:
    """The shipped edge box with its GPU memory scaled down to 10 MiB (the MLP holds 16 MiB of weights)."""
    data = yaml.safe_load((PROFILES / "edge_box.yaml").read_text())
    data["devices"][1]["memory_total_bytes"] = "10 MiB"
    path = tmp_path / "small_gpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def gpu_weights(graph: Graph, assignment: dict[str, str]) -> int:
    return sum(graph.op(op).param_bytes for op, key in assignment.items() if key.endswith("@gpu:0"))


def test_weights_over_the_gpu_budget_split_the_model_solver(tmp_path: Path) -> None:
    graph = mlp_graph()
    host, inv = profile_host(small_gpu_profile(tmp_path))
    table = placer.collect_op_bids(host, inv, graph)
    problem = placer.build_problem(graph, inv, table)
    assignment, _, _ = solve(problem)
    chosen = {op.name: problem.targets[a] for op, a in zip(graph.ops, assignment, strict=True)}
    budget = inv.device("gpu:0").memory_free_bytes * placer.MEMORY_HEADROOM  # type: ignore[operator]
    assert sum(op.param_bytes for op in graph.ops) > budget
    assert 0 < gpu_weights(graph, chosen) <= budget
    assert len(set(chosen.values())) > 1


def test_weights_over_the_gpu_budget_split_the_model(tmp_path: Path) -> None:
    graph = mlp_graph()
    host, inv = profile_host(small_gpu_profile(tmp_path))
    plan = placer.plan(graph, host, inv)
    budget = inv.device("gpu:0").memory_free_bytes * placer.MEMORY_HEADROOM  # type: ignore[operator]
    assert len(plan.partitions) > 1
    assert gpu_weights(graph, plan.assignment()) <= budget


def test_cpu_only_box_gives_one_partition() -> None:
    graph = demo_graph()
    host, inv = profile_host(PROFILES / "cpu_box.yaml")
    plan = placer.plan(graph, host, inv)
    assert len(plan.partitions) == 1 and plan.partitions[0].device == "cpu"


def test_profile_runtime_abstains_on_unsupported_ops() -> None:
    graph = demo_graph()
    host, inv = profile_host(PROFILES / "edge_box.yaml")
    table = placer.collect_op_bids(host, inv, graph)
    assert "npu@npu:0" not in table.op_bids["softmax"] and "npu@npu:0" in table.op_bids["q_proj"]
    assert table.op_bids["q_proj"]["npu@npu:0"].precision == "float16"


def with_bad_plugin(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``dspark ARGS -p bad_plugins:NAME`` with the torch reference as the only other plugin."""
    env = {"PYTHONPATH": str(ROOT / "tests"), "DSPARK_PLUGINS": f"torch,{name}"}
    return dspark(*args, "-p", f"bad_plugins:{name}", extra_env=env)


def plugin_entry(report: dict[str, object], name: str) -> dict[str, object]:
    return next(p for p in report["plugins"] if p["name"] == name)  # type: ignore[union-attr, index]


@pytest.mark.parametrize("bad,stage,hook,needle", [
    ("CompileFailsOnSoftmax", "compile", "dspark_compile", "cannot lower Softmax"),
    ("RaisesAtRun", "run", "run", "kernel launch failed"),
])
def test_run_finishes_on_another_target_when_a_partition_fails(model: Path, bad: str, stage: str, hook: str,
                                                               needle: str) -> None:
    r = with_bad_plugin(bad, "run", str(model), "--repeat", "1", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and report["max_abs_error"] < 1e-3
    target = f"{bad}@cpu"
    failed = [f for f in report["fallbacks"] if f["stage"] == stage]
    assert failed and failed[0]["target"] == target and needle in failed[0]["reason"]
    assert "softmax" in failed[0]["ops"]
    assert all(p["target"] != target for p in report["partitions"])  # finished elsewhere
    entry = plugin_entry(report, bad)
    assert entry["status"] == "active"  # charged to the subgraph, not the plugin
    faults = [f for f in entry["faults"] if f["hook"] == hook]
    assert faults and needle in faults[0]["reason"] and faults[0]["device"] == "cpu"
    assert faults[0]["charged_to"] == "subgraph" and faults[0]["subgraph"]
    # The table output says so too.
    r = with_bad_plugin(bad, "run", str(model), "--repeat", "1")
    assert r.returncode == 0, r.stderr
    assert "fallback:" in r.stdout and "Plugin failures" in r.stdout and needle in r.stdout


def test_plan_shows_every_plugins_failures() -> None:
    r = with_bad_plugin("BidRaisesOnSoftmax", "plan", "demo", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert {p["name"] for p in data["plugins"]} >= {"torch", "BidRaisesOnSoftmax"}
    assert plugin_entry(data, "torch")["faults"] == []
    entry = plugin_entry(data, "BidRaisesOnSoftmax")
    assert entry["status"] == "active"
    fault = next(f for f in entry["faults"] if f["hook"] == "dspark_bid")
    assert "Softmax" in fault["ops"] and "no cost model for Softmax" in fault["reason"] and fault["count"] >= 1
    softmax = next(p for p in data["partitions"] if "softmax" in p["ops"])
    assert softmax["plugin"] == "torch"
    r = with_bad_plugin("BidRaisesOnSoftmax", "plan", "demo")
    assert r.returncode == 0, r.stderr
    assert "Plugin failures" in r.stdout and "no cost model for Softmax" in r.stdout


@pytest.mark.parametrize("args,hooks", [
    (("plan", "demo", "--json"), ("dspark_probe_devices", "dspark_bid")),
    (("run", "demo", "--repeat", "1", "--json"), ("dspark_probe_devices", "dspark_bid", "dspark_compile")),
])
def test_trace_prints_every_hook_call(args: tuple[str, ...], hooks: tuple[str, ...]) -> None:
    r = dspark(*args, extra_env={"DSPARK_TRACE": "1", "DSPARK_PLUGINS": "torch"})
    assert r.returncode == 0, r.stderr
    json.loads(r.stdout)  # the trace goes to stderr only
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dspark.trace ")]
    for hook in hooks:
        assert any(f"plugin=torch hook={hook} " in ln and "outcome=ok" in ln for ln in lines), (hook, r.stderr[-2000:])
    assert all(" ms=" in ln and " outcome=" in ln for ln in lines)


def test_a_plan_says_how_it_won(saved_plan: tuple[Path, dict[str, object]]) -> None:
    _, data = saved_plan
    decision = str(data["decision"])
    # Without --measure nothing is raced: the decision is the prediction, naming any rival left unmeasured.
    assert decision.startswith("predicted: "), decision
    assert "use --measure" in decision or "beyond the cost model's error" in decision or "no rival" in decision


def test_plan_measure_races_close_plans_and_saves_the_decision(model: Path, tmp_path: Path) -> None:
    path = tmp_path / "measured.json"
    r = dspark("plan", str(model), "--measure", "--json", "--save", str(path))
    assert r.returncode == 0, r.stderr
    decision = json.loads(r.stdout)["decision"]
    assert decision.startswith(("measured: ", "predicted: ")), decision
    assert "use --measure" not in decision  # measured, or no rival was close enough to race
    if decision.startswith("measured: "):
        assert "random inputs" in decision and "beat" in decision
    assert json.loads(path.read_text())["decision"] == decision


def test_plan_measure_options_are_checked(model: Path, tmp_path: Path) -> None:
    r = dspark("plan", str(model), "--inputs", str(tmp_path / "x.npz"))
    assert r.returncode != 0 and "--inputs is for --measure" in r.stderr, r.stderr
    r = dspark("plan", str(model), "--measure", "--devices", str(PROFILES / "cpu_box.yaml"))
    assert r.returncode != 0 and "cannot measure a --devices profile" in r.stderr, r.stderr
