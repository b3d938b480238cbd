"""The whole test suite of a dspark plugin can be this: the core's conformance kit."""

from dspark.testing import PluginConformance


class TestNumpyPlugin(PluginConformance):
    plugin = "numpy"
