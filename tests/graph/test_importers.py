"""Model analysis: torch modules, factory specs and ONNX files imported into one Graph.

Real torch.export + dynamo ONNX exporter, no mocks. Each model is exported
once per module (fixtures), since an export takes seconds on a loaded box.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from dspark.sdk.reference.executable import TorchExecutable
from dspark.graph.model import Graph
from dspark.graph.importers import ModelSpecError, load_factory, load_model
from dspark.graph.onnx_io import UnsupportedModelError

ZOO = str(Path(__file__).parents[1] / "models" / "zoo.py")


def _ref(spec: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    module, inputs, _ = load_factory(f"{ZOO}:{spec}")  # factories are seeded: same weights as the import
    return module.eval(), inputs


def _run(graph: Graph, *inputs: torch.Tensor) -> np.ndarray:
    exe = TorchExecutable(graph.subgraph(), "cpu")
    out = exe.run({name: t.numpy() for name, t in zip(graph.inputs, inputs, strict=True)})
    return out[graph.outputs[0]]


def _assert_close(got: np.ndarray, want: torch.Tensor) -> None:
    ref = want.detach().numpy()
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


def _op_reading(graph: Graph, tensor: str) -> Any:
    (op,) = [o for o in graph.ops if tensor in o.inputs]
    return op


def _float_param_bytes(graph: Graph) -> int:
    # Weights only: the exporter also stores shape vectors (int64) and scalars as initializers.
    return sum(a.nbytes for a in graph.initializers.values() if a.dtype == np.float32 and a.ndim >= 1)


def _module_param_bytes(module: torch.nn.Module, skip: str = "") -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not (skip and n.startswith(skip)))


def _check_wellformed(graph: Graph) -> None:
    assert graph.ops
    for op in graph.ops:
        assert op.flops is not None and op.flops >= 0, op
        assert op.bytes_read is not None and op.bytes_written is not None, op
        assert all(t in graph.tensors for t in op.outputs if t), op
    produced = {t: op.name for op in graph.ops for t in op.outputs}
    edges = graph.edges()
    assert edges
    for prod, cons, t in edges:
        assert produced[t] == prod and t in graph.op(cons).inputs
    # every activation read by an op comes over an edge, from a graph input, or is a weight
    linked = {(c, t) for _, c, t in edges}
    for op in graph.ops:
        for t in op.inputs:
            assert not t or (op.name, t) in linked or t in graph.inputs or t in graph.initializers


@pytest.fixture(scope="module")
def mlp() -> Graph:
    return load_model(f"{ZOO}:tiny_mlp_dynamic")  # file.py:factory spec, symbolic batch


@pytest.fixture(scope="module")
def cnn() -> Graph:
    module, inputs = _ref("tiny_cnn")
    return load_model(module, example_inputs=inputs)  # an nn.Module directly


@pytest.fixture(scope="module")
def block() -> Graph:
    return load_model(f"{ZOO}:tiny_transformer_dynamic")  # symbolic batch and seq


def test_mlp(mlp: Graph) -> None:
    _check_wellformed(mlp)
    assert Counter(o.op_type for o in mlp.ops) == {"Gemm": 2, "Relu": 1}
    fc1 = _op_reading(mlp, "fc1.weight")
    assert fc1.flops == 2 * 3 * 16 * 32 + 3 * 32  # batch hint 3: multiply-adds + bias
    assert fc1.param_bytes == (32 * 16 + 32) * 4
    module, inputs = _ref("tiny_mlp_dynamic")
    assert _float_param_bytes(mlp) == _module_param_bytes(module)
    _assert_close(_run(mlp, *inputs), module(*inputs))


def test_dynamic_batch_stays_symbolic(mlp: Graph) -> None:
    assert mlp.tensors["x"].shape == ("batch", 16)
    assert mlp.tensors[mlp.outputs[0]].shape == ("batch", 4)
    assert mlp.dim_hints["batch"] == 3
    assert mlp.ops[0].bytes_read == (3 * 16 + 32 * 16 + 32) * 4  # sized with the hint
    module, _ = _ref("tiny_mlp_dynamic")
    x = torch.randn(7, 16)
    _assert_close(_run(mlp, x), module(x))  # the graph really is batch-agnostic


def test_cnn(cnn: Graph) -> None:
    _check_wellformed(cnn)
    counts = Counter(o.op_type for o in cnn.ops)
    assert counts["Conv"] == 2 and counts["MaxPool"] == 1 and counts["Relu"] == 2 and counts["Gemm"] == 1
    conv = _op_reading(cnn, "conv.weight")
    assert cnn.tensors[conv.outputs[0]].shape == (1, 8, 16, 16)
    assert conv.flops == 2 * (8 * 16 * 16) * (3 * 3 * 3) + 8 * 16 * 16
    pool = next(o for o in cnn.ops if o.op_type == "MaxPool")
    assert pool.flops == 8 * 8 * 8 * 4
    module, inputs = _ref("tiny_cnn")
    # eval-mode BatchNorm is folded into the conv by the exporter: its affine is not a separate weight
    assert _float_param_bytes(cnn) == _module_param_bytes(module, skip="bn.")
    _assert_close(_run(cnn, *inputs), module(*inputs))


def test_transformer_block(block: Graph) -> None:
    _check_wellformed(block)
    counts = Counter(o.op_type for o in block.ops)
    assert counts["MatMul"] == 6 and counts["LayerNormalization"] == 2 and counts["Softmax"] == 1
    assert block.tensors["x"].shape == ("batch", "seq", 32)
    assert {"batch": 2, "seq": 8}.items() <= block.dim_hints.items()
    up = _op_reading(block, "up.weight")  # folded (transposed) weights get their module's name back
    assert up.op_type == "MatMul" and up.flops == 2 * (2 * 8 * 64) * 32
    scores = [o for o in block.ops if o.op_type == "MatMul" and not o.param_bytes]
    assert block.tensors[scores[0].outputs[0]].shape == ("batch", 4, "seq", "seq")
    module, inputs = _ref("tiny_transformer_dynamic")
    assert _float_param_bytes(block) == _module_param_bytes(module)
    _assert_close(_run(block, *inputs), module(*inputs))
    x = torch.randn(3, 5, 32)
    _assert_close(_run(block, x), module(x))


def test_exported_onnx_runs_on_onnxruntime_and_openvino(block: Graph) -> None:
    import onnxruntime as ort
    import openvino as ov

    module, (x,) = _ref("tiny_transformer_dynamic")
    model = block.subgraph().to_onnx()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    _assert_close(sess.run(None, {"x": x.numpy()})[0], module(x))
    # Explicit f32, as the cpu plugin compiles: OpenVINO defaults to bf16 on CPUs with native bf16.
    core = ov.Core()
    compiled = core.compile_model(core.read_model(model.SerializeToString(), b""), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})
    _assert_close(np.asarray(compiled([x.numpy()])[0]), module(x))


def test_onnx_file_by_path(mlp: Graph, tmp_path: Path) -> None:
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp.subgraph().to_onnx(), str(path))
    g = load_model(path, dim_hints={"batch": 5})
    assert g.name == "mlp" and g.tensors["x"].shape == ("batch", 16)
    assert [o.op_type for o in g.ops] == [o.op_type for o in mlp.ops]
    assert _op_reading(g, "fc1.weight").flops == 2 * 5 * 16 * 32 + 5 * 32
    assert g.edges() == mlp.edges()
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    np.testing.assert_allclose(_run(g, torch.from_numpy(x)), _run(mlp, torch.from_numpy(x)), rtol=1e-6)
    assert load_model(str(path)).ops[0].flops is None  # no hint for batch: unknown, not a guess


def test_module_example_inputs_attribute_form(cnn: Graph) -> None:
    module, inputs, dynamic = load_factory(f"{ZOO}:tiny_cnn_module")
    assert isinstance(module, torch.nn.Module) and inputs[0].shape == (1, 3, 16, 16) and dynamic is None


def test_dynamic_spec_forms() -> None:
    from torch.export import Dim

    from dspark.graph.importers import _dynamic_shapes

    shapes, declared = _dynamic_shapes({"x": {0: "batch"}, "m": {0: "batch", 1: Dim("seq")}}, ["x", "m"])
    assert declared == [(0, 0, "batch"), (1, 0, "batch"), (1, 1, "seq")]
    assert shapes["x"][0] is shapes["m"][0]  # one name, one shared torch Dim
    _, declared = _dynamic_shapes(({0: Dim.AUTO},), ["x"])
    assert declared == [(0, 0, "x_dim0")]
    with pytest.raises(ModelSpecError, match="'y'"):
        _dynamic_shapes({"y": {0: "b"}}, ["x"])


def test_derived_dim_hints() -> None:
    from dspark.graph.model import TensorSpec
    from dspark.graph.onnx_io import derive_dim_hints

    specs = {t: TensorSpec(name=t, dtype="float32", shape=shape) for t, shape in {
        "a": ("batch*seq", 4), "b": ("floor(seq/3)", "2*batch + 1"), "c": ("__import__('os')", "other")}.items()}
    hints = derive_dim_hints(specs, {"batch": 2, "seq": 8})
    assert hints == {"batch": 2, "seq": 8, "batch*seq": 16, "floor(seq/3)": 2, "2*batch + 1": 5}


# --- errors ------------------------------------------------------------------------------


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        load_model(tmp_path / "nope.onnx")
    with pytest.raises(FileNotFoundError, match="missing_zoo.py"):
        load_model(f"{tmp_path}/missing_zoo.py:tiny_cnn")


def test_bad_specs_name_what_is_missing() -> None:
    with pytest.raises(ModelSpecError, match="no attribute 'no_such_factory'"):
        load_model(f"{ZOO}:no_such_factory")
    with pytest.raises(ModelSpecError, match="no_such_pkg_xyz"):
        load_model("no_such_pkg_xyz.models:make")
    with pytest.raises(ModelSpecError, match="_register_mystery_op.*got NoneType"):
        load_model(f"{ZOO}:_register_mystery_op")  # exists, but is not a model factory


def _model(node: onnx.NodeProto, extra_opsets: list[onnx.OperatorSetIdProto] | None = None) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), *(extra_opsets or [])])


def test_control_flow_is_one_op_carrying_its_branches(tmp_path: Path) -> None:
    # (It was refused before ONNX control flow was imported; tests/graph/test_control_flow.py covers it whole.)
    def branch(op: str, domain: str = "") -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["x"], ["z"], domain=domain)], op, [],
                                 [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])

    node = helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=branch("Relu"), else_branch=branch("Neg"))
    path = tmp_path / "if.onnx"
    onnx.save(_model(node), str(path))
    graph = load_model(path)
    (op,) = graph.ops
    assert (op.name, op.op_type, op.node_inputs, op.captures) == ("branchy", "If", ["c"], ["x"])
    custom = helper.make_node("If", ["c"], ["y"], name="branchy", then_branch=branch("Frob", "com.acme"),
                              else_branch=branch("Neg"))
    with pytest.raises(UnsupportedModelError, match=r"'Frob' \(node 'branchy/Frob_0'\).*'com.acme'"):
        load_model(_model(custom, [helper.make_opsetid("com.acme", 1)]))


def test_unknown_custom_domain_is_rejected_naming_op_and_node() -> None:
    node = helper.make_node("Frobnicate", ["x"], ["y"], name="frob1", domain="com.acme")
    with pytest.raises(UnsupportedModelError, match=r"'Frobnicate' \(node 'frob1'\).*'com.acme'"):
        load_model(_model(node, [helper.make_opsetid("com.acme", 1)]))


def test_unexportable_module_names_class_and_source_line() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        load_model(f"{ZOO}:unexportable")
    msg = str(err.value)
    assert "Unexportable" in msg and "data-dependent" in msg and "x.sum() > 0" in msg


def test_op_without_onnx_translation_names_class_and_op() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        load_model(f"{ZOO}:no_onnx_op")
    msg = str(err.value)
    assert "NoOnnxOp" in msg and "dspark_zoo.mystery" in msg


def test_constant_ops_become_weights_so_a_partition_reading_one_compiles() -> None:
    # The torch exporter's Unsqueeze/Reshape: axes and shapes from Constant ops. k also answers an output,
    # so it stays an op; s (value_ints) and axes (a tensor) become initializers.
    pytest.importorskip("openvino")
    from dspark_plugins_cpu import support

    i64 = TensorProto.INT64
    nodes = [helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("a", i64, [1], [0])),
             helper.make_node("Unsqueeze", ["x", "axes"], ["u"]),
             helper.make_node("Constant", [], ["s"], value_ints=[3, 2]),
             helper.make_node("Reshape", ["u", "s"], ["y"]),
             helper.make_node("Constant", [], ["k"], value_float=2.0)]
    model = helper.make_model(helper.make_graph(
        nodes, "consts", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2]),
         helper.make_tensor_value_info("k", TensorProto.FLOAT, [])]), opset_imports=[helper.make_opsetid("", 17)])
    g = Graph.from_onnx(model)
    assert [o.op_type for o in g.ops] == ["Unsqueeze", "Reshape", "Constant"]
    assert g.initializers["axes"].tolist() == [0] and g.initializers["s"].dtype == np.int64
    assert g.tensors["s"].shape == (2,) and g.tensors["axes"].dtype == "int64"
    unsqueeze = g.subgraph([g.ops[0].name])
    assert unsqueeze.inputs == ["x"] and unsqueeze.params == ["axes"]
    # OpenVINO needs the axes at compile time to know the output's rank.
    assert support.unsupported_reason(unsqueeze, "CPU") is None
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_run(g, torch.from_numpy(x)), x.reshape(1, 2, 3).reshape(3, 2))
