"""The llamacpp plugin (plugins/dspark-llamacpp) as scripts/setup.sh installs it: a distribution of its own,
found through its ``dspark`` entry point, whose own suite passes. The engine on it:
tests/llm/decoding/test_llamacpp_decoder.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dspark_llamacpp", reason="the llamacpp plugin is not installed (scripts/setup.sh)")

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "plugins" / "dspark-llamacpp"


def test_devices_lists_the_plugin_from_its_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "dspark.cli", "devices", "--json"], capture_output=True, text=True,
                          timeout=180, cwd=REPO, env={**__import__("os").environ, "DSPARK_PLUGINS": "llamacpp"})
    assert proc.returncode == 0, proc.stderr
    inv = json.loads(proc.stdout)
    p = {x["name"]: x for x in inv["plugins"]}["llamacpp"]
    assert p["source"] == "entry point" and p["module"] == "dspark_llamacpp"
    assert p["api_version"] == "1.15" and p["status"] == "active", p
    cpu = next(d for d in inv["devices"] if d["id"] == "cpu")
    driver = next(d for d in cpu["drivers"] if d["plugin"] == "llamacpp")
    assert driver["runtime"].startswith("llama.cpp (llama-cpp-python ")


def test_the_plugins_own_suite_passes() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                          capture_output=True, text=True, timeout=300, cwd=PLUGIN_DIR)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert " passed" in out and "failed" not in out, out
