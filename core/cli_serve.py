"""``dspark serve``: the OpenAI-compatible server, registered on the main app.

The command itself lives in :mod:`dspark.server.cli` so ``dspark-server`` and
``python -m dspark.server`` run the very same function.
"""

from __future__ import annotations

from dspark.cli_plan import _cli_module  # the running CLI module, also under ``python -m dspark.cli``
from dspark.server.cli import serve

_cli_module().app.command("serve")(serve)
