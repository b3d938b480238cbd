"""Tensor data types and encodings of the Open Inference Protocol.

Datatype names are the protocol's (BOOL, UINT8..UINT64, INT8..INT64, FP16,
FP32, FP64, BYTES); a model's ONNX Runtime type names map onto them. Tensors
travel three ways: JSON arrays (REST), raw little-endian row-major bytes (the
binary tensor data extension, gRPC's raw_input_contents / raw_output_contents)
and gRPC's typed ``InferTensorContents`` fields. BYTES elements are, in raw
form, a 4-byte little-endian length followed by the bytes (tritonclient's
``serialize_byte_tensor``). BF16 is refused: numpy has no such type.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from dspark.server.oip.errors import bad_request

NUMPY: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
    "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}
_ORT = {
    "tensor(bool)": "BOOL", "tensor(uint8)": "UINT8", "tensor(uint16)": "UINT16", "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64", "tensor(int8)": "INT8", "tensor(int16)": "INT16", "tensor(int32)": "INT32",
    "tensor(int64)": "INT64", "tensor(float16)": "FP16", "tensor(float)": "FP32", "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}
# Triton's model_config.proto DataType enum names (TYPE_FP32, ...): the config's spelling.
CONFIG_TYPE = {dt: f"TYPE_{'STRING' if dt == 'BYTES' else dt}" for dt in NUMPY}
# gRPC InferTensorContents: the repeated field that holds each datatype (FP16 only travels raw).
CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def from_ort(ort_type: str) -> str | None:
    """The protocol's datatype for an ONNX Runtime type name (``tensor(float)`` -> FP32); None if it has none."""
    return _ORT.get(ort_type)


def numpy_dtype(datatype: str) -> np.dtype[Any]:
    dtype: np.dtype[Any] = np.dtype(NUMPY[datatype])
    return dtype


def element_count(shape: list[int]) -> int:
    return math.prod(shape)


def from_raw(buf: bytes | memoryview, datatype: str, shape: list[int], where: str) -> np.ndarray:
    """Decode raw tensor bytes; ``where`` names the tensor in the error (e.g. "input 'x'")."""
    n = element_count(shape)
    if datatype == "BYTES":
        return _bytes_from_raw(bytes(buf), shape, where)
    dtype = numpy_dtype(datatype)
    if len(buf) != n * dtype.itemsize:
        raise bad_request(f"{where}: {len(buf)} bytes of {datatype} data do not fill shape {shape} "
                          f"(expected {n * dtype.itemsize} bytes)")
    # A copy, native and writable: a plugin may hand the array to torch, which warns on read-only memory.
    return np.frombuffer(buf, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def _bytes_from_raw(buf: bytes, shape: list[int], where: str) -> np.ndarray:
    items: list[bytes] = []
    pos = 0
    while pos < len(buf):
        if pos + 4 > len(buf):
            raise bad_request(f"{where}: BYTES data ends inside an element's 4-byte length")
        (size,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if pos + size > len(buf):
            raise bad_request(f"{where}: a BYTES element's length ({size}) runs past the data")
        items.append(buf[pos:pos + size])
        pos += size
    if len(items) != element_count(shape):
        raise bad_request(f"{where}: {len(items)} BYTES elements do not fill shape {shape}")
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out.reshape(shape)


def to_raw(arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in (_as_bytes(x) for x in arr.reshape(-1)))
    return np.ascontiguousarray(arr, dtype=numpy_dtype(datatype).newbyteorder("<")).tobytes()


def _as_bytes(x: Any) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def from_json(data: Any, datatype: str, shape: list[int], where: str) -> np.ndarray:
    """JSON tensor data, nested or flat (the spec allows both), as an array of ``shape``."""
    if not isinstance(data, list):
        raise bad_request(f"{where}: 'data' must be a JSON array")
    flat = list(_flatten(data))
    if len(flat) != element_count(shape):
        raise bad_request(f"{where}: {len(flat)} data elements do not fill shape {shape} "
                          f"(expected {element_count(shape)})")
    if datatype == "BYTES":
        out = np.empty(len(flat), dtype=np.object_)
        out[:] = [x.encode() if isinstance(x, str) else _as_bytes(x) for x in flat]
        return out.reshape(shape)
    if any(isinstance(x, (str, dict, type(None))) for x in flat):
        raise bad_request(f"{where}: {datatype} data must be numbers" + (" or booleans" if datatype == "BOOL" else ""))
    try:
        return np.asarray(flat, dtype=numpy_dtype(datatype)).reshape(shape)
    except (OverflowError, ValueError, TypeError) as e:
        raise bad_request(f"{where}: data is not {datatype}: {e}") from None


def _flatten(data: list[Any]) -> Any:
    for x in data:
        if isinstance(x, list):
            yield from _flatten(x)
        else:
            yield x


def to_json(arr: np.ndarray, datatype: str) -> list[Any]:
    """Flat JSON data (row-major), as Triton returns it; BYTES as UTF-8 text where it decodes."""
    flat = arr.reshape(-1)
    if datatype == "BYTES":
        return [_text(_as_bytes(x)) for x in flat]
    return list(flat.tolist())


def _text(b: bytes) -> Any:
    try:
        return b.decode()
    except UnicodeDecodeError:
        raise bad_request("a BYTES output is not UTF-8 text: request it as binary data") from None


def from_contents(contents: Any, datatype: str, shape: list[int], where: str) -> np.ndarray:
    """gRPC typed contents (``InferTensorContents``) as an array of ``shape``."""
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise bad_request(f"{where}: {datatype} data must be sent in raw_input_contents")
    values = list(getattr(contents, field))
    if len(values) != element_count(shape):
        raise bad_request(f"{where}: {len(values)} elements in contents.{field} do not fill shape {shape} "
                          f"(expected {element_count(shape)})")
    if datatype == "BYTES":
        out = np.empty(len(values), dtype=np.object_)
        out[:] = values
        return out.reshape(shape)
    try:
        return np.asarray(values, dtype=numpy_dtype(datatype)).reshape(shape)
    except OverflowError as e:
        raise bad_request(f"{where}: contents.{field} does not fit {datatype}: {e}") from None
