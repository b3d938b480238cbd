"""Cold CPU caches for weight-bound linears: which subgraphs, the baseline, the flush.

A tight timing loop keeps a small weight in L2/L3, which flatters the bigger
(float) layout, while in an LLM decode step every layer's weights come from
DRAM. Plugins that opt in (``flush_caches=True``) time such subgraphs with each
run after a :class:`CacheFlusher`; the flush also evicts the runtime's own
state, which a real decode loop keeps hot, so a tiny baseline of the same kind
(:func:`linear_baseline`) is timed alongside and its cold-cache cost taken out
(docs/calibration.md has the reasoning and the figures).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from dspark.graph.model import Subgraph
from dspark.host import hostinfo
from dspark.sdk.calibration import config

_WEIGHT_OPS = frozenset({"MatMul", "Gemm"})


def streams_weights(subgraph: Subgraph) -> bool:
    """True for a weight-bound linear: every op a MatMul/Gemm reading a constant 2-D weight, of
    ``STREAMING_MIN_BYTES`` at least in all (float size, so a quantized variant of the same
    ops answers the same), for at most ``STREAMING_MAX_ROWS`` rows (the dim hints'). Such
    subgraphs are timed with cold caches by the plugins that opt in. With more rows the kernel is
    compute-bound and a warm loop times it as well."""
    ops = subgraph.ops
    graph = subgraph.graph
    inits = graph.initializers
    if not ops or any(op.op_type not in _WEIGHT_OPS or len(op.inputs) < 2 or op.inputs[1] not in inits
                      or inits[op.inputs[1]].ndim != 2 for op in ops):
        return False
    for op in ops:
        spec = graph.tensors.get(op.inputs[0])
        if spec is None:
            return False
        lead = spec.shape[1:] if op.op_type == "Gemm" and op.attrs.get("transA") else spec.shape[:-1]
        rows = int(np.prod([d if isinstance(d, int) else int(graph.dim_hints.get(d, 1)) for d in lead]))
        if rows > config.STREAMING_MAX_ROWS:
            return False
    return sum(int(inits[op.inputs[1]].nbytes) for op in ops) >= config.STREAMING_MIN_BYTES


def linear_baseline(subgraph: Subgraph,
                    quantize: Callable[[Subgraph], Subgraph | None] | None = None) -> Subgraph | None:
    """A tiny linear like ``subgraph`` (a one-op ``x @ W``), with the same rows, to pass as
    ``cold_baseline``; None for anything else. When ``subgraph`` is a quantized variant, the
    baseline goes through ``quantize`` (the plugin's own, with ``subgraph``'s spec) to match it."""
    from dspark.sdk.quant import linear_subgraph

    ops = subgraph.ops
    if len(ops) != 1 or ops[0].op_type != "MatMul" or ops[0].inputs[1] not in subgraph.graph.initializers \
            or subgraph.inputs != [ops[0].inputs[0]]:
        return None
    spec = subgraph.graph.tensors.get(ops[0].inputs[0])
    if spec is None or len(spec.shape) != 2:
        return None
    rows = spec.shape[0]
    hint = subgraph.graph.dim_hints.get(rows, 1) if isinstance(rows, str) else rows
    # 256 x 64: two groups of 128 (group-wise kernels run their grouped path), 64 KB as float32.
    w = (np.random.default_rng(0).standard_normal((256, 64)) / 16).astype(np.float32)
    base = linear_subgraph("cold_baseline", w, tokens=rows, representative_tokens=int(hint))
    return quantize(base) if quantize is not None and subgraph.quantized_by else base


@functools.lru_cache(maxsize=1)
def largest_cache_bytes() -> int:
    """The largest CPU cache (normally the L3), from sysfs; 32 MiB when it cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 << 20)


class CacheFlusher:
    """Evicts the CPU caches by reading a buffer twice the largest cache, split across the usable
    cores (each core's private L2 must be evicted too: a multi-threaded kernel reads its share of
    the weights on every core). Reads, not writes: no dirty lines to write back during the timed
    run. Numpy releases the GIL while summing, so the threads run in parallel."""

    def __init__(self) -> None:
        total = min(max(2 * largest_cache_bytes(), 16 << 20), 512 << 20)
        cores = max(1, min(int(hostinfo.cpu_static()["usable_cores"] or 1), 16))
        self.buffer = np.ones(total // 8, dtype=np.int64)
        self._parts = np.array_split(self.buffer, cores)

    def __call__(self) -> None:
        if len(self._parts) == 1:
            np.add.reduce(self._parts[0])
            return
        threads = [threading.Thread(target=np.add.reduce, args=(part,)) for part in self._parts[1:]]
        for t in threads:
            t.start()
        np.add.reduce(self._parts[0])
        for t in threads:
            t.join()
