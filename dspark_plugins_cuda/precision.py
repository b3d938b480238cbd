"""Keeping float32 math IEEE float32 on CUDA.

cuDNN convolutions default to TF32 on Ampere and later, which misses the
float32 tolerance our bids promise; matmuls may have been switched to TF32 by
the user. Both are process-wide flags, so they are set for the duration of a
run and restored afterwards, under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LOCK = threading.RLock()


def _new_api(torch: Any) -> bool:
    # torch >= 2.9 has per-backend ``fp32_precision``; mixing it with the
    # legacy ``allow_tf32`` flags makes torch raise, so use one or the other.
    conv = getattr(torch.backends.cudnn, "conv", None)
    matmul = torch.backends.cuda.matmul
    return conv is not None and hasattr(conv, "fp32_precision") and hasattr(matmul, "fp32_precision")


@contextmanager
def fp32_mode(torch: Any, tf32: bool) -> Iterator[None]:
    """Run float32 matmuls and convolutions in TF32 (``tf32=True``) or IEEE float32."""
    with _LOCK:
        if _new_api(torch):
            targets = [torch.backends.cuda.matmul, torch.backends.cudnn.conv]
            saved = [t.fp32_precision for t in targets]
            try:
                for t in targets:
                    t.fp32_precision = "tf32" if tf32 else "ieee"
                yield
            finally:
                for t, v in zip(targets, saved, strict=True):
                    t.fp32_precision = v
        else:
            saved_flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
            try:
                torch.backends.cuda.matmul.allow_tf32 = tf32
                torch.backends.cudnn.allow_tf32 = tf32
                yield
            finally:
                torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_flags
