"""Placement benchmark: dspark's automatic plan vs each single runtime, on real models.

Usage: .venv/bin/pip install -c constraints/cpu.txt -e '.[bench]'   (once)
       .venv/bin/python benchmarks/placement.py [--models vit-tiny,resnet18,...] [--rounds 3] [--runs 40]
                                                [--json rows.json] [--keep-cache]

Models: see ``benchmarks/models.py`` (``--models`` takes a comma-separated
subset; default all). Contenders, per model:
 - torch eager: the nn.Module itself, the way a user runs it today (when the
   model has one);
 - each single runtime on the imported graph: torch reference, ONNX Runtime
   CPU EP, OpenVINO CPU (whole graph as one partition); "n/a" when the
   runtime does not bid on the whole graph (it abstains on some op) or
   compiling or running it fails, with the reason printed;
 - dspark's plan as a user runs it: an ``AdaptiveRunner`` (bids, placement,
   the race between close plans on the first run, online correction).

Each contender runs in a process of its own (the runtimes' worker threads
spin after a call and slow whatever runs next in the same process), and the
processes alternate: ``--rounds`` rounds, each starting every contender once
for ``--runs`` timed runs after 15 warm-up runs (a dspark process warms up
until its runner has stopped exploring, re-planning in the background and
racing what that brings, for 15 runs in a row, at most 60 s; the runs that
took are reported as its settling); the figure is the median of all
its timed runs. The model is exported to ONNX once, by this process; every
contender checks its output against the reference (allclose, 1e-3) before it
is timed. Reported per model: each contender's median, the ratio dspark /
best single (target <= 1.02, never above 1.05) and the same paired by round
(each round's dspark process against that round's best-single process, the
median over rounds: what drifts between rounds cancels), each process's
median, and for a one-partition plan on the best single's runtime, the
in-process ratio (in each dspark process, the plan against that runtime's
executable compiled apart, interleaved; the median over processes), the plan (partitions,
targets, decision), planning time cold (the first dspark process, with the
calibration cache as the run started: fresh unless --keep-cache) and warm
(the later ones: a whole AdaptiveRunner, and the placer alone), and the cost
model's median relative error (whole-graph bids against the single runtimes'
runs, before and after online correction; the plan's partitions in the
adaptive runner).

``--json PATH`` writes the rows (one object per model; ``null`` for n/a).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SINGLES = {"torch@cpu": "torch reference", "npu@cpu": "ONNX Runtime CPU EP", "cpu@cpu": "OpenVINO CPU"}
EAGER = "torch eager (nn.Module)"
DSPARK = "dspark plan"
SETTLE_S = 60.0  # the most a dspark process warms up waiting for its runner to stop exploring


def one_step_errors(pred_ms: float, measured_ms: list[float], alpha: float = 0.3) -> tuple[list[float], list[float]]:
    """Relative errors of the raw prediction and of the online-corrected one, per run."""
    before, after = [], []
    ratio = None
    for m in measured_ms:
        before.append(abs(pred_ms - m) / m)
        if ratio is not None:
            after.append(abs(pred_ms * ratio - m) / m)
        r = m / pred_ms if pred_ms > 0 else 1.0
        ratio = r if ratio is None else (1 - alpha) * ratio + alpha * r
    return before, after


# -- the parent: export once, alternate the contenders' processes ---------------------------------


def prepare(name: str, workdir: Path) -> dict[str, Any]:
    """Export ``name`` to ONNX, save its inputs and reference output; what the children need."""
    import onnx
    import torch
    from dspark.graph.importers import export_onnx
    from models import MODELS

    made = MODELS[name]()
    if len(made) == 2:
        module, example = made
        model, hints = export_onnx(module, example)
        reference, eager = module, True
    else:
        model, example, reference = made
        model = onnx.load(str(model)) if isinstance(model, (str, Path)) else model
        hints, eager = {}, isinstance(reference, torch.nn.Module)
    path = workdir / f"{name}.onnx"
    onnx.save(model, str(path))
    with torch.inference_mode():
        ref = reference(*example)
    ref_np = ref.numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref)
    np.savez(workdir / f"{name}.inputs.npz", *[t.numpy() for t in example])
    np.save(workdir / f"{name}.ref.npy", ref_np)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    return {"onnx": str(path), "hints": hints, "eager": eager, "opset": opset, "ops": len(model.graph.node)}


def _child(name: str, contender: str, meta: dict[str, Any], workdir: Path, runs: int) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", contender, "--models", name,
           "--runs", str(runs), "--workdir", str(workdir), "--hints", json.dumps(meta["hints"])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name}/{contender} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def bench_model(name: str, workdir: Path, rounds: int, runs: int) -> dict[str, Any]:
    meta = prepare(name, workdir)
    contenders = ([EAGER] if meta["eager"] else []) + list(SINGLES) + [DSPARK]
    samples: dict[str, list[float]] = {c: [] for c in contenders}
    per_round: dict[str, list[float]] = {c: [] for c in contenders}  # each process's median
    info: dict[str, list[dict[str, Any]]] = {c: [] for c in contenders}
    na: dict[str, str] = {}
    for _ in range(rounds):
        for c in contenders:
            if c in na:
                continue
            got = _child(name, c, meta, workdir, runs)
            if "na" in got:
                na[c] = got["na"]
                continue
            samples[c] += got["ms"]
            per_round[c].append(statistics.median(got["ms"]))
            info[c].append(got)
    row: dict[str, Any] = {"model": name, "ops": meta["ops"], "opset": meta["opset"]}
    labels = {EAGER: EAGER, **SINGLES, DSPARK: DSPARK}
    for c in contenders:
        row[labels[c]] = statistics.median(samples[c]) if samples[c] else None
    for c in SINGLES:
        row.setdefault(SINGLES[c], None)
    row.setdefault(EAGER, None)
    singles = [labels[c] for c in contenders if c != DSPARK and row[labels[c]] is not None]
    best = min(singles, key=lambda k: row[k])
    best_c = next(c for c in contenders if labels[c] == best)
    before: list[float] = []
    after: list[float] = []
    for c in SINGLES:
        for got in info[c]:
            if got.get("bid_ms"):
                b, a = one_step_errors(got["bid_ms"], got["ms"])
                before += b
                after += a
    ds = info[DSPARK]
    plans = [d["plan"] for d in ds]
    row.update({
        "best single": best, "ratio": row[DSPARK] / row[best],
        # dspark's process against the best single's process of the same round, then the median of those.
        "paired ratio": statistics.median(d / b for d, b in zip(per_round[DSPARK], per_round[best_c], strict=True)),
        "process medians": {labels[c]: [round(v, 3) for v in per_round[c]] for c in contenders},
        # A one-partition plan on the best single's runtime: paired with that runtime alone in each dspark process.
        "in-process ratio": statistics.median(d["inprocess"]["dspark_ms"] / d["inprocess"]["alone_ms"] for d in ds)
        if all(d.get("inprocess") and d["inprocess"]["target"] == best_c for d in ds) else None,
        "partitions": len(plans[-1]["partitions"]),
        "plan targets": ",".join(sorted({p["target"]["plugin"] + "@" + p["target"]["device_id"]
                                         for p in plans[-1]["partitions"]})),
        "same plan every process": len({json.dumps(_assignment(p), sort_keys=True) for p in plans}) == 1,
        "plan_cold_s": ds[0]["plan_s"], "plan_warm_s": statistics.median(d["plan_s"] for d in ds[1:]) if ds[1:] else None,
        "place_warm_s": statistics.median(d["place_s"] for d in ds),
        "err_before": statistics.median(before) if before else None,
        "err_after": statistics.median(after) if after else None,
        "plan_err_before": statistics.median(d["err"]["uncorrected"] or 0 for d in ds),
        "plan_err_after": statistics.median(d["err"]["corrected"] or 0 for d in ds),
        "plan_err_per_process": [d["err"] for d in ds],
        "settle runs": [d.get("settle_runs") for d in ds], "settled": all(d.get("settled") for d in ds),
        "decision": plans[-1].get("decision", ""), "gate": plans[-1].get("gate", ""),
        "replans": " | ".join("; ".join(d["replans"]) or "none" for d in ds), "n/a": {labels[k]: v for k, v in na.items()},
    })
    return row


def _assignment(plan: dict[str, Any]) -> dict[str, str]:
    return {op: p["target"]["plugin"] for p in plan["partitions"] for op in p["ops"]}


# -- a child: one contender, timed in a process of its own ----------------------------------------


def child(name: str, contender: str, workdir: Path, runs: int, hints: dict[str, int], warmup: int = 15) -> None:
    from dspark.graph.importers import load_model
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost

    with np.load(workdir / f"{name}.inputs.npz") as data:
        arrays = [data[f"arr_{i}"] for i in range(len(data.files))]
    ref = np.load(workdir / f"{name}.ref.npy")
    out: dict[str, Any] = {}
    if contender == EAGER:
        import torch
        from models import MODELS

        made = MODELS[name]()
        module = made[0] if len(made) == 2 else made[2]
        example = tuple(torch.from_numpy(a) for a in arrays)

        def fn() -> Any:
            with torch.inference_mode():
                return module(*example)

        got = fn().numpy()
    else:
        graph = load_model(workdir / f"{name}.onnx", name=name, dim_hints=hints)
        feeds = dict(zip(graph.inputs, arrays, strict=True))
        host = PluginHost().load()
        inv = probe(host)
        if contender == DSPARK:
            from dspark.placement import placer
            from dspark.placement.adaptive import AdaptiveRunner

            t0 = time.perf_counter()
            runner = AdaptiveRunner(graph, host, inv)
            got = runner.run(feeds)[graph.outputs[0]]  # races close plans first, on these inputs
            out["plan_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            placer.candidates(graph, host, inv)
            out["place_s"] = time.perf_counter() - t0
            # Warm up until the runner has stopped exploring (re-plans in the background and the races
            # they bring) for `warmup` runs in a row: the steady state is timed; settling is reported.
            quiet, settle_runs, t_end = 0, 0, time.perf_counter() + SETTLE_S
            while quiet < warmup and time.perf_counter() < t_end:
                quiet = 0 if runner.exploring else quiet + 1
                runner.run(feeds)
                settle_runs += 1
            runner.settle()
            out["settle_runs"], out["settled"] = settle_runs, quiet >= warmup

            def fn() -> Any:
                return runner.run(feeds)
        else:
            from dspark.placement.bidding import collect_bids
            from dspark.placement.executor import compile_plan, forced_plan

            plugin = contender.split("@")[0]
            bid = next((b for d, b in collect_bids(host, inv, graph.subgraph()) if d.plugin == plugin), None)
            if bid is None:  # compiling what a plugin abstained on would be a broken promise charged to it
                print(json.dumps({"na": f"{plugin} does not bid on the whole graph (abstains on some op)"}))
                return
            out["bid_ms"] = bid.latency_s * 1e3
            try:
                compiled = compile_plan(graph, forced_plan(graph, inv, lambda op: contender), host, inv)
                got = compiled.run(feeds)[graph.outputs[0]]
            except Exception as exc:  # noqa: BLE001 - a runtime that cannot run the model is n/a
                print(json.dumps({"na": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}))
                return

            def fn() -> Any:
                return compiled.run(feeds)
    if not np.allclose(np.asarray(got), ref, rtol=1e-3, atol=1e-3):
        raise SystemExit(f"{contender} output differs from the reference on {name}")
    import gc

    gc.collect()  # every contender starts its timing with the set-up's garbage gone
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t) * 1e3)
    out["ms"] = ms
    if contender == DSPARK:
        out["inprocess"] = _in_process(runner, graph, host, inv, feeds)
        out["plan"] = runner.plan.to_json_dict()
        out["replans"] = runner.replans
        out["err"] = runner.prediction_error()
        runner.close()
    print(json.dumps(out, default=str))


def _in_process(runner: Any, graph: Any, host: Any, inv: Any, feeds: dict[str, np.ndarray],
                rounds: int = 25, block: int = 8) -> dict[str, Any] | None:
    """A one-partition plan against its runtime's own executable, compiled again apart from dspark, in
    this process: blocks of ``block`` runs (after one untimed), in a shuffled order each round. One
    runtime's threads do not slow another here, so pairing in one process is fair, and it takes the
    spread between processes out of the comparison. None for a plan of several partitions."""
    from executor_overhead import interleaved

    from dspark.placement.executor import compile_plan, forced_plan

    if len(runner.plan.partitions) != 1:
        return None
    target = runner.plan.partitions[0].target.key
    alone = compile_plan(graph, forced_plan(graph, inv, lambda op: target), host, inv)
    exe = alone.executables[alone.plan.partitions[0].id]
    direct = {k: np.ascontiguousarray(v) for k, v in feeds.items()}
    us = interleaved({"dspark": lambda: runner.run(feeds), "alone": lambda: exe.run(direct)}, rounds * block, block)
    alone.close()
    return {"target": target, "dspark_ms": us["dspark"] / 1e3, "alone_ms": us["alone"] / 1e3}


# -- output ---------------------------------------------------------------------------------------


def _ms(v: object) -> str:
    return "n/a" if v is None else f"{float(v):.2f} ms"  # type: ignore[arg-type]


def _pct(v: object) -> str:
    return "n/a" if v is None else f"{float(v):.1%}"  # type: ignore[arg-type]


def _s(v: object) -> str:
    return "n/a" if v is None else f"{float(v):.2f}"  # type: ignore[arg-type]


def print_tables(rows: list[dict[str, Any]]) -> None:
    cols = [EAGER, *SINGLES.values(), DSPARK]
    print(f"\n{'model':<24}{'ops':>5}{'opset':>6}" + "".join(f"{c[:22]:>24}" for c in cols)
          + f"{'ratio':>8}{'paired':>8}{'in-proc':>8}  best single")
    for r in rows:
        inproc = "-" if r["in-process ratio"] is None else f"{r['in-process ratio']:.3f}"
        print(f"{r['model']:<24}{r['ops']:>5}{r['opset']:>6}" + "".join(f"{_ms(r[c]):>24}" for c in cols)
              + f"{r['ratio']:>8.3f}{r['paired ratio']:>8.3f}{inproc:>8}  {r['best single']}")
    print("ratio: median of all dspark runs / median of all the best single's runs; paired: the median over "
          "rounds of dspark's process median / the best single's process median in the same round; in-proc: "
          "(a one-partition plan on the best single's runtime) dspark against that runtime's executable "
          "compiled apart, interleaved in each dspark process, the median over processes")
    for r in rows:
        print(f"process medians[{r['model']}]: {r['process medians']}")
    print("\nplanning: cold = the first dspark process (calibration cache as the run started), warm = the later "
          "ones; 'runner' = building the AdaptiveRunner and its first run (bids, placement, compile, the race), "
          "'placer' = placer.candidates alone")
    print(f"{'model':<24}{'partitions':>11}  {'targets':<20}{'cold s':>8}{'runner s':>9}{'placer s':>9}"
          f"{'whole before':>14}{'whole after':>13}{'plan before':>13}{'plan after':>12}")
    for r in rows:
        print(f"{r['model']:<24}{r['partitions']:>11}  {r['plan targets']:<20}{_s(r['plan_cold_s']):>8}"
              f"{_s(r['plan_warm_s']):>9}{_s(r['place_warm_s']):>9}"
              f"{_pct(r['err_before']):>14}{_pct(r['err_after']):>13}"
              f"{_pct(r['plan_err_before']):>13}{_pct(r['plan_err_after']):>12}")
    for r in rows:
        for label, why in r["n/a"].items():
            print(f"n/a[{r['model']}] {label}: {why}")
        print(f"decision[{r['model']}]: {r['decision'] or '-'}")
        print(f"gate[{r['model']}]: {r['gate']}")
        print(f"replans[{r['model']}]: {r['replans']}")
        print(f"settling[{r['model']}]: warm-up runs per dspark process {r['settle runs']}"
              + ("" if r["settled"] else f" (some still exploring after {SETTLE_S:.0f} s)"))
        if not r["same plan every process"]:
            print(f"plans[{r['model']}]: the dspark processes did not all settle on the same plan")


def main() -> None:
    from models import MODELS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the contenders' processes")
    ap.add_argument("--runs", type=int, default=40, help="timed runs per process, after the warm-up")
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    ap.add_argument("--keep-cache", action="store_true",
                    help="reuse ~/.cache/dspark calibrations (default: a fresh cache, so every bid is "
                         "measured under this run's conditions)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--hints", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.models, args.child, Path(args.workdir), args.runs, json.loads(args.hints))
        return
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; have {', '.join(MODELS)}")
    if not args.keep_cache:  # inherited by the children: they share this run's calibrations
        os.environ["DSPARK_CACHE_DIR"] = tempfile.mkdtemp(prefix="dspark-bench-")
    workdir = Path(tempfile.mkdtemp(prefix="dspark-placement-"))
    rows = []
    for m in names:
        rows.append(bench_model(m, workdir, args.rounds, args.runs))
        print(f"{m}: ratio {rows[-1]['ratio']:.3f} ({rows[-1]['plan targets']})", flush=True)
    print_tables(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2, default=str) + "\n")
        print(f"rows written to {args.json}")


if __name__ == "__main__":
    main()
