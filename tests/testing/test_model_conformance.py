"""The conformance kit on the ops of real models, for every plugin that claims them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dspark.graph.importers import load_model
from dspark.placement.executor import random_inputs
from dspark.testing import REAL_MODELS, check_plugin, model_op_cases, real_model

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))


@pytest.fixture(scope="module")
def cases() -> list:
    import zoo

    out = [case for name in REAL_MODELS for case in real_model(name).op_cases()]  # the kit's own real models
    for factory in (zoo.tiny_cnn, zoo.tiny_transformer):
        module, example = factory()[:2]
        graph = load_model(module, example_inputs=example)
        out += model_op_cases(graph, random_inputs(graph))
    return out


def test_cases_carry_real_activations(cases: list) -> None:
    assert len(cases) > 20
    assert any(c.graph.ops[0].op_type == "Softmax" for c in cases)
    assert any(c.graph.ops[0].op_type == "Conv" for c in cases)
    # Deduplicated by signature: no two cases are the same op with the same shapes.
    sigs = [c.graph.subgraph().signature() for c in cases]
    assert len(sigs) == len(set(sigs))


@pytest.mark.parametrize("plugin", ["cpu", "npu", "torch"])
def test_plugin_matches_reference_on_model_ops(plugin: str, cases: list) -> None:
    report = check_plugin(plugin, cases=cases)
    assert report.ok, report.summary(only_problems=True)
    assert len(report.cases("PASS")) >= len(cases) // 2, report.summary()
