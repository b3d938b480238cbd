"""The example third-party drafter installs with pip and is picked up by the engine's drafting hook.

Installed the way a user would (pip, into a separate directory on PYTHONPATH)
and exercised in subprocesses, so discovery goes through the installed
distribution's ``dspark`` entry point, not through this repository's tree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_install import install_plugin

REPO = Path(__file__).resolve().parents[2]
PLUGIN_DIR = REPO / "plugins" / "dspark-example-drafter"

SCRIPT = r"""
import json
import torch
torch.set_num_threads(1)
from dspark import LLM, SamplingParams
from dspark.host.plugin_manager import PluginHost

host = PluginHost().load()
rec = host.records["bigram"]
spec = LLM(dtype="float32", speculative_decoding={"strategy": "fixed", "drafters": ["bigram"],
                                                  "num_speculative_tokens": 3})
plain = LLM(dtype="float32")
p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
prompts = ["def f(x):\n    return x\n\n\ndef g(x):\n    return x\n\n\ndef", "import os\nimport sys\nimport"]
a, b = spec.generate(prompts, p), plain.generate(prompts, p)
print(json.dumps({"record": rec.model_dump(mode="json"), "same": [x.token_ids for x in a] == [x.token_ids for x in b],
                  "drafters": spec.stats().spec_drafters}))
"""


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for subprocesses that see the plugin installed in a temp dir."""
    return install_plugin(PLUGIN_DIR, tmp_path_factory.mktemp("dspark_example_drafter"))


def test_the_engine_drafts_with_the_installed_plugin(plugin_env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=plugin_env,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rec = out["record"]
    assert rec["source"] == "entry point" and rec["module"] == "dspark_example_drafter"
    assert rec["api_version"] == "1.0" and rec["status"] == "active", rec  # a 1.0 plugin on the 1.1 core
    bigram = out["drafters"]["bigram"]
    assert bigram["plugin"] == "bigram" and bigram["kind"] == "other"
    assert bigram["drafts"] > 0 and bigram["accepted_tokens"] > 0
    assert out["same"]  # lossless whatever the drafter proposes


def test_the_plugins_own_suite_passes(plugin_env: dict[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"],
                          capture_output=True, text=True, env=plugin_env, timeout=300, cwd=PLUGIN_DIR)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "test_drafters PASSED" in out and "test_proposes_the_most_frequent_follower PASSED" in out, out
