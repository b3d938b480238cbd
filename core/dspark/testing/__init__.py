"""The conformance kit: check a dspark plugin's contract and numbers under pytest.

In a plugin's own test suite (no conftest needed)::

    from dspark.testing import PluginConformance

    class TestMyPlugin(PluginConformance):
        plugin = "myplugin"

or programmatically: ``print(check_plugin("myplugin").summary())``. Each op
case runs on every device the plugin reports and is compared with the
built-in torch reference within the tolerance of the precision the plugin bid;
ONNX's own backend node tests run through it too (:mod:`dspark.testing.onnx_node`,
:func:`run_node_suite` for the whole suite).
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
from dspark.testing.node_kit import check_onnx_nodes
from dspark.testing.onnx_node import CaseResult, NodeCase, PluginNotTestable, node_cases, run_node_suite
from dspark.testing.op_cases import OpCase, model_op_cases, op_case, op_cases

__all__ = [
    "CaseResult", "CheckResult", "ConformanceKit", "ConformanceReport", "NodeCase", "OpCase", "PluginConformance",
    "PluginNotTestable", "check_onnx_nodes", "check_plugin", "compare", "default_host", "model_op_cases",
    "node_cases", "op_case", "op_cases", "reference_outputs", "run_node_suite",
]
