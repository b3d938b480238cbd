"""``dspark_quantize`` for OpenVINO's CPU plugin: linears with compressed weights.

Each quantized MatMul weight is rebuilt in the pattern NNCF's
``compress_weights`` emits, which OpenVINO's CPU plugin fuses into a
FullyConnected that reads the int8/int4 weights directly (decompressing in
registers, never a float copy):

* per channel: ``Constant [N, K] -> Convert(f32) -> Multiply(scale [N, 1])``;
* group-wise: ``Constant [N, G, g] -> Convert -> Multiply(scale [N, G, 1]) ->
  Reshape [N, G*g]``;

then ``MatMul(x, W, transpose_b=True)``. Scales stay float32 (NNCF uses f16):
the canonical scales are float32, so the result matches the reference to
float32 rounding. When K is not a multiple of the group, the weight is padded
with zeros to ``G*g`` and so is ``x`` (a Pad before the MatMul). int4 rows
must hold an even number of values: OpenVINO 2026.4 computes wrong results
for an odd K per channel once x has more than one row (so K is padded to
even), and an odd group size has no kernel here.

Activations: ``DYNAMIC_QUANTIZATION_GROUP_SIZE`` (0 keeps them float, which
is what a ``"float"`` spec promises; its default, 32, would quantize them on
VNNI CPUs). ``"dynamic_int8"`` sets it to per token (``UINT64_MAX``), the
canonical reference's scheme; OpenVINO's x86 CPU plugin only does that with
AVX2-VNNI or AVX-512-VNNI (it silently computes float otherwise), so on
other CPUs the spec has no kernel here and :func:`quantize` returns None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dspark.graph import Subgraph
from dspark.sdk import QuantizedWeight, quantizable_weights, quantize_weight, unpack_int4
from dspark.types import Device, QuantSpec
from dspark_plugins_cpu import runtime, support

PLUGIN_NAME = "cpu"
PER_TOKEN = 2**64 - 1  # DYNAMIC_QUANTIZATION_GROUP_SIZE meaning one group per row
# What the CPU plugin needs for dynamic quantization of activations (hostinfo ISA names).
_VNNI_FEATURES = frozenset({"avx_vnni", "avx512_vnni", "amx_int8"})


@dataclass(frozen=True)
class OVWeight:
    """One weight in OpenVINO's compressed layout (what the compiled FullyConnected reads)."""

    data: np.ndarray  # int8 [N, K_pad] (8 bits, per channel) or [N, G, g]; int4 as packed uint8 bytes
    shape: tuple[int, ...]  # the Constant's shape
    bits: int
    scales: np.ndarray  # float32 [N, 1] or [N, G, 1]
    k: int  # K of the float weight (rows of the canonical [K, N])
    k_pad: int  # K the MatMul reads; x is zero-padded when it is larger

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scales.nbytes)


def unsupported_reason(device: Device, spec: QuantSpec) -> str | None:
    """None when this plugin has a kernel for ``spec`` on ``device``, else why not."""
    ov_name = runtime.ov_device(device)
    if not ov_name.startswith("CPU"):
        return f"compressed-weight kernels are only used on the CPU here, not {ov_name}"
    if spec.activations == "dynamic_int8" and not _VNNI_FEATURES & set(device.properties.get("isa_features") or []):
        return ("OpenVINO quantizes activations dynamically only on CPUs with AVX2-VNNI or AVX-512-VNNI; "
                f"this one has {device.properties.get('isa_features')}")
    return None


def dq_group_size(spec: QuantSpec) -> int:
    """The compile property for ``spec``'s activations: 0 (float) or per token."""
    return PER_TOKEN if spec.activations == "dynamic_int8" else 0


def quantize(subgraph: Subgraph, device: Device, spec: QuantSpec) -> Subgraph | None:
    if unsupported_reason(device, spec) is not None:
        return None
    names = quantizable_weights(subgraph)
    if not names or support.unsupported_reason(subgraph, runtime.ov_device(device)) is not None:
        return None
    inits = subgraph.graph.initializers
    if spec.weight_bits == 4 and spec.granularity == "group" and spec.group_size % 2 and \
            any(inits[n].shape[0] > spec.group_size for n in names):
        return None  # odd int4 groups: see the module notes
    payload = {n: to_openvino(quantize_weight(inits[n], spec)) for n in names}
    return subgraph.model_copy(update={"quantized_by": PLUGIN_NAME, "quant_spec": spec, "payload": payload})


