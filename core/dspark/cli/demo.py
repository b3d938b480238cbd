"""``dspark demo``: the demo model run whole on every device/runtime that bids for it.

The model itself (a seeded pre-norm transformer block) is part of the public
testing kit, :func:`dspark.testing.demo_graph`, so plugin authors check their
kernels on the same graph this command runs. Until the placer exists, each
(device, plugin) runs it whole and is checked against the torch reference.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from dspark.host.inventory import Inventory
from dspark.host.plugin_manager import PluginHost
from dspark.placement.bidding import collect_bids, compile_on
from dspark.sdk.cost import time_call
from dspark.testing import demo_graph, demo_inputs
from dspark.types import TOLERANCES


class DemoRow(BaseModel):
    device: str
    plugin: str
    runtime: str
    predicted_ms: float | None = None
    measured_ms: float | None = None
    precision: str | None = None
    max_abs_err: float | None = None
    ok: bool = False
    note: str = ""


def run_demo(host: PluginHost, inventory: Inventory, repeat: int = 20) -> list[DemoRow]:
    """Run the demo model whole on every driver that bids; compare with the torch reference."""
    graph = demo_graph()
    sub = graph.subgraph()
    x = demo_inputs(seed=1)["x"]
    bids = {(d.id, d.plugin): (d, b) for d, b in collect_bids(host, inventory, sub)}
    ref_dev = next(d for d in inventory.drivers() if d.plugin == "torch" and d.id == "cpu")
    reference = compile_on(host, ref_dev, sub).run({"x": x})["y"]
    rows = []
    for device in inventory.drivers():
        row = DemoRow(device=device.id, plugin=device.plugin, runtime=device.runtime)
        if (device.id, device.plugin) not in bids:
            row.note = "abstained" if host.records[device.plugin].status.value == "active" \
                else host.records[device.plugin].reason
            rows.append(row)
            continue
        bid = bids[(device.id, device.plugin)][1]
        row.predicted_ms, row.precision = bid.latency_s * 1e3, bid.precision
        try:
            exe = compile_on(host, device, sub)
            y = exe.run({"x": x})["y"]
            row.measured_ms = time_call(lambda exe=exe: exe.run({"x": x}), warmup=2, repeat=repeat) * 1e3
        except Exception as exc:  # a broken promise is shown, not fatal
            row.note = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            continue
        rtol, atol = TOLERANCES[bid.precision]
        row.max_abs_err = float(np.max(np.abs(y - reference)))
        row.ok = bool(np.allclose(y, reference, rtol=rtol, atol=atol))
        rows.append(row)
    return rows
