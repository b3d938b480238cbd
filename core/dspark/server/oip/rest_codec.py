"""REST inference bodies: the KServe v2 JSON request and response, with Triton's binary tensor data extension.

A body whose ``Inference-Header-Content-Length`` header is set holds that
many bytes of JSON, then the binary data of each input that declares a
``binary_data_size`` parameter, in input order. Outputs are sent as binary
when their ``binary_data`` parameter says so, else when the request's
``binary_data_output`` parameter does (tritonclient sets it when no outputs are
named); the response then carries the header too. A header of 0 is the raw
binary request: the body is the single input's data, its shape deduced.
(docs/protocol/extension_binary_data.md in triton-inference-server/server.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.server.oip import datatypes
from dspark.server.oip.errors import OipError, bad_request
from dspark.server.oip.model import ServedModel

HEADER = "Inference-Header-Content-Length"


@dataclass
class RestRequest:
    id: str | None
    feed: dict[str, np.ndarray]
    outputs: list[tuple[str, bool]]  # (output name, as binary data)


def parse_infer(model: ServedModel, body: bytes, header_length: str | None) -> RestRequest:
    if header_length is None:
        header, binary = body, memoryview(b"")
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise bad_request(f"{HEADER}: expected a byte count, got {header_length!r}") from None
        if not 0 <= n <= len(body):
            raise bad_request(f"{HEADER}: {n} is outside the body's {len(body)} bytes")
        if n == 0:
            return _raw_binary(model, body)
        header, binary = body[:n], memoryview(body)[n:]
    try:
        obj = json.loads(header)
    except ValueError as e:
        raise bad_request(f"the request is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("the request must be a JSON object with an 'inputs' array")
    params = _params(obj, "the request")
    if "binary_data_output" in params and not isinstance(params["binary_data_output"], bool):
        raise bad_request("parameters.binary_data_output must be a boolean")
    feed = _inputs(model, obj.get("inputs"), binary)
    outputs = _outputs(model, obj.get("outputs"), bool(params.get("binary_data_output", False)))
    rid = obj.get("id")
    if rid is not None and not isinstance(rid, str):
        raise bad_request("'id' must be a string")
    return RestRequest(rid, feed, outputs)


def _params(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise bad_request(f"{where}: 'parameters' must be a JSON object")
    shm = [k for k in params if k.startswith("shared_memory")]
    if shm:
        raise bad_request(f"{where}: shared memory ({shm[0]}) is not supported by this server; send the data "
                          "in the request (JSON or binary tensor data)")
    return params


def _inputs(model: ServedModel, inputs: Any, binary: memoryview) -> dict[str, np.ndarray]:
    if not isinstance(inputs, list) or not inputs:
        raise bad_request("'inputs' must be a non-empty array of tensors")
    feed: dict[str, np.ndarray] = {}
    pos = 0
    for i, inp in enumerate(inputs):
        if not isinstance(inp, dict):
            raise bad_request(f"inputs[{i}] must be a JSON object")
        name, datatype, shape = inp.get("name"), inp.get("datatype"), inp.get("shape")
        if not isinstance(name, str) or not isinstance(datatype, str):
            raise bad_request(f"inputs[{i}] needs a string 'name' and 'datatype'")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise bad_request(f"input '{name}': 'shape' must be an array of integers")
        if name in feed:
            raise bad_request(f"input '{name}' is given twice")
        model.check_input(name, datatype, shape)
        where = f"input '{name}'"
        size = _params(inp, where).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise bad_request(f"{where}: binary_data_size must be a non-negative integer")
            if "data" in inp:
                raise bad_request(f"{where}: has both 'data' and binary_data_size")
            if pos + size > len(binary):
                raise bad_request(f"{where}: binary_data_size {size} runs past the {len(binary)} bytes of binary "
                                  f"data after the JSON ({HEADER})")
            feed[name] = datatypes.from_raw(binary[pos:pos + size], datatype, shape, where)
            pos += size
        elif "data" in inp:
            feed[name] = datatypes.from_json(inp["data"], datatype, shape, where)
        else:
            raise bad_request(f"{where}: has neither 'data' nor a binary_data_size parameter")
    if pos != len(binary):
        raise bad_request(f"{len(binary) - pos} bytes of binary data left over after the inputs' binary_data_size")
    return feed


def _outputs(model: ServedModel, outputs: Any, binary_default: bool) -> list[tuple[str, bool]]:
    if outputs is None:
        return [(t.name, binary_default) for t in model.outputs]
    if not isinstance(outputs, list):
        raise bad_request("'outputs' must be an array")
    wanted: list[tuple[str, bool]] = []
    for i, out in enumerate(outputs):
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise bad_request(f"outputs[{i}] must be a JSON object with a string 'name'")
        params = _params(out, f"output '{out['name']}'")
        if params.get("classification"):
            raise bad_request(f"output '{out['name']}': the classification extension is not supported")
        binary = params.get("binary_data", binary_default)
        if not isinstance(binary, bool):
            raise bad_request(f"output '{out['name']}': binary_data must be a boolean")
        wanted.append((out["name"], binary))
    model.check_outputs([n for n, _ in wanted])
    return wanted


def _raw_binary(model: ServedModel, body: bytes) -> RestRequest:
    """The raw binary request: one input, whose shape follows from the byte count; all outputs binary."""
    if len(model.inputs) != 1:
        raise bad_request(f"a raw binary request ({HEADER}: 0) needs a model with one input; model '{model.name}' "
                          f"has {len(model.inputs)}")
    t = model.inputs[0]
    shape = [1, *t.shape[1:]] if model.batched else list(t.shape)
    if t.datatype == "BYTES":
        shape = [1 if d < 0 else d for d in shape]
    else:
        variable = [i for i, d in enumerate(shape) if d < 0]
        if len(variable) > 1:
            raise bad_request(f"a raw binary request cannot tell the shape of input '{t.name}' {t.shape}: more than "
                              "one dim varies; send the JSON header")
        known = int(np.prod([d for d in shape if d >= 0])) * datatypes.numpy_dtype(t.datatype).itemsize
        if variable:
            if known == 0 or len(body) % known:
                raise bad_request(f"input '{t.name}': {len(body)} bytes are not a whole number of {t.datatype} "
                                  f"rows of shape {t.shape}")
            shape[variable[0]] = len(body) // known
    feed = {t.name: datatypes.from_raw(memoryview(body), t.datatype, shape, f"input '{t.name}'")}
    return RestRequest(None, feed, [(o.name, True) for o in model.outputs])


def render_infer(model: ServedModel, req: RestRequest, outs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers (binary outputs after the JSON, in the order of the JSON)."""
    types = {t.name: t.datatype for t in model.outputs}
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, binary in req.outputs:
        arr, datatype = outs[name], types[name]
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(arr.shape)}
        if binary:
            raw = datatypes.to_raw(arr, datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = datatypes.to_json(arr, datatype)
        entries.append(entry)
    resp: dict[str, Any] = {"model_name": model.name, "model_version": model.version, "outputs": entries}
    if req.id is not None:
        resp["id"] = req.id
    header = json.dumps(resp, separators=(",", ":")).encode()
    if not chunks:
        return header, {"content-type": "application/json"}
    return header + b"".join(chunks), {"content-type": "application/octet-stream", HEADER.lower(): str(len(header))}


def error_body(e: OipError) -> bytes:
    return json.dumps({"error": e.message}).encode()
