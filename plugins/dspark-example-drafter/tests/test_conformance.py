"""The plugin passes the core's conformance kit (registration, API version, drafters)."""

from dspark.testing import PluginConformance


class TestBigramPlugin(PluginConformance):
    plugin = "bigram"


def test_proposes_the_most_frequent_follower() -> None:
    from dspark_example_drafter import BigramDrafter

    d = BigramDrafter()
    # 1 -> 2 (three times); 2 -> 3 (twice); 3 -> 1 and 9 once each, 9 the more recent
    assert d.propose([1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1], 3).tokens == [2, 3, 9]
    assert d.propose([5], 4).tokens == []
    assert d.propose([1, 2, 1], 0).tokens == []
