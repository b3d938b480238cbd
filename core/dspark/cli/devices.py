"""``dspark devices`` and ``dspark demo``: what the plugins found, and the demo model on each target."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.table import Table

from dspark.cli.app import JsonOpt, PluginOpt, fmt_bytes, fmt_rate, app, err, host_from_cli, out
from dspark.cli.faults import print_faults


@app.command()
def devices(
    as_json: JsonOpt = False,
    refresh: Annotated[bool, typer.Option("--refresh", help="Re-run cached microbenchmarks.")] = False,
    plugin: PluginOpt = None,
    cluster: Annotated[bool, typer.Option("--cluster", help="Every node of a Ray cluster, probed on the node.")] = False,
    ray_address: Annotated[str | None, typer.Option(help="With --cluster: the cluster to join (default 'auto').")] = None,
    decoders: Annotated[str | None, typer.Option(
        "--decoders", metavar="MODEL", help="Also ask every plugin to bid on MODEL's whole decoder ('default' = the "
        "embedded model), time the bidders at the engine's step shapes and show which would run it and why.")] = None,
    dtype: Annotated[str, typer.Option(help="With --decoders: the engine dtype.")] = "auto",
) -> None:
    """List every device, the plugins/runtimes that drive it, and every plugin's status and failures."""
    from dspark.host.inventory import probe

    if decoders is not None:
        _decoders(decoders, dtype, plugin, as_json)
        return
    if cluster:
        _cluster_devices(ray_address, as_json)
        return

    host = host_from_cli(plugin)
    if refresh:  # calibrations are microbenchmarks too: the next plan measures them again
        from dspark.sdk.calibration import clear as clear_calibrations

        clear_calibrations()
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
        flops = ", ".join(f"{k.replace('float', 'f').replace('bfloat', 'bf')} {fmt_rate(v, 'FLOP/s')}"
                          for k, v in sorted(d.peak_flops.items(), key=lambda kv: -kv[1]))
        table.add_row(
            d.id, d.kind, d.name,
            f"{fmt_bytes(d.memory_free_bytes)} / {fmt_bytes(d.memory_total_bytes)}",
            flops or "-", fmt_rate(d.memory_bandwidth_bytes_per_s, "B/s"),
            fmt_rate(d.host_link_bandwidth_bytes_per_s, "B/s"), " ".join(d.dtypes),
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
    print_faults(inv.plugins, out)


def _cluster_devices(address: str | None, as_json: bool) -> None:
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        err.print("error: --cluster needs Ray; install it with pip install 'dspark[cluster]'")
        raise typer.Exit(2)
    from dspark.server.cluster.nodes import cluster_devices

    try:
        if sys.stderr.isatty() and not as_json:
            with err.status("probing every node..."):
                nodes = cluster_devices(address)
        else:
            nodes = cluster_devices(address)
    except ConnectionError as e:
        err.print(f"error: --cluster: no Ray cluster to join ({e})")
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps({"nodes": nodes}, indent=2))
        return
    table = Table(title=f"Devices on {len(nodes)} nodes", title_justify="left")
    for col in ("node", "address", "device", "kind", "name", "memory total", "driven by (plugin: runtime)"):
        table.add_column(col, overflow="fold")
    ptable = Table(title="Plugins per node", title_justify="left")
    for col in ("node", "plugin", "status", "devices", "reason"):
        ptable.add_column(col, overflow="fold")
    for n in nodes:
        node = n["node_id"][:12]
        if n.get("error"):
            table.add_row(node, n["address"], "-", "-", f"[red]{n['error']}[/]", "-", "-")
        for d in n["devices"]:
            table.add_row(node, n["address"], d["id"], d["kind"], d["name"], fmt_bytes(d.get("memory_total_bytes")),
                          "\n".join(f"{drv['plugin']}: {drv['runtime']}" for drv in d.get("drivers", [])))
        for p in n["plugins"]:
            ptable.add_row(node, p["name"], p["status"], " ".join(p.get("devices", [])) or "-", p.get("reason") or "")
    out.print(table)
    out.print(ptable)


@app.command()
def demo(as_json: JsonOpt = False, plugin: PluginOpt = None,
         repeat: Annotated[int, typer.Option(help="Timed runs per target.")] = 20) -> None:
    """Run the bundled demo model (a transformer block) on every device/runtime that bids for it."""
    from dspark.cli.demo import run_demo
    from dspark.host.inventory import probe

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


def _decoders(model: str, dtype: str, plugin: list[str] | None, as_json: bool) -> None:
    """``dspark devices --decoders MODEL``: the engine's decoder choice for MODEL, bids and timings."""
    from pathlib import Path

    from dspark.host import progress
    from dspark.llm.api import default_model_path
    from dspark.llm.engine import LLMEngine
    from dspark.llm.gguf import is_gguf

    path = default_model_path() if model == "default" else Path(model)
    if not ((path / "config.json").exists() or is_gguf(path)):
        err.print(f"[red]error:[/red] --decoders: {path} is neither a checkpoint directory (no config.json) "
                  "nor a GGUF file")
        raise typer.Exit(2)
    host = host_from_cli(plugin)
    with progress.on_terminal(f"bidding on {path.name}'s decoder and timing the bidders"):
        # The engine's own start-up path, so a GGUF file is offered as the engine offers it.
        engine = LLMEngine.from_model(path, dtype=dtype, decoder="auto", plugin_host=host)
    runner = engine.runner
    choice = engine.decoder_choice
    if choice is None:
        err.print(f"[red]error:[/red] --decoders: {path.name} runs only on the torch runner here")
        raise typer.Exit(1)
    if as_json:
        print(json.dumps(choice.to_dict(), indent=2))
        return
    shapes = list(next((r["step_ms"] for r in choice.ranked if r.get("step_ms")), {}))
    table = Table(title=f"Decoder targets for {path.name} ({runner.dtype}), best first", title_justify="left")
    for col in ("target", "runtime", "relative time", *[f"{s} ms" for s in shapes], "CPU held by others"):
        table.add_column(col)
    for r in choice.ranked:
        ms = r.get("step_ms") or {}
        table.add_row(r["label"], r["runtime"], f"{r['score']:.2f}" if "score" in r else "-",
                      *[f"{ms[s]:.2f}" if s in ms else "-" for s in shapes],
                      f"{r['busy']:.0%}" if r.get("busy") is not None else "-")
    out.print(table)
    for d in choice.declined:
        out.print(f"declined: {d['label']}: {d['reason']}")
    out.print(f"runs on [bold]{choice.chosen}[/bold]: {choice.reason}")
