"""Bids: can the execution provider run a subgraph, and how long will it take.

"Can run" is decided by ONNX Runtime itself: a session is created on the
subgraph (strictly, for non-CPU providers, so every node must be claimed by
the provider). The verdict is cached per subgraph signature, model format
(float or a quantized format) and provider; the signature ignores weight
values, which do not change what ORT accepts. Our own quantized variants are
bid on at their precision, timed like float subgraphs; weight-bound linears
(:func:`dspark.sdk.calibration.streams_weights`), float or quantized, are timed
with cold caches on a CPU, as in an LLM decode step (their weights come from
DRAM there, and a warm loop would flatter the float layout).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from dspark.sdk import calibration
from dspark.graph.model import Subgraph
from dspark.host.log import get_logger
from dspark.types import Bid, Device
from dspark_plugins_npu import providers, session
from dspark_plugins_npu.executable import ep_of, model_bytes, model_format

log = get_logger("dspark_plugins_npu")

_MAX_VERDICTS = 4096
_verdicts: OrderedDict[tuple[str, str, str, int], str | None] = OrderedDict()
_lock = threading.Lock()


def why_not(subgraph: Subgraph, ep: str, index: int) -> str | None:
    """None when ``ep`` can run ``subgraph``; otherwise the reason (cached)."""
    key = (subgraph.signature(), model_format(subgraph), ep, index)
    with _lock:
        if key in _verdicts:
            _verdicts.move_to_end(key)
            return _verdicts[key]
    try:
        session.create(model_bytes(subgraph), ep, index)
        verdict: str | None = None
    except session.EpUnusable as exc:
        verdict = str(exc)
    except Exception as exc:  # e.g. no shape known for a boundary tensor
        verdict = f"cannot export the subgraph to ONNX: {exc}"
    with _lock:
        _verdicts[key] = verdict
        while len(_verdicts) > _MAX_VERDICTS:
            _verdicts.popitem(last=False)
    return verdict


def bid(subgraph: Subgraph, device: Device, plugin: str) -> Bid | None:
    if subgraph.quantized_by not in (None, plugin):
        return None  # another plugin's packed weights mean nothing to ONNX Runtime
    if "execution_provider" not in device.properties:
        return None
    ep, index = ep_of(device)
    if (reason := why_not(subgraph, ep, index)) is not None:
        log.debug("bid.abstain", ep=ep, ops=[op.op_type for op in subgraph.ops][:8], reason=reason)
        return None
    quantized = subgraph.quantized_by is not None
    precision = subgraph.quant_spec.precision if quantized else providers.info(ep).precision
    params = subgraph.payload.param_bytes if quantized else subgraph.param_bytes
    # The probe measured the call and per-op overheads on sessions of this provider: reused as they are.
    est = calibration.estimate(
        subgraph, device, runtime_key=f"{providers.runtime_name(ep)} {session.ort().__version__}",
        compile=_compile(device), dtype=precision,
        op_overhead_s=float(device.properties.get("op_overhead_s", 2e-6)),
        call_overhead_s=float(device.properties.get("call_overhead_s", 0.0)), measure_overheads=False,
        flush_caches=calibration.streams_weights(subgraph),
    )
    return Bid(device_id=device.id, runtime=providers.runtime_name(ep), latency_s=est.latency_s,
               peak_memory_bytes=params + subgraph.io_bytes(), precision=precision,
               fixed_overhead_s=est.fixed_overhead_s, source=est.source, note=est.note)


def _compile(device: Device) -> calibration.Compile:
    """The plugin's ``dspark_compile`` hook, for timing."""
    import dspark_plugins_npu

    return lambda sg: dspark_plugins_npu.dspark_compile(sg, device)


def clear() -> None:
    with _lock:
        _verdicts.clear()
