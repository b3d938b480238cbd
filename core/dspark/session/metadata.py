"""Input and output metadata as ONNX Runtime gives it (``NodeArg``: name, shape, type)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.graph.elements import TensorSpec, numpy_dtype

# ONNX Runtime's spelling of each element type, so code written against ``InferenceSession`` reads ours.
ORT_TYPES = {
    "float64": "tensor(double)", "float32": "tensor(float)", "float16": "tensor(float16)",
    "bfloat16": "tensor(bfloat16)", "int64": "tensor(int64)", "int32": "tensor(int32)", "int16": "tensor(int16)",
    "int8": "tensor(int8)", "uint8": "tensor(uint8)", "bool": "tensor(bool)", "int4": "tensor(int4)",
    "uint4": "tensor(uint4)",
}


@dataclass(frozen=True)
class NodeArg:
    """One model input or output. ``shape`` holds ints for fixed dims and the dim's name (``str``) for
    symbolic ones, as ``onnxruntime.NodeArg.shape`` does; ``type`` is ORT's name (``tensor(float)``)."""

    name: str
    shape: list[int | str | None]
    type: str
    dtype: Any  # the numpy dtype, or None for types numpy lacks (bfloat16, int4)

    @classmethod
    def of(cls, spec: TensorSpec) -> NodeArg:
        try:
            np_dtype: Any = np.dtype(numpy_dtype(spec.dtype))
        except KeyError:
            np_dtype = None
        shape: list[int | str | None] = list(spec.shape) if spec.rank_known else []
        return cls(name=spec.name, shape=shape, type=ORT_TYPES.get(spec.dtype, f"tensor({spec.dtype})"),
                   dtype=np_dtype)
