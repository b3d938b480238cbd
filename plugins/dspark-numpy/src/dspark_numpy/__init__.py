"""dspark-plugin-numpy: a small NumPy backend, and the template for a third-party plugin.

It drives the host CPU with plain NumPy kernels for a dozen float32 ops. It
bids only on subgraphs it can run whole, computes a roofline cost from a
measured (and cached) matmul peak, and compiles a subgraph into an object
that runs its ops in order. Everything a plugin needs for graphs is in this one
file; :mod:`dspark_numpy.decoder` adds an LLM decoder the way a vendor adds one,
by implementing the ops of dspark's one decoder definition (API 1.10).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from dspark import hookimpl
from dspark.graph import Op, Subgraph
from dspark.sdk import cache, calibration, hostinfo, time_call
from dspark.sdk.decoder import DecoderSpec
from dspark.types import Bid, DecoderBid, Device
from dspark_numpy import decoder as _decoder
from dspark_numpy.blas import one_blas_thread

__version__ = "0.1.0"
DSPARK_API_VERSION = "1.10"  # the plugin contract this was written against (dspark.sdk.family)

RUNTIME = "numpy"
_OP_OVERHEAD_S = 2e-6  # per-op Python dispatch; a guess the roofline adds to each op
_CACHE_NS = "dspark_numpy"

Kernel = Callable[[dict[str, Any], list[Any]], Any]


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # The tanh form never overflows, unlike 1 / (1 + exp(-x)) for large negative x.
    out: np.ndarray = np.float32(0.5) * (np.float32(1.0) + np.tanh(np.float32(0.5) * x))
    return out


def _softmax(a: dict[str, Any], x: list[Any]) -> np.ndarray:
    axis = int(a.get("axis", -1))
    src: np.ndarray = x[0]
    e: np.ndarray = np.exp(src - src.max(axis=axis, keepdims=True))  # shifted: exp cannot overflow
    out: np.ndarray = e / e.sum(axis=axis, keepdims=True)
    return out


def _gemm(a: dict[str, Any], x: list[Any]) -> np.ndarray:
    lhs: np.ndarray = x[0].T if a.get("transA") else x[0]
    rhs: np.ndarray = x[1].T if a.get("transB") else x[1]
    out: np.ndarray = np.float32(a.get("alpha", 1.0)) * (lhs @ rhs)
    if len(x) > 2 and x[2] is not None:
        out = out + np.float32(a.get("beta", 1.0)) * x[2]
    return out


def _reshape(a: dict[str, Any], x: list[Any]) -> np.ndarray:
    data: np.ndarray = x[0]
    shape = [int(d) for d in x[1]]
    if not a.get("allowzero", 0):  # ONNX: a 0 copies the input's dim at that position
        shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return data.reshape(shape)


def _transpose(a: dict[str, Any], x: list[Any]) -> np.ndarray:
    perm = a.get("perm")
    return np.transpose(x[0], [int(p) for p in perm] if perm is not None else None)


KERNELS: dict[str, Kernel] = {
    "Add": lambda a, x: x[0] + x[1],
    "Sub": lambda a, x: x[0] - x[1],
    "Mul": lambda a, x: x[0] * x[1],
    "Div": lambda a, x: x[0] / x[1],
    "Relu": lambda a, x: np.maximum(x[0], np.float32(0)),
    "Sigmoid": lambda a, x: _sigmoid(x[0]),
    "Tanh": lambda a, x: np.tanh(x[0]),
    "MatMul": lambda a, x: np.matmul(x[0], x[1]),
    "Gemm": _gemm,
    "Softmax": _softmax,
    "Transpose": _transpose,
    "Reshape": _reshape,
}


def _unsupported(subgraph: Subgraph) -> str | None:
    """Why these kernels cannot run ``subgraph`` exactly, or None when they can."""
    tensors = subgraph.graph.tensors
    for op in subgraph.ops:
        if op.domain not in ("", "ai.onnx") or op.op_type not in KERNELS:
            return f"no kernel for {op.op_type}"
        if op.op_type == "Softmax" and subgraph.graph.opset < 13:
            return "Softmax before opset 13 flattens its input; not implemented"
        for i, t in enumerate(op.inputs + op.outputs):
            if not t:
                continue
            spec = tensors.get(t)
            want = "int64" if op.op_type == "Reshape" and i == 1 else "float32"
            if spec is None or spec.dtype != want:
                return f"{op.op_type} tensor {t!r} is {spec.dtype if spec else 'untyped'}, kernels need {want}"
    return None


def _peak_flops(refresh: bool) -> float:
    """float32 matmul throughput of this host with this NumPy build, measured once and cached."""
    key = {"bench": "numpy-matmul-v2-one-thread", "numpy": np.__version__, **hostinfo.fingerprint()}
    if not refresh and (hit := cache.load(_CACHE_NS, key)) is not None:
        return float(hit)
    n = 256
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    with one_blas_thread():
        seconds = time_call(lambda: a @ b, warmup=2, repeat=7, budget_s=0.3)
    value = 2.0 * n**3 / max(seconds, 1e-9)
    cache.store(_CACHE_NS, key, value)
    return value


@hookimpl
def dspark_probe_devices(refresh: bool) -> list[Device]:
    info = hostinfo.cpu_static()
    total, free = hostinfo.memory()
    return [Device(
        id="cpu", kind="cpu", name=info["model"], runtime=RUNTIME,
        memory_total_bytes=total, memory_free_bytes=free,
        peak_flops={"float32": _peak_flops(refresh)},
        memory_bandwidth_bytes_per_s=hostinfo.memory_bandwidth(refresh),
        dtypes=["float32"],
        utilization=hostinfo.cpu_utilization(),
        properties={"numpy_version": np.__version__},
    )]


@hookimpl
def dspark_bid(subgraph: Subgraph, device: Device) -> Bid | None:
    # Abstain on anything not runnable whole, and on variants another plugin
    # quantized: their payload is in a layout only that plugin knows.
    if device.kind != "cpu" or subgraph.quantized_by is not None or _unsupported(subgraph):
        return None
    # Time the subgraph compiled as dspark_compile does it (once per machine, cached on disk);
    # where it cannot be timed, a roofline from the measured peak.
    est = calibration.estimate(subgraph, device, runtime_key=f"{RUNTIME} {np.__version__}",
                               compile=lambda sg: dspark_compile(sg, device), op_overhead_s=_OP_OVERHEAD_S)
    return Bid(device_id=device.id, runtime=RUNTIME, latency_s=est.latency_s, precision="float32",
               peak_memory_bytes=subgraph.param_bytes + subgraph.io_bytes(),
               fixed_overhead_s=est.fixed_overhead_s, source=est.source, note=est.note)


class NumpyExecutable:
    """A subgraph's ops in topological order, with weights bound once."""

    def __init__(self, subgraph: Subgraph) -> None:
        self.inputs = list(subgraph.inputs)
        self.outputs = list(subgraph.outputs)
        inits = subgraph.graph.initializers
        self.weights = {name: np.asarray(inits[name]) for name in subgraph.params}
        self.steps: list[tuple[Op, Kernel]] = [(op, KERNELS[op.op_type]) for op in subgraph.ops]

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with one_blas_thread():
            return self._run(inputs)

    def _run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        env: dict[str, Any] = dict(self.weights)
        for name in self.inputs:
            env[name] = np.asarray(inputs[name])
        for op, kernel in self.steps:
            # np.asarray: reductions can hand back NumPy scalars; the contract wants arrays.
            env[op.outputs[0]] = np.asarray(kernel(op.attrs, [env[t] if t else None for t in op.inputs]))
        return {name: env[name] for name in self.outputs}


@hookimpl
def dspark_compile(subgraph: Subgraph, device: Device) -> NumpyExecutable | None:
    if subgraph.quantized_by is not None or _unsupported(subgraph):
        return None
    return NumpyExecutable(subgraph)


@hookimpl
def dspark_decoder_bid(decoder: DecoderSpec, device: Device) -> DecoderBid | None:
    return _decoder.decoder_bid(decoder, device)


@hookimpl
def dspark_compile_decoder(decoder: DecoderSpec, device: Device) -> _decoder.NumpyDecoder | None:
    return _decoder.compile_decoder(decoder, device)


__all__ = ["DSPARK_API_VERSION", "KERNELS", "NumpyExecutable", "dspark_bid", "dspark_compile",
           "dspark_compile_decoder", "dspark_decoder_bid", "dspark_probe_devices"]
