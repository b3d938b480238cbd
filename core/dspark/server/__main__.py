"""``python -m dspark.server --config FILE``: the same command as ``dspark serve``."""

from dspark.server.cli import main

main()
