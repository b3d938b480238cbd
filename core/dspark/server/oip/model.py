"""A served model: its Session, what the protocol says about it (metadata, config), input checks, warm-up.

Shapes follow Triton: for a model served with ``max_batch_size > 0`` the
config's ``dims`` leave the batch dim out and the metadata shows it as -1;
otherwise both give the model's full shape. Symbolic dims are -1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.host.log import get_logger
from dspark.server.oip import datatypes
from dspark.server.oip.batcher import Batcher
from dspark.server.oip.config import ModelEntry
from dspark.server.oip.errors import bad_request
from dspark.server.oip.stats import ModelStats

log = get_logger("dspark.server.oip")

VERSION = "1"  # one version per model: the file served
PLATFORM = "onnx_onnxv1"  # the KServe v2 spec's platform name for an ONNX model


@dataclass(frozen=True)
class TensorMeta:
    name: str
    datatype: str
    shape: list[int]  # the model's full shape; -1 for a dim that varies

    def json(self, batched: bool) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.shape[1:]] if batched else self.shape}


class ModelLoadError(ValueError):
    """The model cannot be served as configured; the message names the model and what to change."""


def _meta(arg: Any, model: str, kind: str) -> TensorMeta:
    datatype = datatypes.from_ort(arg.type)
    if datatype is None:
        raise ModelLoadError(f"model '{model}': {kind} '{arg.name}' has type {arg.type}, which the Open Inference "
                             "Protocol server cannot carry (BF16 and sub-byte types are not supported)")
    shape = [d if isinstance(d, int) and d >= 0 else -1 for d in arg.shape]
    return TensorMeta(arg.name, datatype, shape)


class ServedModel:
    def __init__(self, entry: ModelEntry, session: Any) -> None:
        self.entry, self.session, self.name = entry, session, entry.served_name
        self.version = VERSION
        self.inputs = [_meta(a, self.name, "input") for a in session.get_inputs()]
        self.outputs = [_meta(a, self.name, "output") for a in session.get_outputs()]
        self._inputs = {t.name: t for t in self.inputs}
        self.max_batch_size = entry.max_batch_size
        self.batched = self.max_batch_size > 0
        if self.batched:
            fixed = [f"{t.name} {t.shape}" for t in (*self.inputs, *self.outputs) if not t.shape or t.shape[0] != -1]
            if fixed:
                raise ModelLoadError(f"model '{self.name}': max_batch_size {self.max_batch_size} needs every input "
                                     f"and output to have a variable (symbolic or -1) first dim; these do not: "
                                     f"{', '.join(fixed)}. Serve it with max_batch_size: 0")
        self.stats = ModelStats(self.name, self.version)
        self.batcher = Batcher(self._run, name=self.name, stats=self.stats, max_batch_size=self.max_batch_size,
                               dynamic=entry.dynamic_batching, instance_count=entry.instance_count)
        self.ready = False

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return list(self.session.run(None, feed))

    # -- startup ---------------------------------------------------------------

    def warmup_sizes(self) -> list[int]:
        """The batch sizes to run once before serving: every power of two up to max_batch_size, and it.

        Session plans one size bucket per power of two on first sight; running each bucket here means no
        client request pays for planning. Unbatched models run once at their own shape."""
        if not self.batched:
            return [0]
        sizes = {1 << i for i in range(self.max_batch_size.bit_length()) if 1 << i <= self.max_batch_size}
        return sorted(sizes | {self.max_batch_size})

    def warmup(self) -> None:
        rng = np.random.default_rng(0)
        for size in self.warmup_sizes():
            feed = {t.name: _sample(t, size, rng) for t in self.inputs}
            t0 = time.perf_counter()
            try:
                self._run(feed)
            except Exception as e:  # noqa: BLE001  (sample data may not suit the model; requests will tell)
                log.warning("warm-up run failed; the first request of this size will plan instead", model=self.name,
                            batch_size=size or None, error=f"{type(e).__name__}: {e}")
                continue
            log.info("Model warmed up", model=self.name, batch_size=size or None,
                     seconds=round(time.perf_counter() - t0, 3))

    # -- the protocol's views -------------------------------------------------------

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "versions": [self.version], "platform": PLATFORM,
                "inputs": [t.json(self.batched) for t in self.inputs],
                "outputs": [t.json(self.batched) for t in self.outputs]}

    def config(self) -> Any:
        """Triton's ``ModelConfig`` message for this model (the REST route sends it as JSON)."""
        from dspark.server.oip.protos import model_config_pb2

        mc: Any = model_config_pb2  # generated, untyped

        def dims(t: TensorMeta) -> list[int]:
            return t.shape[1:] if self.batched else t.shape

        cfg = mc.ModelConfig(
            name=self.name, platform=PLATFORM, backend="dspark", max_batch_size=self.max_batch_size,
            input=[mc.ModelInput(name=t.name, data_type=datatypes.CONFIG_TYPE[t.datatype], dims=dims(t))
                   for t in self.inputs],
            output=[mc.ModelOutput(name=t.name, data_type=datatypes.CONFIG_TYPE[t.datatype], dims=dims(t))
                    for t in self.outputs],
            # KIND_MODEL: the model places itself (dspark's placer picks the devices, not the server).
            instance_group=[mc.ModelInstanceGroup(name=self.name, kind=mc.ModelInstanceGroup.KIND_MODEL,
                                                  count=self.entry.instance_count)])
        db = self.entry.dynamic_batching
        if db is not None:
            cfg.dynamic_batching.CopyFrom(mc.ModelDynamicBatching(
                preferred_batch_size=db.preferred_batch_size,
                max_queue_delay_microseconds=db.max_queue_delay_microseconds))
        return cfg

    def config_json(self) -> dict[str, Any]:
        """The config as Triton's REST route sends it: every field, proto names, 64-bit integers as numbers."""
        from google.protobuf import json_format

        cfg = self.config()
        raw = json_format.MessageToDict(cfg, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
        return _ints(cfg.DESCRIPTOR, raw)

    # -- request checks ---------------------------------------------------------

    def check_input(self, name: str, datatype: str, shape: Sequence[int]) -> TensorMeta:
        """The model's input ``name`` if a tensor of ``datatype`` and ``shape`` fits it; a 400 naming both if not."""
        t = self._inputs.get(name)
        if t is None:
            raise bad_request(f"unknown input '{name}' for model '{self.name}'; its inputs are {list(self._inputs)}")
        if datatype != t.datatype:
            raise bad_request(f"input '{name}' of model '{self.name}': datatype {datatype} does not match the "
                              f"model's {t.datatype}")
        shape = list(shape)
        expected = [-1, *t.shape[1:]] if self.batched else t.shape
        if any(d < 0 for d in shape) or len(shape) != len(expected) or any(
                e not in (-1, d) for e, d in zip(expected, shape)):
            raise bad_request(f"input '{name}' of model '{self.name}': shape {shape} does not match the model's "
                              f"{expected} (-1: any size)")
        if self.batched and shape[0] > self.max_batch_size:
            raise bad_request(f"input '{name}' of model '{self.name}': batch size {shape[0]} (dim 0 of shape "
                              f"{shape}) exceeds max_batch_size {self.max_batch_size}")
        return t

    def check_feed(self, feed: dict[str, np.ndarray]) -> int:
        """Every input present and, for a batched model, one batch size: the request's rows (1 if unbatched)."""
        missing = [t.name for t in self.inputs if t.name not in feed]
        if missing:
            raise bad_request(f"model '{self.name}' expects input(s) {missing}; the request has {list(feed)}")
        if not self.batched:
            return 1
        sizes = {n: int(a.shape[0]) for n, a in feed.items()}
        if len(set(sizes.values())) > 1:
            raise bad_request(f"model '{self.name}': the inputs disagree on the batch size (dim 0): {sizes}")
        rows = next(iter(sizes.values()))
        if rows == 0:
            raise bad_request(f"model '{self.name}': batch size 0 (dim 0 of every input is 0)")
        return rows

    def check_outputs(self, names: Sequence[str]) -> None:
        known = [t.name for t in self.outputs]
        for n in names:
            if n not in known:
                raise bad_request(f"unknown output '{n}' for model '{self.name}'; its outputs are {known}")


def _ints(desc: Any, obj: dict[str, Any]) -> dict[str, Any]:
    """Proto JSON writes 64-bit integers as strings; Triton's config JSON writes numbers (dims, delays)."""
    from google.protobuf.descriptor import FieldDescriptor as F

    wide = (F.CPPTYPE_INT64, F.CPPTYPE_UINT64)
    for f in desc.fields:
        if f.name not in obj:
            continue
        v = obj[f.name]
        if f.cpp_type in wide:
            obj[f.name] = [int(x) for x in v] if isinstance(v, list) else int(v)
        elif f.cpp_type == F.CPPTYPE_MESSAGE and not f.message_type.GetOptions().map_entry:
            obj[f.name] = [_ints(f.message_type, x) for x in v] if isinstance(v, list) else _ints(f.message_type, v)
    return obj


def _sample(t: TensorMeta, batch: int, rng: np.random.Generator) -> np.ndarray:
    """Warm-up data: random floats, zeros otherwise (zeros are valid indices, lengths and flags)."""
    shape = [d if d >= 0 else 1 for d in t.shape]
    if batch:
        shape[0] = batch
    if t.datatype == "BYTES":
        return np.full(shape, b"", dtype=np.object_)
    dtype = datatypes.numpy_dtype(t.datatype)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)
