"""Every plugin's failures, as JSON and as a table: shared by ``dspark devices``, ``plan`` and ``run``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from dspark.types import PluginRecord


def faults_json(records: Iterable[PluginRecord]) -> list[dict[str, Any]]:
    """Per plugin: name, status, reason and its faults (hook, subgraph, device, reason, count, charged to)."""
    return [{"name": r.name, "status": r.status.value, "reason": r.reason,
             "faults": [f.model_dump(mode="json") for f in r.faults]} for r in records]


def print_faults(records: Iterable[PluginRecord], console: Console) -> None:
    """A table of every recorded failure, or one line saying there were none."""
    rows = [f for r in records for f in r.faults]
    if not rows:
        console.print("plugin failures: none")
        return
    table = Table(title="Plugin failures", title_justify="left")
    for col in ("plugin", "hook", "subgraph (ops)", "device", "count", "charged to", "reason"):
        table.add_column(col, overflow="fold")
    for f in rows:
        sub = "-" if f.subgraph is None else f.subgraph + (f" ({f.ops})" if f.ops else "")
        table.add_row(f.plugin, f.hook, escape(sub), f.device or "-", str(f.count), f.charged_to, escape(f.reason))
    console.print(table)
