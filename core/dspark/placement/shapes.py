"""Input shapes a run brings, the shape bucket they fall in, and one plan per bucket.

A graph with symbolic dims (``TensorSpec`` dims that are ``str``) is bid,
calibrated and placed at ``Graph.dim_hints``: one representative size per
dim. A run at other sizes deserves a plan priced at those sizes, so:

* :func:`bind_dims` reads the symbolic dims' values off the input arrays and
  raises :class:`ShapeMismatch` where the arrays contradict the graph;
* :func:`bucket` turns those values into a hashable key, the shape bucket;
* :func:`at_dims` makes the graph to re-bid and re-plan a bucket with (same
  ops and weights, hints and op costs at the bucket's sizes);
* :class:`ShapePlans` keeps the few most recently used buckets' plans (or
  runners), building each at most once.

Bucketing rests on a measured fact: the executables the plugins compile for
a subgraph with symbolic dims accept inputs at *any* size of those dims, so
a plan need not be compiled per exact size. ``Subgraph.to_onnx()`` keeps the
symbolic dims as ONNX ``dim_param``; compiled on each plugin's ``cpu``
device, a ``MatMul -> Add -> Relu`` graph with input ``("batch", 4)``,
hinted at batch 2, ran at batch 1, 3 and 8 with outputs of the run's batch
that match numpy (tests/placement/test_shapes.py keeps that check):

* cpu (OpenVINO 2026.4 ``OpenVINOExecutable``): accepted, the model is read
  with dynamic dims and never reshaped;
* npu (ONNX Runtime 1.31 ``OrtExecutable``, CPUExecutionProvider): accepted;
* torch reference (``TorchExecutable``, and ``LinearExecutable`` for a
  one-MatMul subgraph): accepted, it runs torch ops eagerly. The cuda
  plugin's float executable wraps the same reference executor.

The same held for a torch module exported with ``dynamic={"x": {0:
"batch"}}`` (``Reshape -> Gemm -> Relu``), whole and split per op. So a
bucket rounds each size up to the next power of two and the plan is made at
that upper size (costs grow with size, so the plan is priced for the worst
run it serves); the runs themselves go at their own sizes, unpadded. A
device that compiles static shapes only (OpenVINO's NPU) does not bid on a
subgraph with symbolic boundary tensors in the first place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from dspark.graph.elements import Dim, TensorSpec
from dspark.graph.flops import annotate_costs
from dspark.graph.model import Graph
from dspark.host.log import get_logger

__all__ = ["BucketKey", "ShapeMismatch", "ShapePlans", "ShapeRouter", "at_dims", "bind_dims", "bucket"]

log = get_logger("dspark.placement.shapes")

BucketKey = tuple[tuple[str, int], ...]  # sorted (dim name, size the bucket's plan is made for)
T = TypeVar("T")
DEFAULT_MAX_ENTRIES = 8


class ShapeMismatch(ValueError):
    """An input array's shape contradicts the graph: rank, a static dim, or a symbolic dim seen twice.

    ``input`` names the graph input, ``dim`` the axis (None for a rank
    mismatch), ``declared`` what the graph says there (an int, a dim name, or
    the whole declared shape for a rank mismatch) and ``given`` what the array
    has. Dtypes are not checked here.
    """

    def __init__(self, input: str, dim: int | None, declared: Any, given: Any, detail: str = "") -> None:
        self.input, self.dim, self.declared, self.given = input, dim, declared, given
        where = f"input {input!r}" if dim is None else f"input {input!r} dim {dim}"
        super().__init__(f"{where}: the graph declares {declared!r}, got {given!r}" + (f" ({detail})" if detail else ""))


def _is_name(d: Dim) -> bool:
    """A plain symbolic dim (``batch``), as opposed to an expression of others (``2*batch``)."""
    return isinstance(d, str) and d.isidentifier()


def _evaluate(expr: str, values: Mapping[str, int]) -> int | None:
    """The size of dim expression ``expr`` given ``values``; None when it names an unknown dim."""
    # onnx_io imports onnx; only graphs with expression dims need its (ast-based, eval-free) parser.
    from dspark.graph.onnx_io import derive_dim_hints

    probe = {"_": TensorSpec(name="_", dtype="float32", shape=(expr,))}
    return derive_dim_hints(probe, dict(values)).get(expr)


def _shape_of(value: Any) -> tuple[int, ...]:
    shape = getattr(value, "shape", None)  # numpy, and torch tensors, without a copy
    return tuple(int(n) for n in (shape if shape is not None else np.shape(value)))


def bind_dims(graph: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The sizes of ``graph``'s symbolic input dims, read off the arrays in ``inputs``.

    Raises :class:`ShapeMismatch` when an array's rank differs from the
    declared one, a static dim differs, one symbolic dim gets two sizes, or an
    expression dim (``2*batch``) disagrees with the sizes bound elsewhere.
    Inputs missing from ``inputs`` are skipped (the executor names those);
    dtypes are not looked at.
    """
    bound: dict[str, int] = {}
    seen_at: dict[str, tuple[str, int]] = {}  # dim name -> (input, axis) it was first read from
    expressions: list[tuple[str, int, str, int]] = []
    for name in graph.inputs:
        spec = graph.tensors.get(name)
        if name not in inputs or spec is None or not spec.rank_known:
            continue
        given = _shape_of(inputs[name])
        if len(given) != len(spec.shape):
            raise ShapeMismatch(name, None, spec.shape, given,
                                f"rank {len(spec.shape)} declared, the array has rank {len(given)}")
        for axis, (declared, size) in enumerate(zip(spec.shape, given, strict=True)):
            if isinstance(declared, int):
                if declared != size:
                    raise ShapeMismatch(name, axis, declared, size, f"input shape {given}")
            elif not _is_name(declared):
                expressions.append((name, axis, declared, size))  # checked once every name is bound
            elif declared in bound and bound[declared] != size:
                first, first_axis = seen_at[declared]
                raise ShapeMismatch(name, axis, declared, size, f"input {first!r} dim {first_axis} "
                                    f"gave {declared!r} = {bound[declared]}")
            else:
                bound[declared] = size
                seen_at.setdefault(declared, (name, axis))
    for name, axis, expr, size in expressions:
        value = _evaluate(expr, bound)
        if value is not None and value != size:
            raise ShapeMismatch(name, axis, expr, size, f"{expr} = {value} with {_describe(bound)}")
    return bound


