"""Plugins that break the contract in every way the plugin manager must survive.

Each is a class so a test can register a fresh instance; the hardware they
claim is the host CPU, the device every machine has.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np

import dspark
from dspark import Bid, Device, hookimpl


def _cpu(runtime: str) -> Device:
    return Device(id="cpu", kind="cpu", name="test cpu", runtime=runtime, peak_flops={"float32": 1e9})


class Good:
    DSPARK_API_VERSION = "1.0"

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [_cpu("good")]

    @hookimpl
    def dspark_bid(self, subgraph: Any, device: Device) -> Bid:
        return Bid(device_id=device.id, runtime="good", latency_s=1e-3, peak_memory_bytes=0, precision="float32")


class RaisesIn(Good):
    """Raises in the hook named by ``hook``; ``calls`` counts the calls per hook."""

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.calls: Counter[str] = Counter()

    def _maybe_raise(self, hook: str) -> None:
        self.calls[hook] += 1
        if hook == self.hook:
            raise RuntimeError(f"boom in {hook}")

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        self._maybe_raise("dspark_probe_devices")
        return [_cpu("raises")]

    @hookimpl
    def dspark_bid(self, subgraph: Any, device: Device) -> Bid:
        self._maybe_raise("dspark_bid")
        return super().dspark_bid(subgraph, device)

    @hookimpl
    def dspark_compile(self, subgraph: Any, device: Device) -> Any:
        self._maybe_raise("dspark_compile")
        return None

    @hookimpl
    def dspark_quantize(self, subgraph: Any, device: Device, spec: Any) -> Any:
        self._maybe_raise("dspark_quantize")
        return None

    @hookimpl
    def dspark_drafters(self, target: Any) -> Any:
        self._maybe_raise("dspark_drafters")
        return None


class WrongTypes:
    """Returns values of the wrong type from every hook."""

    DSPARK_API_VERSION = "1.0"

    def __init__(self, probe_value: Any = "garbage") -> None:
        self.probe_value = probe_value

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> Any:
        return self.probe_value

    @hookimpl
    def dspark_bid(self, subgraph: Any, device: Device) -> Any:
        return {"device_id": device.id, "latency_s": -1}

    @hookimpl
    def dspark_compile(self, subgraph: Any, device: Device) -> Any:
        return 42

    @hookimpl
    def dspark_quantize(self, subgraph: Any, device: Device, spec: Any) -> Any:
        return subgraph  # not marked as quantized by this plugin

    @hookimpl
    def dspark_drafters(self, target: Any) -> Any:
        return [{"name": "x", "kind": "model", "create": "not callable"}]


class Hangs(Good):
    def __init__(self) -> None:
        self.release = threading.Event()
        self.returned = threading.Event()  # set once the hook itself returns

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        self.release.wait(60)
        self.returned.set()
        return [_cpu("hangs")]


class FutureApi(Good):
    DSPARK_API_VERSION = "2.0"


class NoApi:
    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [_cpu("noapi")]


class Misspelled(Good):
    @hookimpl
    def dspark_probe_device(self, refresh: bool) -> list[Device]:  # missing the final "s"
        return [_cpu("typo")]


class UnmarkedMisspelled(Good):
    def dspark_bids(self, subgraph: Any, device: Device) -> None:  # no marker, still caught
        return None


class WrongArgs(Good):
    @hookimpl
    def dspark_bid(self, subgraph: Any, device: Device, budget: float) -> None:  # type: ignore[override]
        return None


class _Cheap(Good):
    """Bids far below any real runtime, so the placer puts everything it can on it."""

    @hookimpl
    def dspark_probe_devices(self, refresh: bool) -> list[Device]:
        return [_cpu(type(self).__name__)]

    @hookimpl
    def dspark_bid(self, subgraph: Any, device: Device) -> Bid:
        return Bid(device_id=device.id, runtime=type(self).__name__, latency_s=1e-7, peak_memory_bytes=0,
                   precision="float32")


class CompileFailsOnSoftmax(_Cheap):
    """Bids on everything, but its compiler rejects any subgraph holding a Softmax; the rest runs right."""

    @hookimpl
    def dspark_compile(self, subgraph: Any, device: Device) -> Any:
        if any(op.op_type == "Softmax" for op in subgraph.ops):
            raise RuntimeError("this compiler cannot lower Softmax")
        from dspark.sdk.reference.executable import TorchExecutable

        return TorchExecutable(subgraph, "cpu")


class BidRaisesOnSoftmax(_Cheap):
    """Raises when asked to bid on a subgraph holding a Softmax; bids cheaply on the rest."""

    @hookimpl
    def dspark_bid(self, subgraph: Any, device: Device) -> Bid:
        if any(op.op_type == "Softmax" for op in subgraph.ops):
            raise ValueError("no cost model for Softmax")
        return super().dspark_bid(subgraph, device)

    @hookimpl
    def dspark_compile(self, subgraph: Any, device: Device) -> Any:
        from dspark.sdk.reference.executable import TorchExecutable

        return TorchExecutable(subgraph, "cpu")


class _Explodes:
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("kernel launch failed")


class RaisesAtRun(_Cheap):
    """Bids on everything and compiles, but its executables raise when run."""

    @hookimpl
    def dspark_compile(self, subgraph: Any, device: Device) -> Any:
        return _Explodes()


assert dspark.API_VERSION.startswith("1.")  # FutureApi above is newer
