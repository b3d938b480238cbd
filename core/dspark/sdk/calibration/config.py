"""The calibration knobs, and the switch that turns calibration off.

Every other module of the package reads these at call time (``config.NAME``), and the
package forwards assignments to them, so ``calibration.MAX_ROOFLINE_S = ...`` (a test,
a plugin written against plugin API 1.3) still changes what is timed.
"""

from __future__ import annotations

import os

NAMESPACE = "calibration"  # the disk cache namespace (dspark.host.cache)
VERSION = "calib-v3"  # bump when what is measured or stored changes: old entries are then ignored
MAX_ROOFLINE_S = 0.5  # subgraphs predicted slower than this are not timed
DEFAULT_BUDGET_S = 0.2

# -- sampling --
# Timed runs come in BATCHES batches; all of them together stop once there are MIN_SAMPLES runs
# spread over at least MIN_WINDOW_S (a shorter window would let one burst of contention decide),
# or at MAX_SAMPLES, or when the budget is spent.
BATCHES = 3
MIN_SAMPLES = 20
MIN_WINDOW_S = 0.02
MAX_SAMPLES = 2000
# A batch whose median is more than OUTLIER_FACTOR times the lowest batch median is an outlier
# (contention only ever adds time): more batches are taken, after a pause, up to EXTRA_BATCHES.
OUTLIER_FACTOR = 1.5
EXTRA_BATCHES = 3
# Other processes busy on more than this share of the cores during a batch: the host was busy.
# A measurement whose every batch was taken busy is stored as such and re-measured by a later
# process that finds the host quiet (at most REMEASURE_LIMIT times per entry).
BUSY_LOAD = 0.5
REMEASURE_LIMIT = 3
# A median this many times over the roofline (and over 1 ms) is more likely a burst of contention
# (a multi-threaded kernel waiting for a descheduled worker) than the subgraph: it is timed again
# after a pause, up to RETRIES times, and the lowest median kept.
SUSPECT_FACTOR = 50.0
RETRIES = 2
RETRY_PAUSE_S = 0.1

# -- observations of real runs (observe) --
# Once OBSERVE_MIN runs of a calibrated subgraph were observed, their median is compared with the
# entry; beyond OBSERVE_TOLERANCE (either way) the entry is replaced by it. Cold-cache entries
# are timed colder than a loop of real runs on purpose: they use COLD_OBSERVE_TOLERANCE.
OBSERVE_MIN = 8
OBSERVE_WINDOW = 32
OBSERVE_TOLERANCE = 3.0
COLD_OBSERVE_TOLERANCE = 10.0
# A one-op entry slower than its whole observed partition by the tolerance and by at least this
# many seconds is dropped, to be measured again on the next plan.
OBSERVE_MIN_GAP_S = 1e-4

# -- inputs and cold caches --
MAX_INPUT_BYTES = 256 * 1024 * 1024  # random inputs bigger than this are not generated
# streams_weights(): weights smaller than this are timed warm: below it the runtime's own state,
# evicted by a flush but hot in a real step, weighs more than the weight traffic.
STREAMING_MIN_BYTES = 256 * 1024
STREAMING_MAX_ROWS = 16  # above it a linear is compute-bound (weights reused by every row)

KNOBS = frozenset(name for name in globals() if name.isupper())


def enabled() -> bool:
    """False when ``DSPARK_CALIBRATE`` is 0/false/no/off: bids are then the pure roofline."""
    return os.environ.get("DSPARK_CALIBRATE", "1").strip().lower() not in ("0", "false", "no", "off")
