"""ONNX's own backend node tests, run through one dspark plugin the way a user runs a model.

The ONNX project writes a test for every op at every opset that changed it
(``onnx.backend.test.case.node``: 1,884 models of one op, or of its function
expanded, with inputs and expected outputs). This module builds them from the installed ``onnx``
package (the wheel ships the generators, not the data files) and takes each
one down the user's path: the model is saved to a file and read back with
:func:`dspark.graph.importers.load_model`; the plugin's ``dspark_bid`` on the
whole graph decides whether it abstains or promises; a promise becomes a plan
forcing every op onto that plugin's device, compiled with
:func:`~dspark.placement.executor.compile_plan` and run with its ``run``, and
the outputs are checked against ONNX's expected ones.

Outcomes per case: ``abstain`` (no bid: fine), ``pass``, ``wrong`` (outputs
differ), ``failed`` (bid, then the bid, compile or run raised or compile
returned None) and ``unsupported`` (dspark's graph model cannot represent the
case: string or sequence tensors, control flow, ...; no plugin was asked).

Cases whose expected outputs are random draws are left out (see
:data:`RANDOM_OPS` and :data:`RANDOM_CASES`): no runtime can reproduce them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx

from dspark.graph.model import Graph
from dspark.host.inventory import Inventory, probe
from dspark.host.plugin_manager import PluginHost, _call_with_timeout
from dspark.testing.compare import compare
from dspark.testing.kit import ConformanceKit
from dspark.types import TOLERANCES, Bid, Device

# Ops whose outputs are draws from a random generator: any output is right.
RANDOM_OPS: frozenset[str] = frozenset({
    "Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
})
# Dropout in training mode with a non-zero ratio draws its mask at random.
RANDOM_CASES: frozenset[str] = frozenset({
    "test_training_dropout", "test_training_dropout_default", "test_training_dropout_default_mask",
    "test_training_dropout_mask",
})
OUTCOMES = ("pass", "abstain", "wrong", "failed", "unsupported")
_SEED = 0  # the generators draw inputs from numpy's global RNG; seeded, every run sees the same data


class PluginNotTestable(RuntimeError):
    """The plugin cannot be run here (not loaded, failed, or no hardware); the message says why."""


@dataclass(frozen=True)
class NodeCase:
    """One ONNX node test: a model, its input arrays and ONNX's expected outputs."""

    name: str
    model: onnx.ModelProto = field(repr=False)
    inputs: list[object] = field(repr=False)  # numpy arrays, or lists for sequence inputs
    outputs: list[object] = field(repr=False)
    rtol: float = 1e-3
    atol: float = 1e-7

    @property
    def op_types(self) -> frozenset[str]:
        return frozenset(n.op_type for n in self.model.graph.node)

    @property
    def opset(self) -> int:
        return next((o.version for o in self.model.opset_import if o.domain in ("", "ai.onnx")), 0)


@dataclass(frozen=True)
class CaseResult:
    """What one plugin did with one node case."""

    case: str
    op_types: tuple[str, ...]
    outcome: str  # one of OUTCOMES
    detail: str = ""
    device: str = ""
    plugin: str = ""

    @property
    def ok(self) -> bool:
        """An abstention, a pass or a case the graph model cannot hold: no broken promise."""
        return self.outcome not in ("wrong", "failed")


def is_random(case_name: str, op_types: Iterable[str]) -> bool:
    """True for a case whose expected outputs are random draws (left out of the suite)."""
    return case_name in RANDOM_CASES or bool(RANDOM_OPS & set(op_types))


@functools.lru_cache(maxsize=1)
def _all_cases() -> tuple[NodeCase, ...]:
    # Generating takes seconds (every expected output is computed); each test process
    # sharing a cache directory loads them from the one file the first one wrote.
    from dspark.host.cache import cache_dir

    path = cache_dir() / "onnx_node" / f"cases2-onnx{onnx.__version__}-numpy{np.__version__}-seed{_SEED}.pickle"
    try:
        with path.open("rb") as f:
            cached = pickle.load(f)  # noqa: S301  (written by _generate below, in the user's own cache)
        if isinstance(cached, tuple) and all(isinstance(c, NodeCase) for c in cached):
            return cached
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError):
        pass
    cases = _generate()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            pickle.dump(cases, f, protocol=pickle.HIGHEST_PROTOCOL)
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache only costs the next process the generation
    return cases


def _generate() -> tuple[NodeCase, ...]:
    from onnx.backend.test.case import node

    state = np.random.get_state()
    np.random.seed(_SEED)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            collected = node.collect_testcases(None)
    finally:
        np.random.set_state(state)
    cases = []
    for tc in collected:
        if tc.model is None or not tc.data_sets:
            continue
        inputs, outputs = tc.data_sets[0]
        cases.append(NodeCase(name=tc.name, model=tc.model, inputs=[_array(v) for v in inputs],
                              outputs=[_array(v) for v in outputs],
                              rtol=float(tc.rtol), atol=float(tc.atol)))
    return tuple(sorted(cases, key=lambda c: c.name))


