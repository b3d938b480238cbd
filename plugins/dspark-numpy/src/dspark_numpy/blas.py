"""NumPy's BLAS on one thread while this plugin computes.

OpenBLAS's threaded GEMM, called from the host's worker threads on a machine busy
with other work, was seen to hang (1 call in 6 beside a training run, none on an
idle machine); the plugin measures its peak on one thread and runs on one.
"""

from __future__ import annotations

from threadpoolctl import threadpool_limits


def one_blas_thread() -> threadpool_limits:
    return threadpool_limits(limits=1, user_api="blas")
