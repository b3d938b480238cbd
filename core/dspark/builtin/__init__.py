"""Plugins that ship inside the core."""