def _array(value: object) -> object:
    # Generators store some tensors as TensorProto (bfloat16, float8, 4-bit): arrays. Numpy scalars
    # (a Clip bound, a window's size) stay scalars: a user feeds them so, and the plan must take them.
    if isinstance(value, onnx.TensorProto):
        return onnx.numpy_helper.to_array(value)
    return value


def node_cases(op_types: Iterable[str] | None = None, *, include_random: bool = False,
               names: Iterable[str] | None = None) -> list[NodeCase]:
    """ONNX's node test cases, by name; only those using one of ``op_types`` when given.

    Built from the installed ``onnx`` (seconds) once per cache directory, then loaded.
    """
    wanted = set(op_types) if op_types is not None else None
    chosen = set(names) if names is not None else None
    return [c for c in _all_cases()
            if (include_random or not is_random(c.name, c.op_types))
            and (wanted is None or c.op_types & wanted)
            and (chosen is None or c.name in chosen)]


_IMPORTED: dict[str, tuple[Graph | None, str]] = {}


def import_case(case: NodeCase) -> tuple[Graph | None, str]:
    """(graph, "") when dspark's importer represents the case whole; (None, why) when it cannot.

    The model is saved to a file and loaded with :func:`~dspark.graph.importers.load_model`,
    as a user loads one. Cached per case: every plugin run in a process sees the same graph.
    """
    if case.name not in _IMPORTED:
        _IMPORTED[case.name] = _import(case)
    return _IMPORTED[case.name]


def _import(case: NodeCase) -> tuple[Graph | None, str]:
    from dspark.graph.importers import load_model

    try:
        with tempfile.TemporaryDirectory(prefix="dspark-node-") as tmp:
            path = os.path.join(tmp, f"{case.name}.onnx")
            onnx.save(case.model, path)
            graph = load_model(path, name=case.name)
    except Exception as exc:  # noqa: BLE001  (the importer's verdict: the graph model cannot hold it)
        return None, f"{type(exc).__name__}: {exc}"
    if not graph.ops:
        return None, "the model has no ops"
    values = list(zip(graph.inputs, case.inputs, strict=False)) + list(zip(graph.outputs, case.outputs, strict=False))
    for name, value in values:
        if not isinstance(value, (np.ndarray, np.generic)):
            return None, f"tensor {name!r} is a {type(value).__name__} (sequence/optional), not a tensor"
        if name not in graph.tensors:
            return None, f"tensor {name!r} has a type dspark's graph model cannot represent ({value.dtype})"
    if len(graph.inputs) != len(case.inputs) or len(graph.outputs) != len(case.outputs):
        return None, (f"{len(graph.inputs)} graph inputs / {len(graph.outputs)} outputs for "
                      f"{len(case.inputs)} / {len(case.outputs)} test arrays")
    return graph, ""


