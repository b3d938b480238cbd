"""The ``dspark`` command line: one module per group of verbs, registered on the app in :mod:`.main`."""

from __future__ import annotations


def main() -> None:
    """Entry point of the ``dspark`` console script."""
    from dspark.cli.main import main as _main

    _main()
