"""The ``dspark`` command line."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from dspark.settings import PluginSettings

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
    from dspark.plugin_manager import PluginHost

    return PluginHost(PluginSettings.from_env([*_global_specs, *(specs or [])])).load()


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return "-"


def _fmt_rate(n: float | None, unit: str) -> str:
    if not n:
        return "-"
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


@app.command()
def devices(
    as_json: JsonOpt = False,
    refresh: Annotated[bool, typer.Option("--refresh", help="Re-run cached microbenchmarks.")] = False,
    plugin: PluginOpt = None,
) -> None:
    """List every device, the plugins/runtimes that drive it, and every plugin's status."""
    from dspark.inventory import probe

    host = host_from_cli(plugin)
    if sys.stderr.isatty() and not as_json:
        with err.status("probing devices..."):
            inv = probe(host, refresh=refresh)
    else:
        inv = probe(host, refresh=refresh)
    if as_json:
        print(json.dumps(inv.to_json_dict(), indent=2))
        return
    table = Table(title="Devices", title_justify="left")
    for col in ("id", "kind", "name", "memory free/total", "peak compute", "mem bw", "host link",
                "dtypes", "driven by (plugin: runtime)"):
        table.add_column(col, overflow="fold")
    for d in inv.devices:
        flops = ", ".join(f"{k.replace('float', 'f').replace('bfloat', 'bf')} {_fmt_rate(v, 'FLOP/s')}"
                          for k, v in sorted(d.peak_flops.items(), key=lambda kv: -kv[1]))
        table.add_row(
            d.id, d.kind, d.name,
            f"{_fmt_bytes(d.memory_free_bytes)} / {_fmt_bytes(d.memory_total_bytes)}",
            flops or "-", _fmt_rate(d.memory_bandwidth_bytes_per_s, "B/s"),
            _fmt_rate(d.host_link_bandwidth_bytes_per_s, "B/s"), " ".join(d.dtypes),
            "\n".join(f"{drv.plugin}: {drv.runtime}" for drv in d.drivers),
        )
    out.print(table)
    ptable = Table(title="Plugins", title_justify="left")
    for col in ("name", "version", "source", "status", "devices", "reason / unavailable"):
        ptable.add_column(col, overflow="fold")
    colors = {"active": "green", "no hardware": "yellow", "failed": "red", "blocked": "dim"}
    for p in inv.plugins:
        ptable.add_row(p.name, p.version, p.source, f"[{colors[p.status.value]}]{p.status.value}[/]",
                       " ".join(p.devices) or "-",
                       "\n".join([p.reason] * bool(p.reason) + [f"{u.what}: {u.reason}" for u in p.unavailable if u.reason not in p.reason]))
    out.print(ptable)


@app.command()
def demo(as_json: JsonOpt = False, plugin: PluginOpt = None,
         repeat: Annotated[int, typer.Option(help="Timed runs per target.")] = 20) -> None:
    """Run the bundled demo model (a transformer block) on every device/runtime that bids for it."""
    from dspark.demo import run_demo
    from dspark.inventory import probe

    host = host_from_cli(plugin)
    if sys.stderr.isatty() and not as_json:
        with err.status("probing devices, compiling and timing the demo model..."):
            rows = run_demo(host, probe(host), repeat=repeat)
    else:
        rows = run_demo(host, probe(host), repeat=repeat)
    if as_json:
        print(json.dumps({"model": "demo_block", "targets": [r.model_dump() for r in rows]}, indent=2))
        return
    table = Table(title="Demo model (pre-norm transformer block, 1x32x64) on each target", title_justify="left")
    for col in ("device", "plugin", "runtime", "predicted ms", "measured ms (median)", "precision",
                "max |err| vs torch", "ok", "note"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.device, r.plugin, r.runtime,
                      "-" if r.predicted_ms is None else f"{r.predicted_ms:.3f}",
                      "-" if r.measured_ms is None else f"{r.measured_ms:.3f}",
                      r.precision or "-", "-" if r.max_abs_err is None else f"{r.max_abs_err:.2e}",
                      "[green]yes[/]" if r.ok else ("-" if r.measured_ms is None else "[red]NO[/]"), r.note)
    out.print(table)
    if any(r.measured_ms is not None and not r.ok for r in rows):
        raise typer.Exit(1)


from dspark import cli_plan as _cli_plan  # noqa: E402,F401  (registers plan/run)
from dspark import cli_serve as _cli_serve  # noqa: E402,F401  (registers serve)
from dspark import cli_bench as _cli_bench  # noqa: E402,F401  (registers bench)
from dspark import cli_convert as _cli_convert  # noqa: E402

app.command("convert")(_cli_convert.convert)


def main() -> None:
    import os
    import threading

    from dspark import log

    log.configure()
    code: int | str | None = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    # A plugin hook that hung past its timeout still owns a thread; it must not
    # keep the process alive or crash the interpreter's shutdown.
    if any(t.name.startswith("dspark-hook-") and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 1)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
