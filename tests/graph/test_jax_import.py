"""JAX functions and Flax modules, imported through jax2onnx, planned and run like any ONNX model.

Outputs are compared with JAX's own, for a small Flax MLP, a small Flax
transformer block, a ``flax.linen`` module and a plain JAX function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

for _package in ("jax", "flax", "jax2onnx"):
    pytest.importorskip(_package, reason=f"{_package} is not installed (the 'jax' extra and jax2onnx; "
                                         "scripts/setup.sh installs them)")

import jax.numpy as jnp  # noqa: E402

import dspark  # noqa: E402
from dspark import TOLERANCES  # noqa: E402
from dspark.graph import Graph  # noqa: E402
from dspark.graph.importers import load_model  # noqa: E402
from dspark.graph.jax_import import is_jax_model  # noqa: E402
from dspark.graph.onnx_io import UnsupportedModelError  # noqa: E402
from dspark.host.inventory import Inventory, probe  # noqa: E402
from dspark.host.plugin_manager import PluginHost  # noqa: E402
from dspark.host.settings import PluginSettings  # noqa: E402
from dspark.placement.executor import compile_plan, forced_plan  # noqa: E402
from dspark.placement.fallback import compile_with_fallback  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "tests" / "models" / "flax_zoo.py"
sys.path.insert(0, str(ZOO.parent))
import flax_zoo  # noqa: E402


@pytest.fixture(scope="module")
def real() -> Iterator[tuple[PluginHost, Inventory]]:
    # Bids from the roofline: what is checked here is the numbers, and timing every op of
    # the block on three runtimes would take minutes on a loaded machine.
    old = os.environ.get("DSPARK_CALIBRATE")
    os.environ["DSPARK_CALIBRATE"] = "0"
    host = PluginHost(PluginSettings(blocked={"cuda", "ngram"})).load()
    yield host, probe(host)
    if old is None:
        os.environ.pop("DSPARK_CALIBRATE", None)
    else:
        os.environ["DSPARK_CALIBRATE"] = old


def planned_run(graph: Graph, real: tuple[PluginHost, Inventory], feed: dict[str, np.ndarray]) -> dict[str, Any]:
    """Plan on every CPU runtime, compile (with fallback) and run once: what ``dspark run`` does."""
    host, inv = real
    resilient = compile_with_fallback(graph, host, inv)
    try:
        return resilient.run(feed)
    finally:
        resilient.close()


def assert_matches_jax(got: np.ndarray, want: Any) -> None:
    rtol, atol = TOLERANCES["float32"]
    np.testing.assert_allclose(got, np.asarray(want), rtol=rtol, atol=atol)


@pytest.mark.parametrize("factory", ["mlp", "block"])
def test_a_flax_module_runs_as_jax_computes_it(real: tuple[PluginHost, Inventory], factory: str) -> None:
    module, inputs, dynamic = getattr(flax_zoo, factory)()
    graph = load_model(module, example_inputs=inputs, dynamic=dynamic, name=factory)
    (x,) = inputs
    (out,) = graph.outputs
    assert graph.inputs == ["x"] and graph.dim_hints["batch"] == x.shape[0]
    assert isinstance(graph.tensors["x"].shape[0], str)  # the declared batch dim stays symbolic
    assert_matches_jax(planned_run(graph, real, {"x": x})[out], module(jnp.asarray(x)))


def test_a_module_factory_spec_loads_and_a_split_plan_matches_jax(real: tuple[PluginHost, Inventory]) -> None:
    host, inv = real
    graph = load_model(f"{ZOO}:block")
    assert graph.name == "block" and len(graph.ops) > 20
    targets = [k for k in ("cpu@cpu", "npu@cpu", "torch@cpu") if k in {f"{d.plugin}@{d.id}" for d in inv.drivers()}]
    index = {op.name: i for i, op in enumerate(graph.ops)}
    plan = forced_plan(graph, inv, lambda op: targets[index[op] * len(targets) // len(graph.ops)])
    module, (x,), _ = flax_zoo.block()
    got = compile_plan(graph, plan, host, inv).run({"x": x})
    assert_matches_jax(got[graph.outputs[0]], module(jnp.asarray(x)))


def test_a_linen_module_and_a_plain_jax_function(real: tuple[PluginHost, Inventory]) -> None:
    fn, (x,) = flax_zoo.linen_mlp()
    graph = load_model(f"{ZOO}:linen_mlp")
    assert_matches_jax(planned_run(graph, real, {"x": x})[graph.outputs[0]], fn(jnp.asarray(x)))
    rng = np.random.default_rng(3)
    a, w = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)
    graph = dspark.import_jax(flax_zoo.gated, (a, w), dynamic={"x": {0: "rows"}})
    assert graph.inputs == ["x", "w"] and graph.tensors["x"].shape == ("rows", 6) and graph.dim_hints == {"rows": 5}
    assert_matches_jax(planned_run(graph, real, {"x": a, "w": w})[graph.outputs[0]], flax_zoo.gated(a, w))


def test_a_session_takes_a_plain_jax_function(real: tuple[PluginHost, Inventory]) -> None:
    host, inv = real
    rng = np.random.default_rng(4)
    a, w = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)
    with dspark.Session(flax_zoo.gated, example_inputs=(a, w), dynamic={"x": {0: "rows"}}, host=host,
                        inventory=inv, plan_cache=False) as session:
        assert [(i.name, i.shape) for i in session.get_inputs()] == [("x", ["rows", 6]), ("w", [6, 3])]
        b = rng.standard_normal((9, 6)).astype(np.float32)  # another row count than the example's
        (got,) = session.run(None, {"x": b, "w": w})
        assert_matches_jax(got, flax_zoo.gated(b, w))


def test_jax_models_are_told_apart_without_calling_them() -> None:
    module, _, _ = flax_zoo.mlp()
    assert is_jax_model(module) and not is_jax_model(flax_zoo.gated) and not is_jax_model(flax_zoo.MLP)
    with pytest.raises(UnsupportedModelError, match="variables"):
        dspark.import_jax(flax_zoo.LinenMLP(), (np.ones((1, 16), np.float32),))
    with pytest.raises(ValueError, match="name the dim"):
        dspark.import_jax(flax_zoo.gated, (np.ones((2, 3), np.float32), np.ones((3, 3), np.float32)),
                          dynamic={"x": {0: 7}})


def test_dspark_run_takes_a_flax_spec() -> None:
    env = {**os.environ, "DSPARK_PLUGINS": "no:cuda,no:ngram", "DSPARK_CALIBRATE": "0"}
    r = subprocess.run([sys.executable, "-m", "dspark.cli", "run", f"{ZOO}:mlp", "--json", "--repeat", "1"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["ok"] and report["model"] == "mlp" and report["partitions"]
