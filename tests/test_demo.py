"""The bundled demo model runs on every target that bids, matching the torch reference."""

from __future__ import annotations

import json
import subprocess
import sys

from dspark.cli.demo import run_demo
from dspark.host.inventory import probe
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.testing import demo_graph


def test_demo_graph_is_analysed() -> None:
    g = demo_graph()
    assert len(g.ops) == 20
    assert g.op("q_proj").flops == 2 * 32 * 64 * 64
    assert g.op("q_proj").param_bytes == 64 * 64 * 4
    assert ("ln1", "q_proj", "h") in g.edges()


def test_demo_runs_on_every_cpu_runtime() -> None:
    host = PluginHost(PluginSettings.from_env(env={})).load()
    rows = run_demo(host, probe(host), repeat=3)
    ran = {(r.plugin, r.device) for r in rows if r.measured_ms is not None}
    assert {("torch", "cpu"), ("cpu", "cpu"), ("npu", "cpu")} <= ran
    bad = [r for r in rows if r.measured_ms is not None and not r.ok]
    assert not bad, bad


def test_demo_cli_json() -> None:
    res = subprocess.run([sys.executable, "-m", "dspark.cli", "demo", "--json", "--repeat", "2"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    targets = json.loads(res.stdout)["targets"]
    assert any(t["plugin"] == "torch" and t["ok"] for t in targets)
