"""``dspark cache list`` and ``dspark cache clear``: the disk cache of microbenchmarks and calibrations.

Registered on the typer app of :mod:`dspark.cli.main` by one import there.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from dspark.cli.app import JsonOpt, fmt_bytes, app, err, out

cache_app = typer.Typer(no_args_is_help=True,
                        help="The disk cache ($DSPARK_CACHE_DIR, default ~/.cache/dspark): probe microbenchmarks "
                             "and calibrated bids.")
app.add_typer(cache_app, name="cache")

NamespaceOpt = Annotated[list[str] | None, typer.Option(
    "-n", "--namespace", metavar="NAME", help="Only this namespace (e.g. calibration). Repeatable.")]


def _summary(value: Any) -> str:
    if isinstance(value, dict):
        if "latency_s" in value:
            text = f"{float(value['latency_s']) * 1e3:.4g} ms ({value.get('source', 'calibrated')}"
            text += f", {value['samples']} runs" if "samples" in value else ""
            text += ", busy host" if value.get("busy") else ""
            return text + ")"
        if "failed" in value:
            return f"failed: {value['failed']}"
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _selected(namespace: list[str] | None) -> list[str]:
    from dspark.host import cache

    if not namespace:
        return cache.namespaces()
    invalid = [n for n in namespace if "/" in n or n in ("", ".", "..")]
    if invalid:
        raise typer.BadParameter(f"not a namespace name: {invalid[0]!r}", param_hint="--namespace")
    return list(dict.fromkeys(namespace))


@cache_app.command("list")
def list_(as_json: JsonOpt = False, namespace: NamespaceOpt = None,
          entries: Annotated[bool, typer.Option("--entries", help="List every entry, not only the namespaces "
                                                                  "(implied by --namespace).")] = False) -> None:
    """What the disk cache holds: entries and size per namespace (and each entry with --entries)."""
    from dspark.host import cache

    names = _selected(namespace)
    show_entries = entries or bool(namespace)
    rows = []
    for name in names:
        found = cache.entries(name)
        row: dict[str, Any] = {"namespace": name, "entries": len(found), "bytes": sum(e.size for e in found),
                               "newest": max((e.mtime for e in found), default=None)}
        if show_entries:
            row["items"] = [{"file": e.path.name, "bytes": e.size, "mtime": e.mtime, "key": e.key, "value": e.value}
                            for e in found]
        rows.append(row)
    if as_json:
        print(json.dumps({"dir": str(cache.cache_dir()), "namespaces": rows}, indent=2, default=str))
        return
    if not rows:
        out.print(f"the cache at {cache.cache_dir()} is empty")
        return
    table = Table(title=f"Disk cache: {cache.cache_dir()}", title_justify="left")
    for col in ("namespace", "entries", "size", "newest"):
        table.add_column(col)
    for row in rows:
        newest = "-" if row["newest"] is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row["newest"]))
        table.add_row(row["namespace"], str(row["entries"]), fmt_bytes(row["bytes"]), newest)
    out.print(table)
    for row in rows:
        if "items" not in row:
            continue
        items = Table(title=f"{row['namespace']}", title_justify="left")
        for col in ("file", "key", "value"):
            items.add_column(col, overflow="fold")
        for item in row["items"]:
            key = item["key"]
            if isinstance(key, dict):  # what tells entries apart, not what they all share
                key = {k: v for k, v in key.items() if k not in ("host", "v")}
            items.add_row(item["file"], json.dumps(key, default=str)[:160], _summary(item["value"]))
        out.print(items)


@cache_app.command("clear")
def clear(namespace: NamespaceOpt = None, as_json: JsonOpt = False) -> None:
    """Delete cached entries (every namespace, or those named): they are measured again when next needed."""
    from dspark.host import cache
    from dspark.sdk import calibration

    removed: dict[str, int] = {}
    for name in _selected(namespace):
        removed[name] = calibration.clear() if name == calibration.NAMESPACE else cache.clear(name)
    if as_json:
        print(json.dumps({"dir": str(cache.cache_dir()), "removed": removed}, indent=2))
        return
    if not removed:
        err.print(f"the cache at {cache.cache_dir()} is empty: nothing to clear")
        return
    for name, n in removed.items():
        out.print(f"{name}: {n} entr{'y' if n == 1 else 'ies'} removed")
