"""`dspark cache list` / `dspark cache clear`, and `dspark devices --refresh` dropping calibrations, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dspark.host import cache
from dspark.sdk import calibration

ROOT = Path(__file__).resolve().parents[2]


def dspark(cache_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DSPARK_CACHE_DIR=str(cache_dir))
    return subprocess.run([sys.executable, "-m", "dspark.cli", *args], check=False, capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


@pytest.fixture
def filled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache with two calibrations (one measured, one failed) and one probe figure."""
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    cache.store(calibration.NAMESPACE, {"sig": "a", "v": calibration.VERSION},
                {"latency_s": 0.0031, "samples": 20, "source": "calibrated", "busy": True})
    cache.store(calibration.NAMESPACE, {"sig": "b", "v": calibration.VERSION}, {"failed": "CannotCalibrate: x"})
    cache.store("hostinfo", {"bench": "memcpy-v1"}, 1.5e10)
    return tmp_path


def _listed(cache_dir: Path, *args: str) -> dict[str, dict]:
    res = dspark(cache_dir, "cache", "list", "--json", *args)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["dir"] == str(cache_dir)
    return {row["namespace"]: row for row in data["namespaces"]}


def test_list_shows_every_namespace_and_entry(filled: Path) -> None:
    rows = _listed(filled)
    assert {n: r["entries"] for n, r in rows.items()} == {"calibration": 2, "hostinfo": 1}
    assert all(r["bytes"] > 0 and "items" not in r for r in rows.values())
    rows = _listed(filled, "--namespace", "calibration")
    assert list(rows) == ["calibration"]
    values = sorted(json.dumps(i["value"], sort_keys=True) for i in rows["calibration"]["items"])
    assert values == sorted(json.dumps(v, sort_keys=True) for v in (
        {"latency_s": 0.0031, "samples": 20, "source": "calibrated", "busy": True},
        {"failed": "CannotCalibrate: x"}))
    table = dspark(filled, "cache", "list", "--namespace", "calibration")
    assert table.returncode == 0, table.stderr
    assert "3.1 ms (calibrated, 20 runs, busy host)" in table.stdout and "failed: CannotCalibrate" in table.stdout


def test_clear_one_namespace_then_all(filled: Path) -> None:
    res = dspark(filled, "cache", "clear", "--namespace", "calibration", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["removed"] == {"calibration": 2}
    assert {n: r["entries"] for n, r in _listed(filled).items()} == {"hostinfo": 1}
    res = dspark(filled, "cache", "clear")
    assert res.returncode == 0, res.stderr
    assert "hostinfo: 1 entry removed" in res.stdout
    assert _listed(filled) == {} and cache.namespaces() == []
    assert "empty" in dspark(filled, "cache", "list").stdout


def test_clear_rejects_a_path_as_namespace(filled: Path) -> None:
    res = dspark(filled, "cache", "clear", "--namespace", "../etc")
    assert res.returncode != 0 and "not a namespace name" in res.stderr
    assert {n: r["entries"] for n, r in _listed(filled).items()} == {"calibration": 2, "hostinfo": 1}


def test_devices_refresh_drops_calibrations(filled: Path) -> None:
    # Only the torch reference probes: the point is what happens to the cache, not the hardware.
    res = dspark(filled, "-p", "no:cpu", "-p", "no:npu", "-p", "no:cuda", "devices", "--json", "--refresh")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["devices"], "nothing was probed"
    rows = _listed(filled)
    assert "calibration" not in rows, rows
    assert rows["hostinfo"]["entries"] >= 1  # re-measured, not dropped