def _describe(values: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(values.items()))


def _ceil_pow2(n: int) -> int:
    return n if n < 1 else 1 << (n - 1).bit_length()


def bucket(dims: Mapping[str, int], hints: Mapping[str, int]) -> BucketKey:
    """The shape bucket of a run with symbolic dims ``dims`` (from :func:`bind_dims`).

    Each size is rounded up to the next power of two (the executables accept
    any size, see the module docs); a size equal to its hint stays as it is,
    so runs at the graph's own hints share the plan made for them even when
    a hint is no power of two. Sorted by dim name: equal keys for equal sizes,
    whatever order the inputs came in.
    """
    return tuple(sorted((name, size if hints.get(name) == size else _ceil_pow2(size)) for name, size in dims.items()))


def at_dims(graph: Graph, dims: Mapping[str, int]) -> Graph:
    """``graph`` with ``dim_hints`` at ``dims``, op costs re-annotated; weights shared, not copied.

    Hints of expression dims (``2*batch``) and of the dims ONNX inference
    could not name at import (``unk__3``: the rows of a ``Reshape`` to
    ``[-1, 64]``, say) are derived again from the new sizes, by the same
    pinned inference pass the import runs; a hint that pass cannot size keeps
    its old value. Ops are copied because their cost fields are rewritten;
    tensor specs and initializer arrays are the same objects.
    """
    # Not graph.model_copy(update=...): it also copies the cached properties
    # (op index, producers, consumers), which would point at the old ops.
    from dspark.graph.onnx_io import rederive_dim_hints  # imports onnx, see _evaluate

    inputs = {d for name in graph.inputs if (spec := graph.tensors.get(name)) for d in spec.shape if _is_name(d)}
    given = {k: v for k, v in graph.dim_hints.items() if k in inputs and k not in dims}
    given.update({k: int(v) for k, v in dims.items()})
    hints = rederive_dim_hints(graph.ops, list(graph.inputs), list(graph.outputs), tensors=graph.tensors,
                               initializers=graph.initializers, opset=graph.opset, hints=given)
    hints = {**{k: v for k, v in graph.dim_hints.items() if k not in hints}, **hints}  # what no pass re-sized
    new = Graph(name=graph.name, opset=graph.opset, ops=[op.model_copy() for op in graph.ops],
                tensors=graph.tensors, inputs=list(graph.inputs), outputs=list(graph.outputs),
                initializers=graph.initializers, dim_hints=hints)
    annotate_costs(new)
    return new


