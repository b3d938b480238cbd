"""The conformance kit: check a dspark plugin's contract and numbers under pytest.

In a plugin's own test suite (no conftest needed)::

    from dspark.testing import PluginConformance

    class TestMyPlugin(PluginConformance):
        plugin = "myplugin"

or programmatically: ``print(check_plugin("myplugin").summary())``. Each op
case runs on every device the plugin reports and is compared with the
built-in torch reference within the tolerance of the precision the plugin bid.
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
from dspark.testing.op_cases import OpCase, model_op_cases, op_case, op_cases

__all__ = [
    "CheckResult", "ConformanceKit", "ConformanceReport", "OpCase", "PluginConformance", "check_plugin",
    "compare", "default_host", "model_op_cases", "op_case", "op_cases", "reference_outputs",
]
