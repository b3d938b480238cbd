"""``dspark.Session``: any model dspark loads, placed across the devices, run with ONNX Runtime's signature.

One call does what ``dspark run`` does in steps: import the model, probe the
devices, collect the plugins' bids, place the ops, race plans predicted within
the cost model's error of each other on the first run's inputs, and run on
the adaptive runner (:mod:`dspark.placement.adaptive`), which corrects the
cost model from measured runs, re-plans when a device fills up or another
plan becomes clearly faster, and plans around a partition whose plugin fails.
The plan committed is kept on disk per model fingerprint and device inventory
(:mod:`dspark.placement.adaptive.plan_store`), so a warm start compiles that plan
without bidding or planning again; a plan made while a plugin of the inventory
had failed as a whole (a timeout) is not kept, as that plugin may be back.

Thread safety: ``run`` may be called from any number of threads at once (as
``onnxruntime.InferenceSession.run`` may); runs on the same device are
serialised by the compiled plan, runs on different devices overlap, and a plan
swap lets runs in flight finish on the plan they started with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from dspark.graph.model import Graph
from dspark.host.inventory import Inventory, probe
from dspark.host.log import get_logger
from dspark.host.plugin_manager import PluginHost
from dspark.host.settings import PluginSettings
from dspark.placement.adaptive import AdaptiveRunner
from dspark.placement.plan import Plan
from dspark.placement.adaptive.plan_store import DiskPlanStore, PlanStore
from dspark.session.metadata import NodeArg

if TYPE_CHECKING:
    from dspark.placement.executor import CompiledPlan

log = get_logger("dspark.session")

Callback = Callable[[list[np.ndarray] | None, Any, str], None]


class SessionError(ValueError):
    """A call the model cannot take: an unknown input or output name, a missing input."""


class Session:
    """Plan, compile and run ``model`` on this machine's devices (see the module notes).

    ``model``: an ONNX file path or ``onnx.ModelProto``, a torch ``nn.Module`` or JAX function (with
    ``example_inputs``), a ``package.module:factory`` / ``file.py:factory`` spec, or a loaded
    :class:`~dspark.graph.Graph`. ``dynamic`` and ``dim_hints`` are :func:`dspark.graph.importers.load_model`'s.
    ``plugins``: the CLI's ``-p`` items (``"no:npu"`` blocks a plugin, ``"pkg.module"`` loads one);
    ``host``/``inventory`` reuse a loaded plugin host and its probe instead. ``plan_cache``: True keeps
    plans in the disk cache (``$DSPARK_CACHE_DIR``), False plans every start, or a :class:`PlanStore`.
    ``max_shapes``: how many input-size buckets keep a plan at once (sizes are bucketed by powers of
    two). ``async_workers``: threads serving :meth:`run_async`.
    """

    def __init__(self, model: Any, *, example_inputs: Any = None, dynamic: Any = None,
                 dim_hints: Mapping[str, int] | None = None, name: str | None = None,
                 plugins: Sequence[str] | None = None, host: PluginHost | None = None,
                 inventory: Inventory | None = None, plan_cache: bool | PlanStore = True,
                 max_shapes: int = 8, measure_close: bool = True, async_workers: int = 2) -> None:
        self.graph = model if isinstance(model, Graph) else _load(model, example_inputs, dynamic, dim_hints, name)
        self.host = host if host is not None else PluginHost(PluginSettings.from_env(list(plugins or ()))).load()
        self.inventory = inventory if inventory is not None else probe(self.host)
        store: PlanStore | None = DiskPlanStore() if plan_cache is True else (plan_cache or None)
        self._runner = AdaptiveRunner(self.graph, self.host, self.inventory, max_shapes=max_shapes,
                                      measure_close=measure_close, plans=store)
        self._inputs = [NodeArg.of(self.graph.tensors[n]) for n in self.graph.inputs]
        self._outputs = [NodeArg.of(self.graph.tensors[n]) for n in self.graph.outputs]
        self._input_names = frozenset(self.graph.inputs)
        self._output_names = list(self.graph.outputs)
        self._async_workers = async_workers
        self._pool: ThreadPoolExecutor | None = None
        log.info("session.ready", model=self.graph.name, plan_source=self.plan_source,
                 targets=sorted({p.target.key for p in self.plan.partitions}))

    # -- ONNX Runtime's surface ---------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options: Any = None,
            *, outputs: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """The outputs named (all, in the model's order, for None or ``[]``) for ``input_feed``.

        ``outputs`` maps output names to arrays of the result's shape and dtype that the results are
        written into and returned as (buffers reused across runs, where the caller wants them stable).
        ``run_options`` is accepted for ONNX Runtime's signature and ignored."""
        feed = input_feed if input_feed.keys() == self._input_names else self._check_feed(input_feed)
        results = self._runner.run(feed)  # type: ignore[arg-type]
        names = output_names or self._output_names
        try:
            arrays = [results[n] for n in names]
        except KeyError:
            raise SessionError(self._unknown_outputs(names)) from None
        if outputs:
            arrays = [self._into(n, a, outputs[n]) if n in outputs else a for n, a in zip(names, arrays)]
        return arrays

    def run_async(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                  callback: Callback | None = None, user_data: Any = None,
                  run_options: Any = None) -> Future[list[np.ndarray]]:
        """Run on a worker thread. ``callback(results, user_data, error)`` is called when it ends, as
        ONNX Runtime's ``run_async`` calls it (``results`` None and ``error`` the message on failure);
        the returned future holds the same results (or raises the failure)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._async_workers, thread_name_prefix="dspark-session")
        future = self._pool.submit(self.run, output_names, input_feed, run_options)
        if callback is not None:
            def done(f: Future[list[np.ndarray]]) -> None:
                exc = f.exception()
                callback(None if exc is not None else f.result(), user_data,
                         "" if exc is None else f"{type(exc).__name__}: {exc}")
            future.add_done_callback(done)
        return future

    # -- dspark's own ----------------------------------------------------------

    @property
    def plan(self) -> Plan:
        """The plan runs go on now (it changes when the runner re-plans)."""
        return self._runner.plan

    @property
    def plan_source(self) -> str:
        """"kept" when the start reused a plan kept on disk for this model and these devices, else "planned"."""
        return self._runner.plan_source

    @property
    def replans(self) -> list[str]:
        """Every plan change and why: races decided, re-plans, partitions planned around."""
        return list(self._runner.replans)

    @property
    def compiled(self) -> CompiledPlan:
        return self._runner.compiled

    @property
    def runner(self) -> AdaptiveRunner:
        return self._runner

    def close(self) -> None:
        """Finish async runs, then release every compiled plan."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._runner.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------

    def _check_feed(self, feed: Mapping[str, Any]) -> NoReturn:
        missing = [n for n in self.graph.inputs if n not in feed]
        unknown = [n for n in feed if n not in self._input_names]
        problems = ([f"missing input(s) {missing}"] if missing else []) + (
            [f"unknown input(s) {unknown}"] if unknown else [])
        raise SessionError(f"{self.graph.name}: {'; '.join(problems)}; the model's inputs are "
                           f"{[(a.name, a.shape, a.type) for a in self._inputs]}")

    def _unknown_outputs(self, names: Sequence[str]) -> str:
        unknown = [n for n in names if n not in self._output_names]
        return f"{self.graph.name}: unknown output(s) {unknown}; the model's outputs are {self._output_names}"

    @staticmethod
    def _into(name: str, result: np.ndarray, buffer: np.ndarray) -> np.ndarray:
        if buffer.shape != result.shape or buffer.dtype != result.dtype:
            raise SessionError(f"outputs[{name!r}]: a {buffer.dtype} buffer of shape {buffer.shape} cannot hold "
                               f"the {result.dtype} result of shape {result.shape}")
        np.copyto(buffer, result)
        return buffer


def _load(model: Any, example_inputs: Any, dynamic: Any, dim_hints: Mapping[str, int] | None,
          name: str | None) -> Graph:
    from dspark.graph.importers import load_model

    spec = str(model) if isinstance(model, Path) else model
    return load_model(spec, example_inputs=example_inputs, dynamic=dynamic, dim_hints=dim_hints, name=name)
