"""The whole test suite of a dspark plugin can be this: the core's conformance kit."""

import pytest

from dspark.testing import REAL_MODELS, PluginConformance, check_plugin, real_model


class TestNumpyPlugin(PluginConformance):
    plugin = "numpy"


@pytest.mark.parametrize("model", REAL_MODELS)
def test_ops_of_a_real_model_match_the_reference(model: str) -> None:
    """Every op of the kit's real models this plugin bids on, fed the activations the model produces there."""
    report = check_plugin("numpy", cases=real_model(model).op_cases())
    assert report.ok, report.summary(only_problems=True)
    assert report.cases("PASS"), "the plugin ran none of the model's ops"
