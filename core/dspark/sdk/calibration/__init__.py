"""Calibrated bids: timing the real subgraph on the plugin's own runtime, cached on disk, kept honest.

A roofline (:func:`dspark.sdk.cost.roofline`) knows peak compute and bandwidth,
not the runtime's dispatch cost, its kernels' efficiency at small shapes, or
what it fuses. A plugin refines its bid by compiling the subgraph with the
same code path as its ``dspark_compile``, running it on random inputs built
from the subgraph's tensor specs (:func:`make_inputs`), and bidding the
median time (:func:`calibrate`). The runtime's per-call overhead, what the
placer charges once per partition, is measured the same way on a trivial
subgraph (:func:`call_overhead`). A plugin uses :func:`estimate`, which returns
the latency, the fixed overhead and the source to put in its
:class:`~dspark.types.Bid`.

A calibration cannot be poisoned by a burst of load: runs are timed in
batches with the host's CPU contention during each (:mod:`.sampling`,
:mod:`.load`), outlier batches are taken again, an entry measured on a busy
host is measured again once the host is quiet, and the run times the executor
reports (:func:`observe`, :func:`observe_run`) replace an entry they disagree
with (:mod:`.observations`). Entries live in the disk cache (:mod:`.store`,
namespace ``calibration``); ``dspark cache clear --namespace calibration`` or
``dspark devices --refresh`` drops them (:func:`clear`).

``DSPARK_CALIBRATE=0`` turns calibration off: bids are the pure roofline with
the overheads the probe measured. docs/calibration.md has the details.

Modules: :mod:`.config` (knobs), :mod:`.inputs`, :mod:`.cold` (cold caches for
weight-bound linears), :mod:`.sampling`, :mod:`.load`, :mod:`.store`,
:mod:`.estimates` (calibrate, estimate), :mod:`.observations`. The knobs (``MIN_SAMPLES``,
``MAX_ROOFLINE_S``, ...) can be set on this package: the assignment goes to
:mod:`.config`, which every module reads at call time.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from dspark.sdk.calibration import config
from dspark.sdk.calibration.cold import (
    CacheFlusher,
    largest_cache_bytes,
    linear_baseline,
    streams_weights,
)
from dspark.sdk.calibration.config import (
    BATCHES,
    BUSY_LOAD,
    COLD_OBSERVE_TOLERANCE,
    DEFAULT_BUDGET_S,
    EXTRA_BATCHES,
    MAX_INPUT_BYTES,
    MAX_ROOFLINE_S,
    MAX_SAMPLES,
    MIN_SAMPLES,
    MIN_WINDOW_S,
    NAMESPACE,
    OBSERVE_MIN,
    OBSERVE_MIN_GAP_S,
    OBSERVE_TOLERANCE,
    OBSERVE_WINDOW,
    OUTLIER_FACTOR,
    REMEASURE_LIMIT,
    RETRIES,
    RETRY_PAUSE_S,
    STREAMING_MAX_ROWS,
    STREAMING_MIN_BYTES,
    SUSPECT_FACTOR,
    VERSION,
    enabled,
)
from dspark.sdk.calibration.estimates import (
    Calibration,
    Compile,
    Estimate,
    Overhead,
    calibrate,
    call_overhead,
    estimate,
)
from dspark.sdk.calibration.inputs import CannotCalibrate, make_inputs
from dspark.sdk.calibration.observations import Verdict, observe, observe_run
from dspark.sdk.calibration.store import cache_key


def clear() -> int:
    """Delete every calibration on disk and forget this process's; the number of entries deleted."""
    from dspark.sdk.calibration import observations, store

    observations.forget()
    return store.clear()


__all__ = [
    "BATCHES", "BUSY_LOAD", "COLD_OBSERVE_TOLERANCE", "DEFAULT_BUDGET_S", "EXTRA_BATCHES", "MAX_INPUT_BYTES",
    "MAX_ROOFLINE_S", "MAX_SAMPLES", "MIN_SAMPLES", "MIN_WINDOW_S", "NAMESPACE", "OBSERVE_MIN",
    "OBSERVE_MIN_GAP_S", "OBSERVE_TOLERANCE", "OBSERVE_WINDOW", "OUTLIER_FACTOR", "REMEASURE_LIMIT", "RETRIES",
    "RETRY_PAUSE_S", "STREAMING_MAX_ROWS", "STREAMING_MIN_BYTES", "SUSPECT_FACTOR", "VERSION",
    "CacheFlusher", "Calibration", "CannotCalibrate", "Compile", "Estimate", "Overhead", "Verdict",
    "cache_key", "calibrate", "call_overhead", "clear", "enabled", "estimate", "largest_cache_bytes",
    "linear_baseline", "make_inputs", "observe", "observe_run", "streams_weights",
]


class _Package(types.ModuleType):
    """Setting a knob on the package sets it in :mod:`.config`, where the modules read it."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in config.KNOBS:
            setattr(config, name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
