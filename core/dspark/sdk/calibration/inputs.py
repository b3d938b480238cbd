"""Random inputs a subgraph can run on, built from its tensor specs."""

from __future__ import annotations

import numpy as np

from dspark.graph.model import Subgraph, TensorSpec, numpy_dtype
from dspark.sdk.calibration import config


class CannotCalibrate(Exception):
    """No valid inputs can be generated for the subgraph (the message says why)."""


# Where an integer input is plain data: any small positive values are valid there.
_INT_DATA_OPS = frozenset({
    "Abs", "Add", "And", "ArgMax", "ArgMin", "BitShift", "Cast", "Concat", "Div", "Equal", "Expand",
    "Flatten", "Greater", "GreaterOrEqual", "Identity", "Less", "LessOrEqual", "Max", "Mean", "Min",
    "Mod", "Mul", "Neg", "Not", "Or", "Pad", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
    "ReduceSum", "Reshape", "Shape", "Sign", "Size", "Slice", "Squeeze", "Sub", "Sum", "Tile",
    "Transpose", "Unsqueeze", "Where", "Xor",
})
# Of those, the ops whose integer inputs beyond the first are shapes, axes or pads.
_DATA_FIRST_ONLY = frozenset({"Expand", "Pad", "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd",
                              "ReduceSum", "Reshape", "Slice", "Squeeze", "Tile", "Unsqueeze"})
_INDEX_OPS = {"Gather": 1, "GatherElements": 1}  # op type -> position of the index input


def concrete_shape(spec: TensorSpec, hints: dict[str, int]) -> tuple[int, ...]:
    """``spec``'s shape with symbolic dims taken from ``hints`` (1 when a dim has no hint)."""
    return tuple(d if isinstance(d, int) else int(hints.get(d, 1)) for d in spec.shape)


def _int_range(subgraph: Subgraph, name: str, hints: dict[str, int]) -> tuple[int, int]:
    """[low, high) valid for every use of integer input ``name``; CannotCalibrate otherwise."""
    low, bound = 0, None
    for op in subgraph.ops:
        for pos, t in enumerate(op.inputs):
            if t != name:
                continue
            if _INDEX_OPS.get(op.op_type) == pos:
                data = subgraph.graph.tensors.get(op.inputs[0])
                if data is None:
                    raise CannotCalibrate(f"{op.op_type} {op.name!r}: data shape unknown")
                shape = concrete_shape(data, hints)
                axis = int(op.attrs.get("axis", 0))
                axis = axis + len(shape) if axis < 0 else axis
                if not 0 <= axis < len(shape):
                    raise CannotCalibrate(f"{op.op_type} {op.name!r}: axis {axis} out of range")
                bound = shape[axis] if bound is None else min(bound, shape[axis])
            elif op.op_type in _INT_DATA_OPS and (pos == 0 or op.op_type not in _DATA_FIRST_ONLY) \
                    and not (op.op_type == "Where" and pos == 0):
                low = 1  # no zeros: an integer Div or Mod by zero may trap
            else:
                raise CannotCalibrate(f"no valid values known for integer input {pos} of "
                                      f"{op.op_type} {op.name!r}")
    high = 8 if bound is None else bound
    if high <= low:
        raise CannotCalibrate(f"no valid integer values for {name!r} ([{low}, {high}))")
    return low, high


def make_inputs(subgraph: Subgraph, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for ``subgraph`` from its TensorSpecs; symbolic dims from ``graph.dim_hints`` (default 1).

    Floats are drawn in [0.5, 1.5) (valid for Log, Sqrt, Div, Pow), bools at
    random, integers in a range valid for every use (Gather indices within the
    gathered axis). Raises :class:`CannotCalibrate` when no valid values are
    known (an integer input used as a shape, an unknown spec, bfloat16 ...).
    """
    rng = np.random.default_rng(seed)
    hints = subgraph.graph.dim_hints
    feeds: dict[str, np.ndarray] = {}
    total = 0
    for name in subgraph.inputs:
        spec = subgraph.graph.tensors.get(name)
        if spec is None:
            raise CannotCalibrate(f"no TensorSpec for input {name!r}")
        if not spec.rank_known:
            raise CannotCalibrate(f"the rank of input {name!r} is unknown")
        shape = concrete_shape(spec, hints)
        total += int(np.prod(shape, dtype=np.int64)) * 8
        if total > config.MAX_INPUT_BYTES:
            raise CannotCalibrate(f"inputs larger than {config.MAX_INPUT_BYTES >> 20} MiB")
        try:
            dtype = np.dtype(numpy_dtype(spec.dtype))
        except KeyError:
            raise CannotCalibrate(f"no numpy dtype for {spec.dtype} input {name!r}") from None
        if dtype.kind == "f":
            feeds[name] = (rng.random(shape) + 0.5).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.random(shape) > 0.5
        else:
            low, high = _int_range(subgraph, name, hints)
            feeds[name] = rng.integers(low, high, size=shape).astype(dtype)
    return feeds
