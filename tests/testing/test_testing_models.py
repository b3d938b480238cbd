"""dspark.testing's real models: the graphs are the models they claim, and their op cases carry the real activations."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest

from dspark.sdk import ReferenceExecutable
from dspark.testing import (
    REAL_MODELS, RealModel, activations, check_plugin, demo_graph, demo_onnx, real_model, reference_outputs,
)
from dspark.testing.llama import ASSET, stdlib_llama_onnx


@pytest.fixture(scope="module", params=REAL_MODELS)
def model(request: pytest.FixtureRequest) -> RealModel:
    return real_model(request.param)


def test_stdlib_llama_graph_computes_the_shipped_checkpoints_logits() -> None:
    # transformers' LlamaForCausalLM on the same files is what the hand-written graph must reproduce.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    m = real_model("stdlib-llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ASSET), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.from_numpy(m.inputs["input_ids"])).logits.numpy()
    got = m.activations()["logits"]
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3)
    assert np.array_equal(got.argmax(-1), expected.argmax(-1))


def test_fewer_layers_are_a_prefix_of_the_model() -> None:
    proto, inputs = stdlib_llama_onnx(layers=1)
    onnx.checker.check_model(proto)
    names = [n.name for n in proto.graph.node]
    full = {op.name for op in real_model("stdlib-llama").graph.ops}
    assert set(names) < full and names[-1] == "logits"
    assert {n.split(".")[0] for n in names if re.match(r"l\d+\.", n)} == {"l0"}  # layer 0 only, then norm and head
    assert np.array_equal(inputs["input_ids"], real_model("stdlib-llama").inputs["input_ids"])
    with pytest.raises(ValueError, match="layers"):
        stdlib_llama_onnx(layers=0)


def test_demo_block_is_deterministic_and_the_clis_model() -> None:
    assert demo_onnx().SerializeToString() == demo_onnx().SerializeToString()
    demo = real_model("demo_block")
    assert [op.name for op in demo.graph.ops] == [op.name for op in demo_graph().ops]
    assert demo.inputs["x"].shape == (1, 32, 64) and demo.inputs["x"].dtype == np.float32


def test_real_model_is_built_once_and_names_what_it_has() -> None:
    assert real_model() is real_model("stdlib-llama")
    with pytest.raises(KeyError, match="demo_block"):
        real_model("no-such-model")


def test_activations_are_the_whole_graphs_reference_run(model: RealModel) -> None:
    acts = activations(model.graph, model.inputs)
    whole = ReferenceExecutable(model.graph.subgraph(), "cpu").run(model.inputs)
    for name, value in whole.items():
        np.testing.assert_array_equal(acts[name], value)
    for op in model.graph.ops:  # every op's outputs, with the shapes and dtypes the graph declares
        for t in op.outputs:
            spec = model.graph.tensors[t]
            assert acts[t].shape == spec.shape and acts[t].dtype.name == spec.dtype, (op.name, t)
    assert all(np.array_equal(acts[k], v) for k, v in model.inputs.items())
    assert not set(model.graph.initializers) & set(acts)


def test_op_cases_are_fed_and_reproduce_the_models_activations(model: RealModel) -> None:
    acts = model.activations()
    cases = model.op_cases()
    every = model.op_cases(unique=False)
    assert len(every) == len(model.graph.ops) and len(cases) < len(every)
    assert len({c.graph.subgraph().signature() for c in cases}) == len(cases)
    for case in cases:
        (op,) = case.graph.ops
        assert case.name == f"{model.name}:{op.name}"
        assert sorted(case.inputs) == sorted(case.graph.subgraph().inputs)
        for t, value in case.inputs.items():
            np.testing.assert_array_equal(value, acts[t])
        # The op alone, on its real inputs, gives what it gave inside the whole model.
        for t, value in reference_outputs(case).items():
            np.testing.assert_allclose(value, acts[t], rtol=1e-5, atol=1e-5, err_msg=case.name)


def test_op_cases_pass_the_kit_on_the_torch_reference(model: RealModel) -> None:
    cases = model.op_cases()
    report = check_plugin("torch", cases=cases)
    assert report.ok, report.summary(only_problems=True)
    assert sorted(report.cases("PASS")) == sorted(c.name for c in cases)


def test_the_llamas_cases_cover_a_decoders_ops() -> None:
    kinds = {c.graph.ops[0].op_type for c in real_model("stdlib-llama").op_cases()}
    assert {"Gather", "MatMul", "Softmax", "Where", "Sigmoid", "ReduceMean", "Neg", "Concat", "Expand"} <= kinds


def test_the_llama_reaches_values_the_generated_cases_never_do() -> None:
    # Why the trained model is in the kit (docs/plugins.md): a residual stream in the hundreds, peaked attention.
    llama, demo = real_model("stdlib-llama").activations(), real_model("demo_block").activations()
    last = max(int(m.group(1)) for t in llama if (m := re.match(r"l(\d+)\.resid2$", t)))
    assert np.abs(llama[f"l{last}.resid2"]).max() > 10 * np.abs(demo["y"]).max()
    assert llama[f"l{last}.probs"].max() > 0.9 > demo["p"].max()
