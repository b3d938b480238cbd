"""Which subgraphs OpenVINO can run and answer right: the check :mod:`.bidding` asks before pricing.

The runtime decides what it can run: the ONNX frontend must read the
subgraph (a conversion failure is unsupported), ``Core.query_model`` must
claim every op for the device, and every boundary tensor must have a port
the executable can feed or read (:mod:`.ports`). Before asking it, two cheap
checks leave out what OpenVINO would run but not answer right:

* boundary tensors the numpy bridge cannot carry (bfloat16, 4-bit);
* op signatures whose OpenVINO kernels disagree with the ONNX specification
  (:data:`.defects.DEFECTS`, found with ONNX's own node tests; see
  docs/onnx-node-conformance.md).

A subgraph with control flow (``If``, ``Loop``, ``Scan``) is also compiled:
``query_model`` claims such an op without looking into its bodies.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from dspark.graph import Subgraph, has_subgraphs
from dspark_plugins_cpu import defects, ports, runtime

_MAX_ENTRIES = 4096
_cache: OrderedDict[tuple[str, str], str | None] = OrderedDict()
_lock = threading.Lock()


def read_model(subgraph: Subgraph) -> Any:
    """The subgraph as an ``ov.Model``, read from its ONNX bytes in memory."""
    return runtime.core().read_model(subgraph.to_onnx().SerializeToString())


def unsupported_reason(subgraph: Subgraph, ov_name: str) -> str | None:
    """None when ``ov_name`` can run every op of ``subgraph``, else why not.

    Cached per (subgraph signature, device): the answer depends on op types,
    attributes, shapes and dtypes, never on weight values.
    """
    # Not cached: cheap, and a rule may look at constant values the signature leaves out.
    if (defect := defects.known_defect(subgraph)) is not None:
        return defect
    key = (subgraph.signature(), ov_name)
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
    reason = _query(subgraph, ov_name)
    with _lock:
        _cache[key] = reason
        while len(_cache) > _MAX_ENTRIES:
            _cache.popitem(last=False)
    return reason


def _query(subgraph: Subgraph, ov_name: str) -> str | None:
    if ov_name.startswith("NPU") and not all(
        subgraph.graph.tensors[t].is_static for t in subgraph.inputs + subgraph.outputs if t in subgraph.graph.tensors
    ):
        return "NPU compiles static shapes only"
    try:
        model = read_model(subgraph)
    except Exception as exc:  # the ONNX frontend has no conversion for some op
        return f"OpenVINO cannot read it: {_first_line(exc)}"
    try:
        claimed = runtime.core().query_model(model, ov_name)
    except Exception as exc:
        return f"query_model failed: {_first_line(exc)}"
    missing = [op.get_friendly_name() for op in model.get_ops() if op.get_friendly_name() not in claimed]
    if missing:
        return f"{ov_name} cannot run {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
    try:
        ports.input_ports(subgraph, list(model.inputs))
        ports.output_ports(subgraph, list(model.outputs))
    except KeyError as exc:
        return str(exc)
    if any(has_subgraphs(op) for op in subgraph.ops):
        # query_model claims a control-flow op without looking into its bodies; compiling does.
        try:
            runtime.core().compile_model(model, ov_name, runtime.compile_config(ov_name))
        except Exception as exc:
            return f"{ov_name} cannot compile its control flow: {_first_line(exc)}"
    return None


def _first_line(exc: Exception) -> str:
    # OpenVINO errors start with C++ source locations; the useful part is the
    # conversion summary further down.
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Exception from", "Check "))]
    return " ".join(useful[:4])[:300] or type(exc).__name__


def clear() -> None:
    with _lock:
        _cache.clear()
