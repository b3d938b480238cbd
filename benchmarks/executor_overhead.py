"""The executor's per-run overhead: a one-partition plan against its plugin's executable alone.

Usage: .venv/bin/python benchmarks/executor_overhead.py [--models demo,vit-tiny,llama-prefill-128] [--runs 400]

For each model, an adaptive runner on one target (OpenVINO CPU by default,
``--target``), then, in interleaved blocks (first run of each block dropped),
medians of, all on the runner's own compiled model:
 - the plugin's executable called directly;
 - a control: the executable, then a 15 us busy wait (shows the noise);
 - ``CompiledPlan.run`` (the executor);
 - ``AdaptiveRunner.run`` (the executor plus the cost model's online correction).
Target (issue 21): the adaptive runner within 2% or 20 us of the executable.
Then ``dspark.Session.run`` (issue 36: within 2% or 20 us), given the target's plugin alone so that its
plan is one partition there, against that partition's executable called directly, interleaved alike.

Then the overhead itemised, twice, in microseconds per run:
 - warm: with a null executable (returns its outputs without computing), so
   that only dspark's own work is timed, back to back, with warm caches:
   input dtype/layout checks, the locked call with its clock reads and spans,
   calibration's feedback (observe_run), the adaptive runner's learning;
 - cold: with an evicting executable (copies ``EVICT_MB`` between runs, as a
   runtime's compute evicts the core's caches), each piece as the median of
   its difference from the evicting executable alone in the same round: the
   lean run (``CompiledPlan.run``), the adaptive runner's run not learned
   from, a run learned from, and a run that feeds calibration.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _graph(name: str) -> tuple[Any, dict[str, np.ndarray]]:
    from dspark.placement.executor import random_inputs

    if name == "demo":
        from dspark.cli.demo import demo_graph

        graph = demo_graph()
        return graph, random_inputs(graph, seed=1)
    from models import load_graph

    return load_graph(name)


CONTROL_US = 15  # the control: the executable, then this long a busy wait (dspark's own work, roughly)


def _spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class _Null:
    """An executable that hands back the outputs it was given once: dspark's own work, timed alone."""

    def __init__(self, outputs: dict[str, np.ndarray]) -> None:
        self.outputs = outputs

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.outputs


EVICT_MB = 16  # more than a core's L2 here (4 MiB), as a model's weights and activations are


class _Evicting(_Null):
    """A null executable that first copies ``EVICT_MB``: Python after it runs with cold caches, as after a
    runtime's compute, without the runtime's noise."""

    def __init__(self, outputs: dict[str, np.ndarray]) -> None:
        super().__init__(outputs)
        self.src = np.ones(EVICT_MB << 20, np.uint8)
        self.dst = np.empty_like(self.src)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        np.copyto(self.dst, self.src)
        return {k: v.copy() for k, v in self.outputs.items()}


def paired(fns: dict[str, Callable[[], object]], base: str, rounds: int) -> dict[str, float]:
    """Per contender, the median over rounds of its time minus ``base``'s in the same round (us); one call
    each per round, in a shuffled order."""
    diffs: dict[str, list[float]] = {k: [] for k in fns if k != base}
    rng, order = random.Random(1), list(fns)
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        rng.shuffle(order)
        took = {}
        for k in order:
            t = time.perf_counter()
            fns[k]()
            took[k] = time.perf_counter() - t
        for k in diffs:
            diffs[k].append((took[k] - took[base]) * 1e6)
    return {k: statistics.median(v) for k, v in diffs.items()}


