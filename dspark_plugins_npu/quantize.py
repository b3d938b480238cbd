"""Quantized variants: the canonical weights (:mod:`dspark.sdk.quant`) in ONNX Runtime's own formats.

A variant's payload is a whole ONNX model (:class:`QuantPayload`) in which
every ``MatMul`` reading a 2-D float32 weight as its right operand reads the
canonical int8/int4 values instead, in one of these formats:

``matmul_nbits``
    com.microsoft ``MatMulNBits`` (bits 8 or 4): the canonical integers
    offset by the op's default zero point (2^(bits-1)) and packed along K in
    blocks. Blocks are a power of two in [16, 128] lying inside one canonical
    group, each carrying its group's scale, so any group size with such a
    divisor (and per-channel) is represented exactly. On the CPU EP the node
    asks for ``accuracy_level`` 4 (activations quantized to int8 per block of
    K inside the kernel): MLAS has no fast fp32 path for these weights on
    x86 (8-bit weights at level 0 ran ~20x slower than the float MatMul on an
    AVX2 host) and the per-block activation error is ~1% of an output's
    spread, finer than the per-token ``dynamic_int8`` reference and well
    inside the int8/int4 tolerances. ORT itself applies level 4 when it fuses
    QDQ weights into this op on the CPU.
``qdq``
    ``DequantizeLinear`` on the int8/int4 weight (per-axis, or blocked with the
    group size; opset 21 where needed) feeding the ``MatMul``: the form EPs
    such as QNN and OpenVINO fuse into their integer kernels.
``matmul_integer``
    int8 per-channel with dynamic per-token activations in standard ops
    (absmax per row / 127, round, ``MatMulInteger``, both scales), exactly
    :func:`dspark.sdk.quant.reference_linear`'s computation, for EPs without the
    contrib op. (``DynamicQuantizeMatMul`` is not used: its per-tensor uint8
    activations saturate MLAS' AVX2 u8s8 kernel with full-range int8 weights,
    errors near 1.0 were measured.)

Each EP gets the formats in its own order (:func:`formats_for`); the first
one a session on the EP accepts (strictly, off the CPU: no node may fall back)
is the variant. Importing this module imports neither onnx nor onnxruntime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dspark.sdk import QuantizedWeight, get_logger, quantizable_weights, quantize_weight, unpack_int4
from dspark.types import Device, QuantSpec
from dspark_plugins_npu import providers

if TYPE_CHECKING:
    import onnx

    from dspark.graph import Subgraph

log = get_logger("dspark_plugins_npu")

FORMATS = ("matmul_nbits", "qdq", "matmul_integer")
MIN_BLOCK, MAX_BLOCK = 16, 128  # MatMulNBits: a power of two >= 16; 128 was the fastest measured
CPU_ACCURACY_LEVEL = 4
_CONTRIB = "com.microsoft"
# EPs with ORT's own MatMulNBits kernels; the others are vendor compilers that fuse QDQ patterns.
_CONTRIB_EPS = frozenset({providers.CPU_EP, "CUDAExecutionProvider", "DmlExecutionProvider",
                          "WebGpuExecutionProvider"})


@dataclass(frozen=True)
class QuantPayload:
    """What ``dspark_compile`` needs for a variant: the quantized ONNX model and how it was made."""

    model: bytes
    format: str
    execution_provider: str
    weights: tuple[str, ...]  # the float initializers replaced
    param_bytes: int  # initializer bytes of the quantized model


def formats_for(ep: str, spec: QuantSpec) -> list[str]:
    """The formats worth trying for ``spec`` on ``ep``, best first."""
    if ep in _CONTRIB_EPS:
        order = ["matmul_nbits", "qdq", "matmul_integer"]  # EPs with ORT's contrib kernels
    else:
        order = ["qdq", "matmul_integer", "matmul_nbits"]  # NPU and vendor EPs fuse QDQ
    return [f for f in order if _applicable(f, spec)]


def _applicable(fmt: str, spec: QuantSpec) -> bool:
    if fmt == "matmul_integer":  # MatMulInteger scales per column only, after the fact
        return spec.weight_bits == 8 and spec.granularity == "per_channel" and spec.activations == "dynamic_int8"
    return True


def quantize(subgraph: Subgraph, device: Device, spec: QuantSpec, plugin: str,
             accepts: Callable[[Subgraph], bool]) -> Subgraph | None:
    """The variant of ``subgraph`` for ``device``'s EP, or None when no format fits (never raises).

    ``accepts(variant)`` says whether the EP runs the variant (a real session,
    strict off the CPU); the first format it accepts wins.
    """
    if subgraph.quantized_by is not None or "execution_provider" not in device.properties:
        return None
    if not spec.symmetric:
        return None  # the canonical layouts are symmetric; an asymmetric request is not what we would run
    ep = str(device.properties["execution_provider"])
    if not _targets(subgraph):
        return None
    level = CPU_ACCURACY_LEVEL if ep == providers.CPU_EP else 0
    qweights: dict[str, QuantizedWeight] = {}
    for fmt in formats_for(ep, spec):
        try:
            built = build_model(subgraph, spec, fmt, accuracy_level=level, cache=qweights)
        except Exception as exc:  # e.g. the opset cannot be converted for blocked QDQ: try the next format
            log.info("quantize.format_failed", ep=ep, format=fmt, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            built = None
        if built is None:
            continue
        model, replaced, param_bytes = built
        payload = QuantPayload(model=model, format=fmt, execution_provider=ep, weights=replaced,
                               param_bytes=param_bytes)
        variant = subgraph.model_copy(update={"quantized_by": plugin, "quant_spec": spec, "payload": payload})
        if accepts(variant):
            return variant
    return None


def _targets(subgraph: Subgraph) -> dict[str, list[int]]:
    """Quantizable weight -> indices (in ``subgraph.ops``) of the MatMul nodes reading it as B."""
    names = set(quantizable_weights(subgraph))
    tensors = subgraph.graph.tensors
    out: dict[str, list[int]] = {}
    for i, op in enumerate(subgraph.ops):
        if op.op_type != "MatMul" or op.domain not in ("", "ai.onnx") or op.inputs[1] not in names:
            continue
        a = tensors.get(op.inputs[0])
        if a is not None and len(a.shape) < 2:
            continue  # a vector times a matrix: MatMulNBits wants rows
        out.setdefault(op.inputs[1], []).append(i)
    return out


# -- building the quantized model ---------------------------------------------------------------


def build_model(subgraph: Subgraph, spec: QuantSpec, fmt: str, *, accuracy_level: int = 0,
                cache: dict[str, QuantizedWeight] | None = None) -> tuple[bytes, tuple[str, ...], int] | None:
    """(serialized model, replaced weight names, initializer bytes) in format ``fmt``; None if it does not fit."""
    from onnx import helper, version_converter

    from dspark_plugins_npu.export import to_model

    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; known: {', '.join(FORMATS)}")
    targets = _targets(subgraph)
    if not targets or not _applicable(fmt, spec):
        return None
    cache = {} if cache is None else cache
    for w in targets:
        if w not in cache:  # one canonical quantization per weight, shared by the formats tried
            cache[w] = quantize_weight(subgraph.graph.initializers[w], spec)
    qws = {w: cache[w] for w in targets}
    model = to_model(subgraph)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    need = _opset_needed(fmt, qws)
    if opset < need:
        model = version_converter.convert_version(model, need)
        model.ir_version = 10  # the converter stamps its own newest IR; ORT reads 10 for opset 21
    opset = max(opset, need)
    g = model.graph
    by_output = {n.output[0]: i for i, n in enumerate(g.node)}
    new_inits: list[onnx.TensorProto] = []
    replacements: dict[int, list[onnx.NodeProto]] = {}
    for w, op_indices in targets.items():
        inits, make = _FORMAT_BUILDERS[fmt](w, qws[w], accuracy_level, opset)
        if make is None:
            return None
        new_inits.extend(inits)
        for i in op_indices:
            op = subgraph.ops[i]
            pos = by_output[op.outputs[0]]
            replacements[pos] = make(op.inputs[0], op.outputs[0], f"{op.name or w}_{i}")
    nodes = []
    for pos, node in enumerate(g.node):
        nodes.extend(replacements.get(pos, [node]))
    del g.node[:]
    g.node.extend(nodes)
    used = {t for n in g.node for t in n.input}
    kept = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(kept + new_inits)
    if any(n.domain == _CONTRIB for n in g.node) and all(o.domain != _CONTRIB for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_CONTRIB, 1))
    param_bytes = sum(_tensor_bytes(t) for t in g.initializer)
    return model.SerializeToString(), tuple(targets), param_bytes


def _opset_needed(fmt: str, qws: dict[str, QuantizedWeight]) -> int:
    if fmt == "qdq":
        blocked = any(q.scales.shape[0] > 1 for q in qws.values())
        return 21 if blocked or any(q.bits == 4 for q in qws.values()) else 13
    return 13 if fmt == "matmul_integer" else 1  # ReduceMax/Clip/Round with inputs; contrib ops need nothing


def _tensor_bytes(t: onnx.TensorProto) -> int:
    if t.raw_data:
        return len(t.raw_data)
    from onnx import numpy_helper

    return int(numpy_helper.to_array(t).nbytes)


def _int_values(qw: QuantizedWeight) -> np.ndarray:
    """The canonical integers as int8 [K, N]."""
    return unpack_int4(qw.data, qw.shape[0]) if qw.bits == 4 else qw.data


NodeMaker = Callable[[str, str, str], list[Any]]
Builder = Callable[[str, QuantizedWeight, int, int], tuple[list[Any], NodeMaker | None]]


def nbits_block(qw: QuantizedWeight) -> int | None:
    """The MatMulNBits block size for ``qw``: a power of two in [16, 128] inside one canonical group."""
    k = qw.shape[0]
    if qw.scales.shape[0] == 1:  # one scale per column: any block works; the smallest covering K if K is small
        block = MIN_BLOCK
        while block < MAX_BLOCK and block < k:
            block *= 2
        return block
    for block in (128, 64, 32, 16):
        if block <= MAX_BLOCK and qw.group_size % block == 0:
            return block
    return None


def pack_matmul_nbits(qw: QuantizedWeight, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(B uint8 [N, k_blocks, block * bits / 8], scales float32 [N, k_blocks]) in MatMulNBits' layout.

    Values are stored as q + 2^(bits-1), the op's zero point when none is
    given; 4-bit pairs along K go low nibble first. Padding past K dequantizes
    to 0.
    """
    k, n = qw.shape
    blocks = -(-k // block)
    offset = 1 << (qw.bits - 1)
    u = np.full((blocks * block, n), offset, dtype=np.uint8)
    u[:k] = (_int_values(qw).astype(np.int16) + offset).astype(np.uint8)
    u = u.T.reshape(n, blocks, block)
    packed = (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8) if qw.bits == 4 else u
    group_of_block = (np.arange(blocks) * block) // qw.group_size
    scales = np.ascontiguousarray(qw.scales[group_of_block].T, dtype=np.float32)  # [N, k_blocks]
    return np.ascontiguousarray(packed), scales


def _matmul_nbits(w: str, qw: QuantizedWeight, accuracy_level: int, opset: int) -> tuple[list[Any], NodeMaker | None]:
    from onnx import helper, numpy_helper

    block = nbits_block(qw)
    if block is None:
        return [], None
    packed, scales = pack_matmul_nbits(qw, block)
    k, n = qw.shape
    inits = [numpy_helper.from_array(packed, f"{w}_q{qw.bits}"), numpy_helper.from_array(scales, f"{w}_scales")]
    attrs: dict[str, Any] = {"K": k, "N": n, "bits": qw.bits, "block_size": block}
    if accuracy_level:
        attrs["accuracy_level"] = accuracy_level

    def make(a: str, y: str, name: str) -> list[Any]:
        return [helper.make_node("MatMulNBits", [a, f"{w}_q{qw.bits}", f"{w}_scales"], [y], name=name,
                                 domain=_CONTRIB, **attrs)]

    return inits, make


def _int4_tensor(name: str, q: np.ndarray) -> Any:
    """An ONNX INT4 tensor: row-major elements, two per byte, low nibble first."""
    from onnx import TensorProto, helper

    flat = (q.reshape(-1) & 0x0F).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    raw = (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8).tobytes()
    return helper.make_tensor(name, TensorProto.INT4, list(q.shape), vals=raw, raw=True)


def _qdq(w: str, qw: QuantizedWeight, accuracy_level: int, opset: int) -> tuple[list[Any], NodeMaker | None]:
    from onnx import helper, numpy_helper

    q = _int_values(qw)
    qname, sname, deq = f"{w}_q{qw.bits}", f"{w}_scales", f"{w}_dequantized"
    wt = _int4_tensor(qname, q) if qw.bits == 4 else numpy_helper.from_array(np.ascontiguousarray(q), qname)
    attrs: dict[str, Any]
    if qw.scales.shape[0] == 1:  # per output channel: per-axis on N
        scales, attrs = qw.scales.reshape(-1), {"axis": 1}
    else:  # per group of K rows: blocked on K
        scales, attrs = qw.scales, {"axis": 0, "block_size": qw.group_size}
    inits = [wt, numpy_helper.from_array(np.ascontiguousarray(scales, dtype=np.float32), sname)]
    emitted: list[bool] = []

    def make(a: str, y: str, name: str) -> list[Any]:
        nodes = [] if emitted else [helper.make_node("DequantizeLinear", [qname, sname], [deq], name=f"{w}_dq",
                                                     **attrs)]
        emitted.append(True)  # one DequantizeLinear per weight, however many MatMuls read it
        return nodes + [helper.make_node("MatMul", [a, deq], [y], name=name)]

    return inits, make


def _matmul_integer(w: str, qw: QuantizedWeight, accuracy_level: int, opset: int) -> tuple[list[Any], NodeMaker | None]:
    from onnx import TensorProto, helper, numpy_helper

    if qw.bits != 8 or qw.scales.shape[0] != 1:
        return [], None
    c = {"q": f"{w}_q8", "s": f"{w}_scales", "eps": f"{w}_eps", "qmax": f"{w}_127", "lo": f"{w}_lo",
         "axes": f"{w}_axes"}
    inits = [numpy_helper.from_array(np.ascontiguousarray(qw.data), c["q"]),
             numpy_helper.from_array(qw.scales.reshape(-1).astype(np.float32), c["s"]),
             numpy_helper.from_array(np.array(1e-30, np.float32), c["eps"]),  # an all-zero row stays zero
             numpy_helper.from_array(np.array(127.0, np.float32), c["qmax"]),
             numpy_helper.from_array(np.array(-127.0, np.float32), c["lo"]),
             numpy_helper.from_array(np.array([-1], np.int64), c["axes"])]

    def make(a: str, y: str, name: str) -> list[Any]:
        t = {k: f"{name}_{k}" for k in ("abs", "max", "max1", "scale", "xs", "xr", "xc", "xq", "acc", "accf", "yw")}
        reduce = (helper.make_node("ReduceMax", [t["abs"], c["axes"]], [t["max"]], keepdims=1) if opset >= 18
                  else helper.make_node("ReduceMax", [t["abs"]], [t["max"]], axes=[-1], keepdims=1))
        return [
            helper.make_node("Abs", [a], [t["abs"]]),
            reduce,
            helper.make_node("Max", [t["max"], c["eps"]], [t["max1"]]),
            helper.make_node("Div", [t["max1"], c["qmax"]], [t["scale"]]),  # per-token scale, as the reference
            helper.make_node("Div", [a, t["scale"]], [t["xs"]]),
            helper.make_node("Round", [t["xs"]], [t["xr"]]),  # half to even, like numpy's rint
            helper.make_node("Clip", [t["xr"], c["lo"], c["qmax"]], [t["xc"]]),
            helper.make_node("Cast", [t["xc"]], [t["xq"]], to=TensorProto.INT8),
            helper.make_node("MatMulInteger", [t["xq"], c["q"]], [t["acc"]], name=name),
            helper.make_node("Cast", [t["acc"]], [t["accf"]], to=TensorProto.FLOAT),
            helper.make_node("Mul", [t["accf"], c["s"]], [t["yw"]]),
            helper.make_node("Mul", [t["yw"], t["scale"]], [y]),
        ]

    return inits, make


_FORMAT_BUILDERS: dict[str, Builder] = {"matmul_nbits": _matmul_nbits, "qdq": _qdq, "matmul_integer": _matmul_integer}
