"""``python -m dspark.cli``."""

from dspark.cli.main import main

main()
