"""Tiny ONNX models for probing providers and microbenchmarks.

The probe model is a serialized constant so that a probe never pays for
``import onnx`` (about 0.15 s of the 1.5 s cold-start budget);
:func:`build_probe_model` rebuilds it and the tests check the two agree.
"""

from __future__ import annotations

# y = x + x over float32[1], opset 13, IR 8: what build_probe_model() serializes to.
PROBE_MODEL: bytes = bytes.fromhex(
    "0808120664737061726b3a450a130a01780a01781201791a036164642203416464120c64737061726b5f70726f"
    "62655a0f0a0178120a0a08080112040a020801620f0a0179120a0a08080112040a02080142040a00100d"
)


def build_probe_model() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"], name="add")], "dspark_probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="dspark",
                              ir_version=8)
    return bytes(model.SerializeToString())


def build_matmul_model(n: int) -> bytes:
    """Y = A @ B over float32[n, n]; both operands are inputs so nothing is constant-folded."""
    from onnx import TensorProto, helper

    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, [n, n])
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT, [n, n])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [n, n])
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "dspark_matmul", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return bytes(model.SerializeToString())


def build_chain_model(length: int) -> bytes:
    """``length`` dependent Add nodes over float32[1]: run time minus one node's is per-op overhead."""
    from onnx import TensorProto, helper

    names = ["x"] + [f"t{i}" for i in range(length - 1)] + ["y"]
    nodes = [helper.make_node("Add", [names[i], "x"], [names[i + 1]]) for i in range(length)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph(nodes, "dspark_chain", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return bytes(model.SerializeToString())