def to_openvino(qw: QuantizedWeight) -> OVWeight:
    """The canonical [K, N] quantized weight in OpenVINO's [N, K] compressed layout."""
    k, n = qw.shape
    groups = qw.scales.shape[0]
    group = qw.group_size
    k_pad = groups * group if groups > 1 else k + (k % 2 if qw.bits == 4 else 0)
    q = unpack_int4(qw.data, k) if qw.bits == 4 else qw.data
    rows = np.zeros((n, k_pad), dtype=np.int8)
    rows[:, :k] = q.T
    if groups > 1:
        shape: tuple[int, ...] = (n, groups, group)
        scales = np.ascontiguousarray(qw.scales.T[:, :, None], dtype=np.float32)
    else:
        shape = (n, k_pad)
        scales = np.ascontiguousarray(qw.scales.T, dtype=np.float32)
    if qw.bits == 8:
        return OVWeight(rows.reshape(shape), shape, 8, scales, k, k_pad)
    flat = rows.reshape(-1)
    if flat.size % 2:
        flat = np.append(flat, np.int8(0))
    nib = (flat & 0x0F).astype(np.uint8)
    packed = nib[0::2] | (nib[1::2] << 4)  # OpenVINO's i4: two per byte, low nibble first
    return OVWeight(packed, shape, 4, scales, k, k_pad)


def build_model(subgraph: Subgraph) -> Any:
    """The variant as an ``ov.Model``: the float model with each quantized MatMul weight replaced
    by its compressed-weight pattern."""
    import openvino as ov
    import openvino.opset13 as ops

    model = support.read_model(subgraph)
    weights: dict[str, OVWeight] = subgraph.payload
    consts = {op.get_friendly_name(): op for op in model.get_ops() if op.get_type_name() == "Constant"}
    for name, w in weights.items():
        const = consts.get(name)
        if const is None:
            raise KeyError(f"OpenVINO's model of {subgraph.graph.name!r} has no constant {name!r}")
        decompressed = _decompression(ov, ops, name, w)
        replaced = 0
        for target in list(const.output(0).get_target_inputs()):
            node = target.get_node()
            if node.get_type_name() != "MatMul" or target.get_index() != 1 or node.get_transpose_b():
                continue  # another use of the weight keeps the float constant
            x = node.input_value(0)
            if w.k_pad != w.k:  # zero columns of x meet the weight's zero padding
                rank = x.get_partial_shape().rank.get_length()
                pads_end = np.zeros(rank, np.int64)
                pads_end[rank - 2 if node.get_transpose_a() else rank - 1] = w.k_pad - w.k
                x = ops.pad(x, np.zeros(rank, np.int64), pads_end, "constant", np.array(0, np.float32)).output(0)
            matmul = ops.matmul(x, decompressed, node.get_transpose_a(), True)
            matmul.set_friendly_name(node.get_friendly_name())
            node.output(0).replace(matmul.output(0))
            replaced += 1
        if not replaced:
            raise ValueError(f"OpenVINO's model of {subgraph.graph.name!r} reads {name!r} through no MatMul: "
                             "the quantized weight would not be used")
    model.validate_nodes_and_infer_types()
    return model


def _decompression(ov: Any, ops: Any, name: str, w: OVWeight) -> Any:
    if w.bits == 4:
        # A tensor that owns its bytes: the CPU plugin may read the constant after compile_model
        # returns (weights are repacked on first use), when the payload may be gone.
        tensor = ov.Tensor(ov.Type.i4, ov.Shape(list(w.shape)))
        tensor.data[:] = w.data.view(np.int8)
        const = ops.constant(tensor)
    else:
        const = ops.constant(w.data, dtype=ov.Type.i8)
    const.set_friendly_name(f"{name}/compressed")
    weight = ops.multiply(ops.convert(const, ov.Type.f32), ops.constant(w.scales))
    if len(w.shape) == 3:
        weight = ops.reshape(weight, ops.constant(np.array([w.shape[0], w.k_pad], np.int64)), False)
    return weight.output(0)
