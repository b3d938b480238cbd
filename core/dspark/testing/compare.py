"""Comparing a plugin's outputs with reference outputs: names, shapes, dtypes, values."""

from __future__ import annotations

from typing import Any

import numpy as np

from dspark.types import TOLERANCES

_EXACT = (0.0, 0.0)  # integer and bool precisions must match exactly
# Float types numpy lacks (ml_dtypes): compared as floats, not bit for bit.
_ML_FLOATS = frozenset({"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})


def compare(outputs: Any, reference: dict[str, np.ndarray], expected_names: list[str],
            precision: str, *, tolerance: tuple[float, float] | None = None) -> tuple[bool, str]:
    """Check names, shapes, dtypes and values against the reference; (ok, detail).

    Integer and bool outputs must match exactly; floats within ``precision``'s
    tolerance (or ``tolerance`` = (rtol, atol) when given), NaN where the
    reference has NaN. A precision's ``atol`` is relative to the output's scale
    (its largest finite magnitude, at least 1): a float sum rounds relative to its
    terms, so an element that cancels to near zero in a large-valued output (a
    logit of 0.0006 among logits of 20, after a 384-term dot product) carries the
    rounding of that scale, not of its own value.
    """
    if not isinstance(outputs, dict):
        return False, f"run() returned {type(outputs).__name__}, expected a dict of numpy arrays"
    if sorted(outputs) != sorted(expected_names):
        return False, f"output names {sorted(outputs)} != subgraph outputs {sorted(expected_names)}"
    rtol, atol = tolerance if tolerance is not None else TOLERANCES.get(precision, _EXACT)
    worst_abs = worst_rel = 0.0
    for name in expected_names:
        got, ref = outputs[name], reference[name]
        if not isinstance(got, (np.ndarray, np.generic)):
            return False, f"output {name!r} is a {type(got).__name__}, not a numpy array"
        got = np.asarray(got)
        if got.shape != ref.shape:
            return False, f"output {name!r} has shape {got.shape}, reference {ref.shape}"
        if got.dtype != ref.dtype:
            return False, f"output {name!r} has dtype {got.dtype}, reference {ref.dtype}"
        if ref.dtype.kind not in "fc" and ref.dtype.name not in _ML_FLOATS:
            if not np.array_equal(got, ref):
                return False, f"output {name!r}: {int(np.sum(got != ref))} of {ref.size} elements differ"
            continue
        g, r = got.astype(np.float64), ref.astype(np.float64)
        if not np.array_equal(np.isnan(g), np.isnan(r)):
            return False, f"output {name!r}: NaN where the reference has none (or the reverse)"
        with np.errstate(invalid="ignore"):  # inf - inf where both are inf: NaN, zeroed just below
            err = np.abs(np.nan_to_num(g - r))
        worst_abs = max(worst_abs, float(err.max(initial=0.0)))
        worst_rel = max(worst_rel, float((err / np.maximum(np.abs(r), 1e-12)).max(initial=0.0)))
        scale = 1.0 if tolerance is not None else max(1.0, float(np.abs(r[np.isfinite(r)]).max(initial=0.0)))
        if not np.allclose(g, r, rtol=rtol, atol=atol * scale, equal_nan=True):
            return False, (f"output {name!r}: max abs err {worst_abs:.3g}, max rel err {worst_rel:.3g} "
                           f"exceed {precision} tolerance (rtol {rtol:g}, atol {atol:g} x scale {scale:.3g})")
    return True, f"max abs err {worst_abs:.3g}, max rel err {worst_rel:.3g} ({precision})"
