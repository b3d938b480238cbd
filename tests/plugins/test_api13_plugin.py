"""A plugin written against plugin API 1.3 still installs, loads, is listed and passes the kit.

The fixture (tests/fixtures/dspark-api13) was written only from docs/plugins.md as it stood
for 1.3: ``DSPARK_API_VERSION = "1.3"`` and the module names that API documented
(``dspark.cost``, ``dspark.quant``, ``dspark.cache``, ``dspark.calibration``,
``dspark.hostinfo``, ``dspark.log``). It is installed with pip into a separate directory and
exercised in subprocesses, so discovery goes through its entry point.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_install import install_plugin

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "tests" / "fixtures" / "dspark-api13"


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return install_plugin(PLUGIN_DIR, tmp_path_factory.mktemp("dspark_api13"))


def test_fixture_is_written_against_1_3() -> None:
    source = (PLUGIN_DIR / "src" / "dspark_api13" / "__init__.py").read_text()
    assert 'DSPARK_API_VERSION = "1.3"' in source
    assert "from dspark import cache, calibration, hostinfo" in source and "dspark.sdk" not in source


def test_devices_lists_the_1_3_plugin(plugin_env: dict[str, str]) -> None:
    env = {**plugin_env, "DSPARK_PLUGINS": "api13"}
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", "devices", "--json"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    plugins = {p["name"]: p for p in json.loads(proc.stdout)["plugins"]}
    record = plugins["api13"]
    assert record["source"] == "entry point" and record["module"] == "dspark_api13"
    assert record["api_version"] == "1.3"
    assert record["status"] == "active", record["reason"]
    assert record["devices"] == ["cpu"]


def test_the_1_3_plugin_passes_the_conformance_kit(plugin_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"],
        capture_output=True, text=True, env=plugin_env, timeout=300, cwd=PLUGIN_DIR, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "test_registered_and_active PASSED" in out, out
    assert "test_probe_valid_idempotent_fast PASSED" in out, out
    assert "test_bids_well_formed PASSED" in out, out
    assert "test_quantize PASSED" in out, out  # its int8 variant, built with dspark.quant
    assert "test_op_matches_reference[chain_mlp] PASSED" in out, out
