"""A probe's device list kept in the disk cache (dspark.sdk.devices, plugin API 1.16): the list back as kept,
the figures that change read again on every use, a miss or an older layout answered None."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.sdk import cached_devices, hostinfo, store_devices
from dspark.types import Device, Unavailable

KEY = {"snapshot": "test-devices-v1", "runtime": "1.2.3"}


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DSPARK_CACHE_DIR", str(tmp_path))
    return tmp_path


def _found() -> list[Device | Unavailable]:
    cpu = Device(id="cpu", kind="cpu", name="a CPU", runtime="test/CPU", memory_total_bytes=1, memory_free_bytes=1,
                 utilization=1.0, memory_bandwidth_bytes_per_s=1.0, peak_flops={"float32": 5e9},
                 properties={"call_overhead_s": 1e-5})
    gpu = Device(id="gpu:0", kind="gpu", name="a GPU", runtime="test/GPU", memory_free_bytes=7,
                 properties={"index": 0})
    return [cpu, gpu, Unavailable(what="test/NPU", reason="no NPU driver is loaded")]


def test_the_list_comes_back_with_its_live_figures_read_now(own_cache: Path) -> None:
    store_devices("test-devices", KEY, _found())
    seen: list[str] = []

    def relive(d: Device) -> None:
        seen.append(d.id)
        d.memory_free_bytes = 3

    got = cached_devices("test-devices", KEY, relive)
    assert got is not None and len(got) == 3
    cpu, gpu, npu = got
    assert isinstance(cpu, Device) and isinstance(gpu, Device) and isinstance(npu, Unavailable)
    # What was measured comes back as kept; what changes is read again: the host's memory, load, bandwidth.
    assert cpu.peak_flops == {"float32": 5e9} and cpu.properties == {"call_overhead_s": 1e-5}
    assert cpu.memory_total_bytes == hostinfo.memory()[0] and (cpu.memory_free_bytes or 0) > 1
    assert cpu.memory_bandwidth_bytes_per_s != 1.0
    assert seen == ["gpu:0"] and gpu.memory_free_bytes == 3  # the plugin's own live figures, its other devices
    assert npu.reason == "no NPU driver is loaded"


def test_a_miss_another_key_or_an_older_layout_is_none(own_cache: Path) -> None:
    assert cached_devices("test-devices", KEY) is None
    store_devices("test-devices", KEY, _found())
    assert cached_devices("test-devices", {**KEY, "runtime": "1.2.4"}) is None
    entry = next((own_cache / "test-devices").glob("*.json"))
    doc = json.loads(entry.read_text())
    doc["value"][0]["kind"] = "a kind no Device has"  # records of an older layout
    entry.write_text(json.dumps(doc))
    assert cached_devices("test-devices", KEY) is None
