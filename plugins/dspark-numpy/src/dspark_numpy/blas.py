"""NumPy's BLAS on one thread while this plugin computes.

OpenBLAS's threaded GEMM, called from the host's worker threads on a machine busy
with other work, was seen to hang (1 call in 6 beside a training run, none on an
idle machine); the plugin measures its peak on one thread and runs on one. The
controller finds the BLAS libraries once (about 0.2 ms, too much per call); a limit
through it costs a few microseconds.
"""

from __future__ import annotations

from typing import Any

from threadpoolctl import ThreadpoolController

_blas: Any = None


def one_blas_thread() -> Any:
    """A context manager: NumPy's BLAS on one thread inside it."""
    global _blas
    if _blas is None:
        _blas = ThreadpoolController().select(user_api="blas")
    return _blas.limit(limits=1)
