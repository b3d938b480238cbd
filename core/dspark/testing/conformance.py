"""The conformance kit as pytest tests: :class:`PluginConformance`, and the names plugin tests import.

The checks live in :mod:`dspark.testing.kit` (contract and op cases against
the torch reference) and :mod:`dspark.testing.onnx_node` (ONNX's own backend
node tests); this module turns them into one pytest test per check.
"""

from __future__ import annotations

from typing import Any, ClassVar

from dspark.host.plugin_manager import PluginHost
from dspark.testing.compare import compare
from dspark.testing.decoder_kit import check_decoders
from dspark.testing.kit import (
    DRAFT_TARGET,
    PROBE_CACHED_LIMIT_S,
    ConformanceKit,
    check_plugin,
    default_host,
    reference_outputs,
)
from dspark.testing.node_kit import check_onnx_nodes
from dspark.testing.op_cases import MLP_CASE, op_case, op_cases
from dspark.testing.report import CheckResult, ConformanceReport

__all__ = [
    "DRAFT_TARGET", "MLP_CASE", "PROBE_CACHED_LIMIT_S", "CheckResult", "ConformanceKit", "ConformanceReport",
    "PluginConformance", "check_plugin", "compare", "default_host", "reference_outputs",
]


class PluginConformance:
    """Base class for a plugin's test module; pytest collects the checks as tests.

    ::

        from dspark.testing import PluginConformance

        class TestMyPlugin(PluginConformance):
            plugin = "myplugin"

    Override :meth:`make_host` to check a plugin that is not installed
    through an entry point. One host per class keeps the module fast.
    """

    plugin: ClassVar[str] = ""
    # ONNX node tests: per op type the plugin bids on, how many of its cases run (None: all).
    onnx_node_cases_per_op: ClassVar[int | None] = 2

    def make_host(self) -> PluginHost | None:
        return None

    def pytest_generate_tests(self, metafunc: Any) -> None:
        # Honoured by pytest on test classes: one test per op case, no conftest needed.
        if "op_case_name" in metafunc.fixturenames:
            names = [c.name for c in op_cases()]
            metafunc.parametrize("op_case_name", names, ids=names)

    def _kit(self) -> ConformanceKit:
        cls = type(self)
        if "_dspark_kit" not in cls.__dict__:
            if not self.plugin:
                raise TypeError(f"{cls.__name__} must set the class attribute plugin = 'name'")
            cls._dspark_kit = ConformanceKit(self.plugin, self.make_host())  # type: ignore[attr-defined]
        kit: ConformanceKit = cls.__dict__["_dspark_kit"]
        return kit

    def _assert(self, results: list[CheckResult]) -> None:
        import pytest

        # The report's first line names the plugin: a failure in a suite checking several must say whose it is.
        report = ConformanceReport(plugin=self.plugin, results=results, record=self._kit().record)
        if report.failures:
            pytest.fail("\n" + report.summary(only_problems=True), pytrace=False)
        if results and all(r.skipped for r in results):
            pytest.skip("; ".join(dict.fromkeys(r.detail for r in results)))

    def test_registered_and_active(self) -> None:
        self._assert(self._kit().check_registration())

    def test_probe_valid_idempotent_fast(self) -> None:
        self._assert(self._kit().check_probe())

    def test_bids_well_formed(self) -> None:
        self._assert(self._kit().check_bids())

    def test_op_matches_reference(self, op_case_name: str) -> None:
        self._assert(self._kit().check_case(op_case(op_case_name)))

    def test_onnx_node_cases(self) -> None:
        self._assert(check_onnx_nodes(self._kit(), per_op=self.onnx_node_cases_per_op))

    def test_quantize(self) -> None:
        self._assert(self._kit().check_quantize())

    def test_drafters(self) -> None:
        self._assert(self._kit().check_drafters())

    def test_decoders(self, tmp_path: Any) -> None:
        """Every family's tiny checkpoint on every device (API 1.10): declines skip, broken promises fail."""
        kit = self._kit()
        if not kit.devices:
            kit.check_probe()
        self._assert(check_decoders(kit, workdir=tmp_path))