@dataclass
class _Pending(Generic[T]):
    """A bucket being built: waiters block on ``done`` and take the value or the error."""

    done: threading.Event = field(default_factory=threading.Event)
    value: T | None = None
    error: BaseException | None = None


class ShapePlans(Generic[T]):
    """A thread-safe LRU of per-bucket values (plans, compiled plans, runners), building each once.

    ``get_or_build`` runs ``build`` outside the lock, so building one bucket
    (bids, placement, compile: seconds) blocks neither lookups nor other
    buckets' builds; a second caller asking for a bucket being built waits
    for that build and gets its value (or its exception). Past
    ``max_entries`` the least recently used entry goes and ``on_evict(key,
    value)`` is called, outside the lock, so it may close a runner; a run
    still in flight on it is the callback's concern (close after the run, or
    let garbage collection have it).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 on_evict: Callable[[BucketKey, T], None] | None = None) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self.on_evict = on_evict
        self._entries: OrderedDict[BucketKey, T] = OrderedDict()
        self._pending: dict[BucketKey, _Pending[T]] = {}
        self._lock = threading.Lock()

    def get(self, key: BucketKey) -> T | None:
        """The value for ``key`` (now the most recently used), or None."""
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
            return self._entries[key]

    def get_or_build(self, key: BucketKey, build: Callable[[], T]) -> T:
        """The value for ``key``, built with ``build()`` the first time (once, whoever asks)."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            pending = self._pending.get(key)
            owner = pending is None
            if pending is None:
                pending = self._pending[key] = _Pending()
        if not owner:
            pending.done.wait()
            if pending.error is not None:
                raise pending.error
            return pending.value  # type: ignore[return-value]  # set whenever error is None
        try:
            value = build()
        except BaseException as exc:
            pending.error = exc
            with self._lock:
                del self._pending[key]  # not cached: the next caller tries again
            pending.done.set()
            raise
        pending.value = value
        evicted = self._insert(key, value, pending)
        pending.done.set()
        self._evict(evicted)
        return value

    def put(self, key: BucketKey, value: T) -> None:
        """Store ``value`` for ``key`` (e.g. the plan a runner starts with); a replaced value is evicted."""
        self._evict(self._insert(key, value, None))

    def keys(self) -> list[BucketKey]:
        """The cached buckets, least recently used first."""
        with self._lock:
            return list(self._entries)

    def items(self) -> list[tuple[BucketKey, T]]:
        """The cached buckets and their values, least recently used first (the order is left as it is)."""
        with self._lock:
            return list(self._entries.items())

    def clear(self) -> None:
        """Drop every entry, calling ``on_evict`` for each (e.g. when the owner closes)."""
        with self._lock:
            gone = list(self._entries.items())
            self._entries.clear()
        self._evict(gone)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def _insert(self, key: BucketKey, value: T, pending: _Pending[T] | None) -> list[tuple[BucketKey, T]]:
        gone: list[tuple[BucketKey, T]] = []
        with self._lock:
            if pending is not None:
                self._pending.pop(key, None)
            old = self._entries.pop(key, None)
            if old is not None and old is not value:
                gone.append((key, old))
            self._entries[key] = value
            while len(self._entries) > self.max_entries:
                gone.append(self._entries.popitem(last=False))
        return gone

    def _evict(self, gone: list[tuple[BucketKey, T]]) -> None:
        for key, value in gone:
            log.info("shapes.evict", bucket=dict(key))
            if self.on_evict is None:
                continue
            try:
                self.on_evict(key, value)
            except Exception as exc:  # noqa: BLE001 - a failing close must not fail the run that evicted it
                log.warning("shapes.evict_failed", bucket=dict(key), error=f"{type(exc).__name__}: {exc}")


