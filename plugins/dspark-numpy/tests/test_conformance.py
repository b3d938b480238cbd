"""The whole test suite of a dspark plugin can be this: the core's conformance kit."""

from dspark.testing import PluginConformance


class TestNumpyPlugin(PluginConformance):
    plugin = "numpy"


def test_ops_of_a_real_model_match_the_reference() -> None:
    """Every op of the bundled transformer block this plugin bids on, fed real activations."""
    import numpy as np

    from dspark.cli.demo import demo_graph
    from dspark.testing import check_plugin, model_op_cases

    graph = demo_graph()
    x = np.random.default_rng(0).standard_normal((1, 32, 64)).astype(np.float32)
    report = check_plugin("numpy", cases=model_op_cases(graph, {"x": x}))
    assert report.ok, report.summary(only_problems=True)
    assert report.cases("PASS"), "the plugin ran none of the model's ops"
