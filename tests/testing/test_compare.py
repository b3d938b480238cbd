"""The kit's comparison with the reference: a precision's absolute tolerance is relative to the output's scale."""

from __future__ import annotations

import numpy as np

from dspark.testing.compare import compare


def _check(got: np.ndarray, ref: np.ndarray, **kw: object) -> tuple[bool, str]:
    return compare({"y": got}, {"y": ref}, ["y"], "float32", **kw)  # type: ignore[arg-type]


def test_a_near_zero_element_among_large_ones_may_carry_their_rounding() -> None:
    ref = np.array([20.0, -15.0, 6e-4], np.float32)
    ok, detail = _check(ref + np.array([0, 0, 2e-5], np.float32), ref)  # 2e-5 <= 1e-5 x 20
    assert ok, detail
    ok, detail = _check(ref + np.array([0, 0, 3e-4], np.float32), ref)  # 3e-4 > 1e-5 x 20 + 1e-4 x 6e-4
    assert not ok and "x scale 20" in detail, detail


def test_small_outputs_keep_the_plain_tolerance() -> None:
    ref = np.array([0.5, -0.25, 6e-4], np.float32)
    assert _check(ref + np.array([0, 0, 5e-6], np.float32), ref)[0]
    assert not _check(ref + np.array([0, 0, 2e-5], np.float32), ref)[0]  # scale 1: atol 1e-5 as stated


def test_an_explicit_tolerance_is_not_scaled() -> None:
    ref = np.array([20.0, 6e-4], np.float32)
    assert not _check(ref + np.array([0, 2e-5], np.float32), ref, tolerance=(1e-4, 1e-5))[0]
