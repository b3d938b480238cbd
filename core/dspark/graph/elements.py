"""The graph's elements: tensor specs, ops, and the dtype names they use.

Kept apart from :mod:`dspark.graph.model` so that ONNX I/O and the FLOP
counter, which build and annotate these, sit below the graph types whose
methods call them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dspark.types import DType

Dim = int | str  # a str is a symbolic dimension, e.g. "batch"

_NP_DTYPES: dict[str, Any] = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8,
    "uint8": np.uint8, "bool": np.bool_,
}
_ITEMSIZE: dict[str, float] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "int4": 0.5, "uint4": 0.5, "bool": 1,
}


def numpy_dtype(dtype: str) -> Any:
    """The numpy dtype for a dspark dtype name (KeyError for bfloat16/int4)."""
    return _NP_DTYPES[dtype]


def dtype_of(array: np.ndarray) -> DType:
    for name, np_dtype in _NP_DTYPES.items():
        if array.dtype == np_dtype:
            return name  # type: ignore[return-value]
    raise ValueError(f"unsupported numpy dtype {array.dtype}")


class TensorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    dtype: DType
    shape: tuple[Dim, ...]
    rank_known: bool = Field(
        default=True, description="False when ONNX shape inference could not tell even the rank (API 1.5): "
                          "``shape`` is then () and says nothing, and the tensor's size is unknown.")

    @property
    def is_static(self) -> bool:
        return self.rank_known and all(isinstance(d, int) for d in self.shape)

    def numel(self, bindings: dict[str, int] | None = None) -> int | None:
        """Element count, resolving symbolic dims from ``bindings``; None if unresolved."""
        if not self.rank_known:
            return None
        n = 1
        for d in self.shape:
            if isinstance(d, str):
                if not bindings or d not in bindings:
                    return None
                d = bindings[d]
            n *= d
        return n

    def nbytes(self, bindings: dict[str, int] | None = None) -> int | None:
        n = self.numel(bindings)
        return None if n is None else int(np.ceil(n * _ITEMSIZE[self.dtype]))


class Op(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Unique node name in the graph.")
    op_type: str = Field(description="ONNX operator type, e.g. 'MatMul'.")
    domain: str = Field("", description="ONNX domain; '' is the default ai.onnx domain.")
    inputs: list[str] = Field(description="Tensor names; '' for an omitted optional input.")
    outputs: list[str]
    attrs: dict[str, Any] = Field(
        default_factory=dict, description="Attribute values; a control-flow op's bodies are onnx.GraphProto values.")
    captures: list[str] = Field(
        default_factory=list,
        description="Outer-scope tensors the op's subgraph attributes read (control flow, API 1.5): also the "
                    "last entries of ``inputs``, so dependencies are explicit, but not inputs of the ONNX node.")
    flops: float | None = Field(None, description="Arithmetic operations of one run, when known.")
    bytes_read: int | None = None
    bytes_written: int | None = None
    param_bytes: int = 0

    @model_validator(mode="after")
    def _captures_last(self) -> Op:
        if self.captures and self.inputs[len(self.inputs) - len(self.captures):] != self.captures:
            raise ValueError(f"op {self.name!r}: captures {self.captures} must be the last entries of its inputs")
        return self

    @property
    def node_inputs(self) -> list[str]:
        """The ONNX node's own inputs: ``inputs`` without the captured outer-scope tensors."""
        return self.inputs[:len(self.inputs) - len(self.captures)] if self.captures else list(self.inputs)