class ShapeRouter(Generic[T]):
    """Which plan a run's inputs belong to: None for the graph's own bucket (its dim hints), else
    the runner of the inputs' bucket, built by ``build(bucket, graph at its sizes)`` when first seen.

    The hot path is a dict lookup on the inputs' shapes; binding and bucketing run once per
    distinct shape tuple (up to ``SHAPES_REMEMBERED``)."""

    SHAPES_REMEMBERED = 64

    def __init__(self, graph: Graph, build: Callable[[BucketKey, Graph], T], *, max_entries: int = 4,
                 on_evict: Callable[[BucketKey, T], None] | None = None) -> None:
        self.graph, self._build = graph, build
        self._one = graph.inputs[0] if len(graph.inputs) == 1 else None
        home_inputs = {n: np.zeros(_hinted_shape(graph, n), np.float32) for n in graph.inputs}
        self.home = bucket(bind_dims(graph, home_inputs), graph.dim_hints)
        self._seen: dict[tuple[object, ...], BucketKey] = {self._shapes(home_inputs): self.home}
        self.plans: ShapePlans[T] = ShapePlans(max_entries, on_evict=on_evict)

    def _shapes(self, inputs: Mapping[str, Any]) -> tuple[object, ...]:
        if self._one is not None:  # most graphs: no comprehension frame on the hot path
            return (getattr(inputs.get(self._one), "shape", None),)
        return tuple([getattr(inputs.get(n), "shape", None) for n in self.graph.inputs])

    def at_home(self, inputs: Mapping[str, Any]) -> bool:
        """Whether ``inputs`` have sizes seen before in the home bucket (the hot path's one check)."""
        return self._seen.get(self._shapes(inputs)) is self.home

    @property
    def probe(self) -> tuple[str | None, dict[tuple[object, ...], BucketKey], BucketKey]:
        """What :meth:`at_home` reads, for a hot path to check one-input graphs inline: (the one input's
        name, or None; the sizes seen, as ``(shape,)`` -> bucket, filled in place; the home bucket)."""
        return self._one, self._seen, self.home

    def route(self, inputs: Mapping[str, Any]) -> T | None:
        shapes = self._shapes(inputs)
        key = self._seen.get(shapes)
        if key is None:
            key = bucket(bind_dims(self.graph, inputs), self.graph.dim_hints)  # raises ShapeMismatch
            if key == self.home:
                key = self.home  # the home bucket is told by identity on the hot path
            if len(self._seen) < self.SHAPES_REMEMBERED:
                self._seen[shapes] = key
        if key is self.home:
            return None
        return self.plans.get_or_build(key, lambda: self._build(key, at_dims(self.graph, dict(key))))


def _hinted_shape(graph: Graph, name: str) -> tuple[int, ...]:
    spec = graph.tensors[name]
    return tuple(d if isinstance(d, int) else _hint(graph, d) for d in spec.shape)


def _hint(graph: Graph, dim: str) -> int:
    if dim in graph.dim_hints:
        return int(graph.dim_hints[dim])
    value = _evaluate(dim, graph.dim_hints)
    return 1 if value is None else value
