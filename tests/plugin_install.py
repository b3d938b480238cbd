"""Install an example plugin distribution the way a user would, for subprocess tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def install_plugin(plugin_dir: Path, root: Path) -> dict[str, str]:
    """pip-install ``plugin_dir`` into ``root``/site; return an environment whose PYTHONPATH sees it.

    Built from a copy (setuptools writes build/ and *.egg-info next to the
    sources), with a cold ``DSPARK_CACHE_DIR`` of its own and the plugin
    selection variables cleared, so discovery goes through the installed
    distribution's ``dspark`` entry point.
    """
    src = root / "src"
    shutil.copytree(plugin_dir, src, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".pytest_cache"))
    target = root / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"pip install of {plugin_dir.name} failed:\n{proc.stdout}\n{proc.stderr}")
    env = {k: v for k, v in os.environ.items() if k not in ("DSPARK_PLUGINS", "DSPARK_DISABLE_PLUGIN_AUTOLOAD")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["DSPARK_CACHE_DIR"] = str(root / "cache")
    return env
