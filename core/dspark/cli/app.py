"""The ``dspark`` app every command module registers on, its consoles, shared options and formatting."""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from dspark.host.settings import PluginSettings

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="dspark: pluggable inference runtime. Plugins bid on subgraphs; ops run where they are cheapest.")
out = Console(width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True)

PluginOpt = Annotated[list[str] | None, typer.Option(
    "-p", "--plugin", metavar="no:NAME|MODULE",
    help="Block a plugin (no:NAME) or load a plugin module by import path. Repeatable.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]

_global_specs: list[str] = []


@app.callback()
def _root(plugin: PluginOpt = None) -> None:
    _global_specs.extend(plugin or [])


def host_from_cli(specs: list[str] | None):  # type: ignore[no-untyped-def]
    from dspark.host.plugin_manager import PluginHost

    return PluginHost(PluginSettings.from_env([*_global_specs, *(specs or [])])).load()


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return "-"


def fmt_rate(n: float | None, unit: str) -> str:
    if not n:
        return "-"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {prefix}{unit}"
    return f"{n:.0f} {unit}"