@contextlib.contextmanager
def _no_calibration() -> Iterator[None]:
    # A bid here only decides abstain or promise; timing 1,884 subgraphs would add minutes.
    old = os.environ.get("DSPARK_CALIBRATE")
    os.environ["DSPARK_CALIBRATE"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DSPARK_CALIBRATE", None)
        else:
            os.environ["DSPARK_CALIBRATE"] = old


def _tolerance(precision: str, case: NodeCase, expected: Iterable[np.ndarray]) -> tuple[float, float]:
    # The loosest of: the bid precision's tolerance, ONNX's own for the case (its
    # expected values are often computed in float64 and rounded once), and that of
    # a 16-bit float output's own type (an output cannot be more exact than its type).
    candidates = [TOLERANCES.get(precision, (0.0, 0.0)), (case.rtol, case.atol)]
    candidates += [TOLERANCES[a.dtype.name] for a in expected if a.dtype.name in ("float16", "bfloat16")]
    return max(c[0] for c in candidates), max(c[1] for c in candidates)


class NodeSuiteRunner:
    """Runs node cases through one plugin on one of its devices, under the kit's fault isolation.

    Raises :class:`PluginNotTestable` when the plugin cannot run here.
    """

    def __init__(self, plugin: str, host: PluginHost | None = None, device: str | None = None,
                 kit: ConformanceKit | None = None) -> None:
        self.plugin = plugin
        self.kit = kit if kit is not None else ConformanceKit(plugin, host)
        problems = [r.detail for r in self.kit.check_probe() if not r.ok]
        if self.kit.not_testable or not self.kit.devices:
            why = "; ".join(problems) or self.kit.not_testable or "it reports no device"
            raise PluginNotTestable(f"plugin {plugin!r} cannot run ONNX node tests here: {why}")
        pick = [d for d in self.kit.devices if device is None or d.id == device]
        if not pick:
            raise PluginNotTestable(f"plugin {plugin!r} has no device {device!r} "
                                    f"(devices: {[d.id for d in self.kit.devices]})")
        self.device: Device = pick[0]
        self._bids: dict[str, tuple[Bid | None, str | None]] = {}
        self._inv: Inventory | None = None

    @property
    def inventory(self) -> Inventory:
        """The host's inventory, as ``dspark.host.inventory.probe`` gives it to a user's plan."""
        if self._inv is None:
            self._inv = probe(self.kit.host)
        return self._inv

    def _result(self, case: NodeCase, outcome: str, detail: str = "") -> CaseResult:
        return CaseResult(case.name, tuple(sorted(case.op_types)), outcome, detail, self.device.id, self.plugin)

    def _bid(self, case: NodeCase, graph: Graph) -> tuple[Bid | None, str | None]:
        if case.name not in self._bids:
            with _no_calibration():
                self._bids[case.name] = self.kit.call("dspark_bid", subgraph=graph.subgraph(), device=self.device)
        return self._bids[case.name]

    def bid_case(self, case: NodeCase) -> CaseResult | None:
        """None when the plugin bids on ``case`` (a promise); else its unsupported / abstain / failed result."""
        graph, why = import_case(case)
        if graph is None:
            return self._result(case, "unsupported", why)
        bid, problem = self._bid(case, graph)
        if problem:
            return self._result(case, "failed", f"bid raised: {problem}")
        return self._result(case, "abstain") if bid is None else None

    def run_case(self, case: NodeCase) -> CaseResult:
        """Bid on the whole graph; on a bid, plan every op onto the plugin's device, compile the plan,
        run it and compare with ONNX's expected outputs (the user's path: ``compile_plan(...).run``)."""
        from dspark.placement.executor import compile_plan, forced_plan

        if (answer := self.bid_case(case)) is not None:
            return answer
        graph, _ = import_case(case)
        assert graph is not None
        bid, _ = self._bid(case, graph)
        assert bid is not None
        key = f"{self.plugin}@{self.device.id}"
        # As the generators give them: arrays copied (a plugin may write into its inputs), numpy scalars as they are.
        feeds = {n: v.copy() if isinstance(v, np.ndarray) else v
                 for n, v in zip(graph.inputs, case.inputs, strict=True)}
        timeout = self.kit.host.settings.timeout_for("dspark_compile")
        try:
            plan = forced_plan(graph, self.inventory, lambda _op: key)
            compiled = compile_plan(graph, plan, self.kit.host, self.inventory)
        except Exception as exc:  # noqa: BLE001  (anything on the user's path is the finding)
            self.kit.forgive()
            return self._result(case, "failed", f"compile raised {type(exc).__name__}: {exc}"[:500])
        try:
            got = _call_with_timeout(compiled.run, [feeds], timeout, f"{self.plugin}.run")
        except Exception as exc:  # noqa: BLE001
            self.kit.forgive()
            return self._result(case, "failed", f"run raised {type(exc).__name__}: {exc}"[:500])
        expected = {n: np.asarray(v) for n, v in zip(graph.outputs, case.outputs, strict=True)}
        ok, detail = compare(got, expected, list(graph.outputs), bid.precision,
                             tolerance=_tolerance(bid.precision, case, expected.values()))
        return self._result(case, "pass" if ok else "wrong", detail)


def run_node_suite(plugin_name: str, *, op_types: Iterable[str] | None = None, host: PluginHost | None = None,
                   device: str | None = None, names: Iterable[str] | None = None,
                   time_budget_s: float | None = None) -> list[CaseResult]:
    """Every (non-random) ONNX node case, or those using ``op_types``, through plugin ``plugin_name``.

    ``device`` picks one of the plugin's devices (default: the first it
    reports; :class:`PluginNotTestable` when it cannot run here). With
    ``time_budget_s``, cases stop being started once the budget is spent
    (the results cover the cases run so far).
    """
    runner = NodeSuiteRunner(plugin_name, host, device)
    start = time.perf_counter()
    results = []
    for case in node_cases(op_types, names=names):
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
        results.append(runner.run_case(case))
    return results


def counts(results: Iterable[CaseResult]) -> dict[str, int]:
    """Cases per outcome, every outcome present."""
    seen = Counter(r.outcome for r in results)
    return {o: seen.get(o, 0) for o in OUTCOMES}


def broken_promises(results: Iterable[CaseResult]) -> list[CaseResult]:
    """The wrong and failed cases."""
    return [r for r in results if not r.ok]
