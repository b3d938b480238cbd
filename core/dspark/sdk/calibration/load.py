"""How busy the host is: CPU contention over a window, and right now.

The measure is the share of wall time during which some task on the host was
ready to run but waited for a CPU (Linux pressure stall information,
``/proc/pressure/cpu``, microsecond resolution), so it counts exactly what
stretches a timed run. Where PSI is missing, it falls back to the share of
the cores other processes kept busy (``psutil.cpu_times``, coarse: clock
ticks), and to the one-minute load average per core for :func:`busy_now`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

from dspark.host import hostinfo

_PSI = Path("/proc/pressure/cpu")


def _psi_total_s() -> float | None:
    """Cumulative seconds during which some task waited for a CPU; None without PSI."""
    try:
        first = _PSI.read_text().split("\n", 1)[0]
    except OSError:
        return None
    for field in first.split():
        if field.startswith("total="):
            return int(field[6:]) / 1e6
    return None


def _others_busy_s() -> float:
    """CPU seconds of the whole host so far, less this process's own."""
    t = psutil.cpu_times()
    busy = t.user + t.system + sum(getattr(t, f, 0.0) for f in ("nice", "irq", "softirq", "steal"))
    own = psutil.Process().cpu_times()
    return float(busy - own.user - own.system)


class LoadWindow:
    """Started on creation; :meth:`stop` gives the host's CPU contention since then, 0..1."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._psi0 = _psi_total_s()
        self._others0 = _others_busy_s() if self._psi0 is None else 0.0

    def stop(self) -> float:
        wall = time.monotonic() - self._t0
        if wall <= 0:
            return 0.0
        if self._psi0 is not None and (psi := _psi_total_s()) is not None:
            share = (psi - self._psi0) / wall
        else:
            cores = psutil.cpu_count(logical=True) or 1
            share = (_others_busy_s() - self._others0) / (wall * cores)
        return min(1.0, max(0.0, share))


def start_window() -> LoadWindow:
    """A new :class:`LoadWindow` (a seam: tests replace it to script a load spike)."""
    return LoadWindow()


def busy_now(threshold: float) -> bool:
    """True when the host is contended now: PSI's 10-second average, else the load average per core."""
    try:
        first = _PSI.read_text().split("\n", 1)[0]
        avg10 = next(float(f[6:]) for f in first.split() if f.startswith("avg10="))
        return avg10 / 100 > threshold
    except (OSError, StopIteration, ValueError):
        pass
    try:
        return os.getloadavg()[0] / (hostinfo.cpu_static()["logical_cores"] or 1) > threshold
    except OSError:
        return False


def loadavg_per_core() -> float:
    """The one-minute load average per logical core (recorded with each measurement)."""
    try:
        return round(os.getloadavg()[0] / (hostinfo.cpu_static()["logical_cores"] or 1), 3)
    except OSError:
        return 0.0
