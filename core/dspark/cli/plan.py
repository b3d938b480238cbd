"""``dspark plan`` and ``dspark run``: place a model, explain the plan, execute it.

Registered on the typer app of :mod:`dspark.cli.main` by one import there.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    import numpy as np
    from dspark.graph.model import Graph
    from dspark.host.inventory import Inventory
    from dspark.placement.plan import Plan
    from dspark.host.plugin_manager import PluginHost


from dspark.cli.app import JsonOpt, PluginOpt, app, err, fmt_bytes, host_from_cli, out  # noqa: E402
from dspark.cli.faults import faults_json, print_faults  # noqa: E402


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status 2, no traceback."""


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    from dspark.placement.executor import PartitionFailed, PlanError
    from dspark.placement.placer import PlacementError
    from dspark.placement.profile import ProfileError
    from pydantic import ValidationError

    try:
        yield
    except (CLIError, ProfileError, PlacementError, PlanError, PartitionFailed) as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    except ValidationError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None


@contextlib.contextmanager
def _spinner(message: str, quiet: bool = False) -> Iterator[None]:
    if sys.stderr.isatty() and not quiet:
        with err.status(message):
            yield
    else:
        yield


def load_graph(spec: str) -> Graph:
    """``demo``, an ONNX path, or (with :mod:`dspark.graph.importers`) a ``module:factory`` torch or JAX spec."""
    from dspark.graph.model import Graph
    from dspark.testing import demo_graph  # the demo model lives in the public testing kit

    if spec == "demo":
        return demo_graph()
    try:
        from dspark.graph import importers
    except ImportError:  # the importer module is optional: ONNX files still load below
        importers = None  # type: ignore[assignment]
    if importers is not None:
        try:
            return importers.load_model(spec)
        except FileNotFoundError as exc:
            raise CLIError(str(exc)) from None
        except Exception as exc:  # the importer's message is the useful part
            raise CLIError(f"cannot load model {spec!r}: {exc}") from None
    path = Path(spec)
    if not path.is_file():
        raise CLIError(f"model file not found: {spec} (give an .onnx file or 'demo')")
    try:
        return Graph.from_onnx(str(path))
    except Exception as exc:
        raise CLIError(f"cannot load ONNX model {spec}: {type(exc).__name__}: {exc}") from None


def _context(devices: Path | None, plugin: list[str] | None) -> tuple[PluginHost, Inventory]:
    from dspark.host.inventory import probe
    from dspark.placement.profile import profile_host

    if devices is not None:
        return profile_host(devices)
    host = host_from_cli(plugin)
    return host, probe(host)


def _abbrev(ops: list[str], limit: int = 6) -> str:
    return ", ".join(ops) if len(ops) <= limit else f"{', '.join(ops[:3])}, ... {ops[-1]} ({len(ops)} ops)"


def _print_plan(graph: Graph, plan: Plan, plan_s: float | None) -> None:
    from dspark.placement.plan import tensor_bytes

    fmt = fmt_bytes
    table = Table(title=f"Plan for {plan.model} ({len(graph.ops)} ops)", title_justify="left")
    for col in ("#", "target", "runtime", "ops", "predicted ms", "precision", "bids beaten (ms)",
                "bytes in / out", "after"):
        table.add_column(col, overflow="fold")
    for p in plan.partitions:
        beaten = ", ".join(f"{b.target} {b.latency_ms:.3f}" for b in sorted(p.beaten_bids, key=lambda b: b.latency_ms))
        table.add_row(str(p.id), p.target.key, p.target.runtime, escape(_abbrev(p.ops)), f"{p.predicted_ms:.3f}",
                      p.precision, beaten or "-",
                      f"{fmt(tensor_bytes(graph, p.inputs))} / {fmt(tensor_bytes(graph, p.outputs))}",
                      " ".join(map(str, p.depends_on)) or "-")
    out.print(table)
    out.print(f"predicted total: [bold]{plan.predicted_total_ms:.3f} ms[/] "
              f"(transfers {plan.transfer_ms:.3f} ms, {len(plan.partitions)} partition(s))")
    if plan.best_single_target:
        out.print(f"best single target: {plan.best_single_target} {plan.best_single_ms:.3f} ms")
    out.print(f"gate: {escape(plan.gate or '-')}")
    out.print(f"decision: {escape(plan.decision or '-')}")
    out.print(f"solver: {plan.solver}" + (f"; planned in {plan_s:.2f} s" if plan_s is not None else ""))


