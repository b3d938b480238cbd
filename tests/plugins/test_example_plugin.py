"""The example third-party plugin installs with pip, is discovered, and passes the kit.

It is installed the way a user would (pip, into a separate directory on
PYTHONPATH) and exercised in subprocesses, so discovery goes through the
installed distribution's entry point, not through this repository's tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_install import install_plugin

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "plugins" / "dspark-numpy"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for subprocesses that see the plugin installed in a temp dir."""
    return install_plugin(PLUGIN_DIR, tmp_path_factory.mktemp("dspark_numpy"))


def test_devices_lists_the_plugin_from_its_entry_point(plugin_env: dict[str, str]) -> None:
    # Only this plugin: the others are not what this test is about, and their probes cost time.
    env = {**plugin_env, "DSPARK_PLUGINS": "numpy"}
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", "devices", "--json"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    inventory = json.loads(proc.stdout)
    plugins = {p["name"]: p for p in inventory["plugins"]}
    numpy_plugin = plugins["numpy"]
    assert numpy_plugin["source"] == "entry point"
    assert numpy_plugin["module"] == "dspark_numpy"
    assert numpy_plugin["version"] == "0.1.0"
    assert numpy_plugin["api_version"] == "1.10"
    assert numpy_plugin["status"] == "active", numpy_plugin["reason"]
    assert numpy_plugin["devices"] == ["cpu"]
    cpu = next(d for d in inventory["devices"] if d["id"] == "cpu")
    driver = next(d for d in cpu["drivers"] if d["plugin"] == "numpy")
    assert driver["runtime"] == "numpy" and driver["peak_flops"]["float32"] > 0
    # The installed copy is the one found, not the source tree.
    where = subprocess.run([sys.executable, "-c", "import dspark_numpy; print(dspark_numpy.__file__)"],
                           capture_output=True, text=True, env=env, timeout=60, cwd=REPO)
    assert where.stdout.startswith(env["PYTHONPATH"].split(os.pathsep)[0]), where.stdout + where.stderr


def test_the_plugins_own_suite_passes(plugin_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"],
        capture_output=True, text=True, env=plugin_env, timeout=300, cwd=PLUGIN_DIR,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    # The base class generated one test per op case; unsupported ones skip with the reason.
    assert "test_op_matches_reference[chain_attention] PASSED" in out, out
    assert "test_op_matches_reference[Conv] SKIPPED" in out, out
    assert "test_probe_valid_idempotent_fast PASSED" in out, out
    assert "test_quantize SKIPPED" in out, out
    assert "test_decoders PASSED" in out, out  # every family on the ops of dspark.sdk.family (API 1.10)
