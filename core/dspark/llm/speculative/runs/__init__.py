"""DeepSpec's runs for a lone greedy request: which way it decodes its next stretch (``replay``)."""