@app.command("plan")
def plan_cmd(
    model: Annotated[str, typer.Argument(help="ONNX file, 'module:factory' spec (torch, JAX or Flax), or 'demo'.")],
    as_json: JsonOpt = False,
    devices: Annotated[Path | None, typer.Option(
        "--devices", metavar="FILE", help="Plan for a device profile (YAML) instead of this machine.")] = None,
    save: Annotated[Path | None, typer.Option("--save", metavar="PLAN.json", help="Write the plan here.")] = None,
    html: Annotated[Path | None, typer.Option(
        "--html", metavar="OUT.html", help="Draw the plan: the graph coloured by target, partition by partition, "
                                           "in one self-contained HTML page written here.")] = None,
    measure: Annotated[bool, typer.Option(
        "--measure", help="Race plans predicted within the cost model's error of the best on real runs "
                          "(random inputs, or --inputs) and keep the measured fastest.")] = False,
    inputs: Annotated[Path | None, typer.Option(
        "--inputs", metavar="FILE.npz", help="With --measure: input arrays keyed by input name.")] = None,
    plugin: PluginOpt = None,
) -> None:
    """Place MODEL on the devices (each op where it is predicted cheapest) and explain the plan."""
    from dspark.placement import placer

    with _errors():
        graph = load_graph(model)
        if inputs is not None and not measure:
            raise CLIError("--inputs is for --measure: without it no plan is run")
        if measure and devices is not None:
            raise CLIError("--measure runs the plans on this machine; it cannot measure a --devices profile")
        with _spinner("probing devices and collecting bids...", as_json):
            host, inv = _context(devices, plugin)
            t0 = time.perf_counter()
            ranked = placer.candidates(graph, host, inv)
            plan_s = time.perf_counter() - t0
        with _spinner("racing close plans...", as_json or not measure):
            feeds = _load_inputs(graph, inputs) if measure else None
            what = f"the inputs in {inputs}" if inputs is not None else "random inputs"
            plan = _choose(graph, host, inv, ranked, feeds, what)
        if save is not None:
            plan.save(save)
        if html is not None:
            _write_html(graph, plan, html)
        if as_json:
            if html is not None:  # stdout stays the JSON
                err.print(f"wrote {escape(str(html))}", soft_wrap=True)
            # "plugins" (every plugin's status and failures) is for people and tools; --save keeps the plan only.
            print(json.dumps({**plan.to_json_dict(), "plugins": faults_json(host.records.values())}, indent=2))
            return
        _print_plan(graph, plan, plan_s)
        print_faults(host.records.values(), out)
        _warn_memory(graph, plan, inv)
        if save is not None:
            out.print(f"saved to {escape(str(save))}")
        if html is not None:
            out.print(f"wrote {escape(str(html))}", soft_wrap=True)


def _write_html(graph: Graph, plan: Plan, path: Path) -> None:
    from dspark.placement.picture import render_plan_html

    try:
        path.write_text(render_plan_html(graph, plan), encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"cannot write {path}: {exc.strerror or exc}") from None


def _choose(graph: Graph, host: PluginHost, inv: Inventory, ranked: list[Plan],
            feeds: dict[str, np.ndarray] | None, what: str) -> Plan:
    """The plan to keep: given ``feeds``, close rivals raced on real runs of them; else the predicted
    best, its decision naming the rivals that a measurement could decide between."""
    from dspark.placement.adaptive import trial
    from dspark.placement.executor import compile_plan

    if feeds is not None:
        return trial.choose(ranked, lambda p: compile_plan(graph, p, host, inv), feeds, what=what)
    best, rivals = ranked[0], trial.close_rivals(ranked)
    if rivals:
        best.decision = (f"predicted: {trial.label(best)} {best.predicted_total_ms:.3f} ms; to race (within the "
                         f"cost model's error, or a split's fastest single runtime): "
                         + ", ".join(f"{trial.label(p)} {p.predicted_total_ms:.3f} ms" for p in rivals)
                         + " (not measured: use --measure)")
    else:
        best.decision = trial.predicted(best, ranked[1] if len(ranked) > 1 else None, trial.DEFAULT_ERROR)
    return best