def interleaved(fns: dict[str, Callable[[], object]], runs: int, block: int = 8) -> dict[str, float]:
    """Medians in us; blocks of ``block`` runs (after one untimed), in a shuffled order each round so that
    no contender always follows the same one."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    rng, order = random.Random(0), list(fns)
    for _ in range(max(1, runs // block)):
        rng.shuffle(order)
        for k in order:
            fn = fns[k]
            fn()
            for _ in range(block):
                t = time.perf_counter()
                fn()
                samples[k].append((time.perf_counter() - t) * 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


def bench(name: str, target: str, runs: int) -> dict[str, Any]:
    from dspark.host.inventory import probe
    from dspark.host.plugin_manager import PluginHost
    from dspark.placement.adaptive import AdaptiveRunner

    graph, feeds = _graph(name)
    host = PluginHost().load()
    inv = probe(host)
    # The adaptive runner on one target (its table holds that target's bids only); the executor and
    # the executable timed are the runner's own, so all three run the very same compiled model.
    # No re-plan checks: a background re-plan would compete for the cores being timed (its cost is
    # the placement benchmark's to show), and with one target there is nothing to re-plan to.
    runner = AdaptiveRunner(graph, host, inv, table=_only(host, inv, graph, target), measure_close=False,
                            min_runs=10**9)
    for _ in range(20):
        runner.run(feeds)
    runner.settle()
    compiled = runner.compiled
    plan = compiled.plan
    pid = plan.partitions[0].id
    exe = compiled.executables[pid]
    sub_in = compiled._io[pid][0]
    direct = {k: np.ascontiguousarray(feeds[k]) for k in sub_in}
    row: dict[str, Any] = {"model": name, "ops": len(graph.ops), "target": target}
    row.update(interleaved({"executable_us": lambda: exe.run(direct),
                             "control_us": lambda: (exe.run(direct), _spin(CONTROL_US)),
                             "compiled_plan_us": lambda: compiled.run(feeds),
                             "adaptive_us": lambda: runner.run(feeds)}, runs))
    row["compiled_over_us"] = row["compiled_plan_us"] - row["executable_us"]
    row["adaptive_over_us"] = row["adaptive_us"] - row["executable_us"]
    row["adaptive_ratio"] = row["adaptive_us"] / row["executable_us"]
    # Itemised, on a null executable; what calibration feedback sees of it stays out of the user's cache.
    with tempfile.TemporaryDirectory(prefix="dspark-overhead-") as tmp, \
            mock.patch.dict(os.environ, {"DSPARK_CACHE_DIR": tmp}):
        _itemise(row, compiled, runner, graph, exe, pid, direct, feeds, runs)
    runner.close()
    row.update(_session(graph, feeds, target, runs))
    return row


def _session(graph: Any, feeds: dict[str, np.ndarray], target: str, runs: int) -> dict[str, Any]:
    """``dspark.Session.run`` against its own plan's executable, the Session given the target's plugin alone
    (so its plan is one partition there: the best single runtime when that is the target)."""
    from dspark.host.plugin_manager import PluginHost
    from dspark.host.settings import PluginSettings
    from dspark.session import Session

    plugin = target.split("@")[0]
    host = PluginHost(PluginSettings(allowed={plugin})).load()
    with Session(graph, host=host, plan_cache=False, measure_close=False) as session:
        plan = session.plan
        if len(plan.partitions) != 1:
            return {"session_note": f"the session's plan has {len(plan.partitions)} partitions: not timed"}
        for _ in range(20):
            session.run(None, feeds)
        compiled = session.compiled
        pid = plan.partitions[0].id
        exe = compiled.executables[pid]
        direct = {k: np.ascontiguousarray(feeds[k]) for k in compiled._io[pid][0]}
        times = interleaved({"session_executable_us": lambda: exe.run(direct),
                             "session_us": lambda: session.run(None, feeds)}, runs)
    times["session_over_us"] = times["session_us"] - times["session_executable_us"]
    times["session_ratio"] = times["session_us"] / times["session_executable_us"]
    return times


def _itemise(row: dict[str, Any], compiled: Any, runner: Any, graph: Any, exe: Any, pid: int,
             direct: dict[str, np.ndarray], feeds: dict[str, np.ndarray], runs: int) -> None:
    from dspark.placement import executor
    from dspark.sdk.calibration import observe_run

    outputs = exe.run(direct)
    null = _Null({k: np.asarray(v) for k, v in outputs.items()})
    compiled.executables[pid] = null
    spans: dict[int, executor.Span] = {}
    env = dict(feeds)
    pieces = interleaved({
        "inputs_checked": lambda: {n: executor._conform(feeds[n], compiled._dtype[n]) for n in graph.inputs},
        "locked_call_and_span": lambda: compiled._run_one(pid, env, spans),
        "compiled_plan_total": lambda: compiled.run(feeds),
        "observe_run": lambda: observe_run(compiled, compiled.last_spans, env),
        "adaptive_total": lambda: runner.run(feeds),
    }, runs * 10)
    pieces["adaptive_learning"] = pieces["adaptive_total"] - pieces["compiled_plan_total"]
    pieces["observe_run_amortised"] = pieces["observe_run"] / executor.OBSERVE_EVERY
    row["itemised_us"] = {k: round(v, 2) for k, v in pieces.items()}
    row["cold_us"] = {k: round(v, 1) for k, v in _cold(compiled, runner, pid, null.outputs, direct, feeds,
                                                         runs).items()}


def _cold(compiled: Any, runner: Any, pid: int, outputs: dict[str, np.ndarray], direct: dict[str, np.ndarray],
          feeds: dict[str, np.ndarray], runs: int) -> dict[str, float]:
    """The pieces after an evicting executable (see the module notes), paired with it alone."""
    from dspark.placement import adaptive, executor

    evict = _Evicting(outputs)
    compiled.executables[pid] = evict
    base = {"executable": lambda: evict.run(direct)}
    never = 10**9
    with mock.patch.object(adaptive, "LEARN_EVERY", never), mock.patch.object(executor, "OBSERVE_EVERY", never):
        out = paired({**base, "lean_run": lambda: compiled.run(feeds),
                      "adaptive_not_learned": lambda: runner.run(feeds)}, "executable", runs)
    with mock.patch.object(adaptive, "LEARN_EVERY", 1), mock.patch.object(executor, "OBSERVE_EVERY", never):
        out |= paired({**base, "adaptive_learned": lambda: runner.run(feeds)}, "executable", runs)
    with mock.patch.object(executor, "OBSERVE_EVERY", 1):
        out |= paired({**base, "lean_run_with_calibration": lambda: compiled.run(feeds)}, "executable", runs)
    out["adaptive_as_shipped"] = paired({**base, "run": lambda: runner.run(feeds)}, "executable", runs)["run"]
    out["learned_extra_amortised"] = (out["adaptive_learned"] - out["adaptive_not_learned"]) / adaptive.LEARN_EVERY
    out["calibration_extra_amortised"] = (out["lean_run_with_calibration"] - out["lean_run"]) / executor.OBSERVE_EVERY
    return out


def _only(host: Any, inv: Any, graph: Any, target: str) -> Any:
    from dspark.placement import placer

    table = placer.collect_op_bids(host, inv, graph, targets=[d for d in inv.drivers()
                                                              if f"{d.plugin}@{d.id}" == target])
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="demo,vit-tiny,llama-prefill-128")
    ap.add_argument("--target", default="cpu@cpu", help="plugin@device the one partition runs on")
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [bench(m, args.target, args.runs) for m in args.models.split(",")]
    print(f"\n{'model':<20}{'ops':>5}{'executable us':>15}{'control us':>12}{'plan us':>10}{'adaptive us':>13}"
          f"{'overhead us':>13}{'ratio':>8}")
    for r in rows:
        print(f"{r['model']:<20}{r['ops']:>5}{r['executable_us']:>15.1f}{r['control_us']:>12.1f}"
              f"{r['compiled_plan_us']:>10.1f}{r['adaptive_us']:>13.1f}{r['adaptive_over_us']:>13.1f}"
              f"{r['adaptive_ratio']:>8.3f}")
    print(f"\n{'model':<20}{'executable us':>15}{'dspark.Session us':>19}{'overhead us':>13}{'ratio':>8}")
    for r in rows:
        if "session_us" in r:
            print(f"{r['model']:<20}{r['session_executable_us']:>15.1f}{r['session_us']:>19.1f}"
                  f"{r['session_over_us']:>13.1f}{r['session_ratio']:>8.3f}")
        else:
            print(f"{r['model']:<20}{r['session_note']}")
    print(f"control: the executable, then a {CONTROL_US} us busy wait; its distance from 'executable' beyond "
          f"{CONTROL_US} us is this machine's noise between interleaved blocks")
    print("\nitemised, us per run (null executable, warm caches):")
    for r in rows:
        print(f"  {r['model']}: " + ", ".join(f"{k} {v}" for k, v in r["itemised_us"].items()))
    print(f"\nitemised, us per run over an executable that evicts the caches ({EVICT_MB} MiB copied), paired:")
    for r in rows:
        print(f"  {r['model']}: " + ", ".join(f"{k} {v}" for k, v in r["cold_us"].items()))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
