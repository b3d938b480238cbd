"""The bundled demo model, and running it on every device/runtime that bids for it.

The model is a pre-norm transformer block (attention + GELU MLP), built
deterministically with ``onnx.helper`` so the package ships code, not a
binary. Until the placer exists, ``dspark demo`` runs it whole on each
(device, plugin) and checks each against the torch reference.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from pydantic import BaseModel

from dspark.placement.bidding import collect_bids, compile_on
from dspark.sdk.cost import time_call
from dspark.graph.model import Graph
from dspark.host.inventory import Inventory
from dspark.host.plugin_manager import PluginHost
from dspark.types import TOLERANCES


def demo_onnx(seq: int = 32, dim: int = 64, hidden: int = 256, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32), name)

    inits = [w("wq", dim, dim), w("wk", dim, dim), w("wv", dim, dim), w("wo", dim, dim),
             w("w1", dim, hidden), w("w2", hidden, dim),
             numpy_helper.from_array(np.ones(dim, np.float32), "ln_g"),
             numpy_helper.from_array(np.zeros(dim, np.float32), "ln_b"),
             numpy_helper.from_array(np.array(1 / math.sqrt(dim), np.float32), "scale"),
             numpy_helper.from_array(np.array(1 / math.sqrt(2), np.float32), "inv_sqrt2"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    n = helper.make_node
    nodes = [
        n("LayerNormalization", ["x", "ln_g", "ln_b"], ["h"], name="ln1", axis=-1),
        n("MatMul", ["h", "wq"], ["q"], name="q_proj"),
        n("MatMul", ["h", "wk"], ["k"], name="k_proj"),
        n("MatMul", ["h", "wv"], ["v"], name="v_proj"),
        n("Transpose", ["k"], ["kt"], name="k_t", perm=[0, 2, 1]),
        n("MatMul", ["q", "kt"], ["s"], name="scores"),
        n("Mul", ["s", "scale"], ["ss"], name="scale_scores"),
        n("Softmax", ["ss"], ["p"], name="softmax", axis=-1),
        n("MatMul", ["p", "v"], ["a"], name="attend"),
        n("MatMul", ["a", "wo"], ["o"], name="o_proj"),
        n("Add", ["x", "o"], ["r1"], name="residual1"),
        n("LayerNormalization", ["r1", "ln_g", "ln_b"], ["h2"], name="ln2", axis=-1),
        n("MatMul", ["h2", "w1"], ["u"], name="up"),
        n("Mul", ["u", "inv_sqrt2"], ["u2"], name="gelu_scale"),
        n("Erf", ["u2"], ["e"], name="gelu_erf"),
        n("Add", ["e", "one"], ["e1"], name="gelu_add"),
        n("Mul", ["u", "e1"], ["ue"], name="gelu_mul"),
        n("Mul", ["ue", "half"], ["g"], name="gelu_half"),
        n("MatMul", ["g", "w2"], ["d"], name="down"),
        n("Add", ["r1", "d"], ["y"], name="residual2"),
    ]
    graph = helper.make_graph(
        nodes, "demo_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, dim])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="dspark-demo")
    model.ir_version = 9
    return model


def demo_graph() -> Graph:
    return Graph.from_onnx(demo_onnx(), name="demo_block")


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
    x = np.random.default_rng(1).standard_normal((1, 32, 64)).astype(np.float32)
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