def _warn_memory(graph: Graph, plan: Plan, inv: Inventory) -> None:
    from dspark.placement.placer import over_budget

    for problem in over_budget(graph, plan, inv):
        err.print(f"[yellow]warning:[/] the plan exceeds a memory budget: {escape(problem)}", soft_wrap=True)


def _load_inputs(graph: Graph, path: Path | None) -> dict[str, np.ndarray]:
    import numpy as np
    from dspark.placement.executor import random_inputs

    if path is None:
        return random_inputs(graph)
    try:
        with np.load(path) as data:
            arrays: dict[str, np.ndarray] = {k: np.asarray(data[k]) for k in data.files}
    except FileNotFoundError:
        raise CLIError(f"inputs file not found: {path}") from None
    except Exception as exc:
        raise CLIError(f"cannot read inputs {path} (want an .npz keyed by input name): {exc}") from None
    missing = [n for n in graph.inputs if n not in arrays]
    if missing:
        raise CLIError(f"{path} lacks graph input(s) {missing}; it holds {sorted(arrays)}")
    return {n: arrays[n] for n in graph.inputs}


def _reuse_or_plan(graph: Graph, host: PluginHost, inv: Inventory, plan_file: Path | None,
                   feeds: dict[str, np.ndarray]) -> tuple[Plan, str | None, float | None]:
    """The saved plan when its fingerprints match, else a fresh one (close rivals raced on ``feeds``)
    and why."""
    from dspark.placement import placer
    from dspark.placement.plan import Plan, Target, graph_fingerprint, hardware_fingerprint

    why: str | None = None
    if plan_file is not None:
        try:
            saved = Plan.load(plan_file)
        except FileNotFoundError as exc:
            raise CLIError(str(exc)) from None
        except ValueError as exc:
            raise CLIError(f"{plan_file} is not a dspark plan: {exc}") from None
        g_fp = graph_fingerprint(graph)
        hw_fp = hardware_fingerprint([Target(plugin=d.plugin, device_id=d.id, runtime=d.runtime)
                                      for d in inv.drivers()])
        if saved.graph_fingerprint != g_fp:
            why = f"the model changed since the plan was saved (graph {saved.graph_fingerprint} -> {g_fp})"
        elif saved.hardware_fingerprint != hw_fp:
            why = (f"the devices/plugins changed since the plan was saved "
                   f"(hardware {saved.hardware_fingerprint} -> {hw_fp})")
        else:
            return saved, None, None
    t0 = time.perf_counter()
    plan = _choose(graph, host, inv, placer.candidates(graph, host, inv), feeds, "the run's inputs")
    return plan, why, time.perf_counter() - t0


