"""``dspark serve``: the OpenAI-compatible server, registered on the main app.

The command itself lives in :mod:`dspark.server.cli` so ``dspark-server`` and
``python -m dspark.server`` run the very same function.
"""

from __future__ import annotations

from dspark.cli.app import app
from dspark.server.cli import serve

app.command("serve")(serve)
