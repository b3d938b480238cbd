"""The conformance kit: check a dspark plugin's contract and numbers under pytest.

In a plugin's own test suite (no conftest needed)::

    from dspark.testing import PluginConformance

    class TestMyPlugin(PluginConformance):
        plugin = "myplugin"

or programmatically: ``print(check_plugin("myplugin").summary())``. Each op
case runs on every device the plugin reports and is compared with the
built-in torch reference within the tolerance of the precision the plugin bid;
ONNX's own backend node tests run through it too (:mod:`dspark.testing.onnx_node`,
:func:`run_node_suite` for the whole suite). :func:`real_model` gives whole
models (the shipped ``stdlib-llama`` with its trained weights, the demo block)
and their ops as cases fed with real activations (:mod:`dspark.testing.models`).
API 1.10: :func:`check_decoders` runs a plugin's LLM decoder on a tiny checkpoint of
every family (:func:`tiny_checkpoint`), built into the spec the engine would send
(:func:`decoder_spec`), against the torch runner (:mod:`dspark.testing.decoder_kit`).
"""

from __future__ import annotations

from dspark.testing.conformance import (
    CheckResult,
    ConformanceKit,
    ConformanceReport,
    PluginConformance,
    check_plugin,
    compare,
    default_host,
    reference_outputs,
)
from dspark.testing.decoder_kit import (
    FAMILIES,
    check_decoder,
    check_decoders,
    decoder_spec,
    engine_tokens,
    random_checkpoint,
    tiny_checkpoint,
)
from dspark.testing.demo_block import demo_graph, demo_inputs, demo_onnx
from dspark.testing.models import REAL_MODELS, RealModel, activations, model_op_cases, real_model
from dspark.testing.node_kit import check_onnx_nodes
from dspark.testing.onnx_node import CaseResult, NodeCase, PluginNotTestable, node_cases, run_node_suite
from dspark.testing.op_cases import OpCase, op_case, op_cases

__all__ = [
    "FAMILIES", "REAL_MODELS", "CaseResult", "CheckResult", "ConformanceKit", "ConformanceReport", "NodeCase", "OpCase",
    "PluginConformance", "PluginNotTestable", "RealModel", "activations", "check_decoder", "check_decoders",
    "check_onnx_nodes", "check_plugin", "decoder_spec", "engine_tokens", "random_checkpoint", "tiny_checkpoint",
    "compare", "default_host", "demo_graph", "demo_inputs", "demo_onnx", "model_op_cases", "node_cases", "op_case",
    "op_cases", "real_model", "reference_outputs", "run_node_suite",
]