@app.command("run")
def run_cmd(
    model: Annotated[str, typer.Argument(help="ONNX file, 'module:factory' spec (torch, JAX or Flax), or 'demo'.")],
    plan_file: Annotated[Path | None, typer.Option(
        "--plan", metavar="PLAN.json", help="Use this saved plan if the model and devices still match it.")] = None,
    inputs: Annotated[Path | None, typer.Option(
        "--inputs", metavar="FILE.npz", help="Input arrays keyed by input name (default: random).")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="Timed runs after one warm-up.")] = 10,
    as_json: JsonOpt = False,
    plugin: PluginOpt = None,
) -> None:
    """Execute MODEL on its plan; show predicted vs measured time and the error vs the torch reference.

    A partition whose compile or run fails is planned around (its bid dropped) and the run goes on;
    the failures are shown.
    """
    import numpy as np
    from dspark.placement.executor import reference_outputs
    from dspark.placement.fallback import compile_with_fallback
    from dspark.types import TOLERANCES

    with _errors():
        graph = load_graph(model)
        feed = _load_inputs(graph, inputs)
        with _spinner("probing devices and planning...", as_json):
            host, inv = _context(None, plugin)
            plan, why, plan_s = _reuse_or_plan(graph, host, inv, plan_file, feed)
        if why and not as_json:
            err.print(f"re-planning: {escape(why)}")
        with _spinner("compiling and running...", as_json):
            resilient = compile_with_fallback(graph, host, inv, plan)
            resilient.run(feed)  # warm-up; a partition failing here is planned around
            walls: list[float] = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                result = resilient.run(feed)
                walls.append((time.perf_counter() - t0) * 1e3)
            ref = reference_outputs(graph, feed)
        plan, compiled = resilient.plan, resilient.compiled
        measured = compiled.measured_ms()
        precisions = [p.precision for p in plan.partitions]
        worst = max(precisions, key=lambda p: TOLERANCES.get(p, TOLERANCES["float32"])[0])
        rtol, atol = TOLERANCES.get(worst, TOLERANCES["float32"])
        errors = {n: float(np.max(np.abs(result[n].astype(np.float64) - ref[n].astype(np.float64))))
                  if result[n].size else 0.0 for n in graph.outputs}
        ok = all(np.allclose(result[n], ref[n], rtol=rtol, atol=atol) for n in graph.outputs)
        report: dict[str, Any] = {
            "model": graph.name,
            "plan_source": "planned" if plan_s is not None else "loaded",
            "replan_reason": why, "plan_time_s": plan_s, "compile_s": resilient.compile_s, "repeat": repeat,
            "partitions": [{"id": p.id, "target": p.target.key, "runtime": p.target.runtime, "ops": len(p.ops),
                            "predicted_ms": p.predicted_ms, "measured_ms": measured.get(p.id)}
                           for p in plan.partitions],
            "predicted_total_ms": plan.predicted_total_ms,
            "measured_total_ms": statistics.median(walls),
            "max_abs_error": max(errors.values(), default=0.0), "errors": errors,
            "tolerance": {"precision": worst, "rtol": rtol, "atol": atol}, "ok": ok,
            "plan": plan.to_json_dict(),
            "fallbacks": [f.to_json_dict() for f in resilient.fallbacks],
            "plugins": faults_json(host.records.values()),
        }
        resilient.close()
        if as_json:
            print(json.dumps(report, indent=2))
        else:
            _print_run(report)
            print_faults(host.records.values(), out)
        if not ok:
            bad = [f"{n} (max abs error {errors[n]:.3g})" for n in graph.outputs
                   if not np.allclose(result[n], ref[n], rtol=rtol, atol=atol)]
            err.print(f"outputs beyond the {worst} tolerance (rtol {rtol:g}, atol {atol:g}) of the torch reference: "
                      + ", ".join(bad) + "; targets: " + ", ".join(f"{p.id}: {p.target.key}" for p in plan.partitions))
            raise typer.Exit(1)


def _print_run(r: dict[str, Any]) -> None:
    table = Table(title=f"{r['model']}: predicted vs measured (median of {r['repeat']} runs)", title_justify="left")
    for col in ("#", "target", "runtime", "ops", "predicted ms", "measured ms", "measured / predicted"):
        table.add_column(col)
    for p in r["partitions"]:
        m = p["measured_ms"]
        ratio = f"{m / p['predicted_ms']:.2f}x" if m is not None and p["predicted_ms"] > 0 else "-"
        table.add_row(str(p["id"]), p["target"], p["runtime"], str(p["ops"]), f"{p['predicted_ms']:.3f}",
                      "-" if m is None else f"{m:.3f}", ratio)
    out.print(table)
    source = "saved plan reused" if r["plan_source"] == "loaded" else f"planned in {r['plan_time_s']:.2f} s"
    out.print(f"total: predicted {r['predicted_total_ms']:.3f} ms, measured {r['measured_total_ms']:.3f} ms "
              f"(end to end, incl. transfers); {source}; compiled in {r['compile_s']:.2f} s")
    if r["plan"].get("decision"):
        out.print(f"decision: {escape(r['plan']['decision'])}", soft_wrap=True)
    for f in r["fallbacks"]:
        out.print(f"[yellow]fallback:[/] {f['stage']} of partition {f['partition']} on {f['target']} failed "
                  f"({escape(f['reason'])}); re-planned without that bid", soft_wrap=True)
    tol = r["tolerance"]
    verdict = "[green]ok[/]" if r["ok"] else "[red]EXCEEDS TOLERANCE[/]"
    out.print(f"max |error| vs torch fp32 reference: {r['max_abs_error']:.2e} "
              f"({tol['precision']}: rtol {tol['rtol']:g}, atol {tol['atol']:g}) {verdict}")
