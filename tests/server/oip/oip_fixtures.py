"""Shared by the OIP server tests: small ONNX models built with onnx.helper, their reference outputs (ONNX's own
ReferenceEvaluator), a server started in-process on free ports, and tritonclient's HTTP and gRPC client fixtures.

(A module of its own, not a conftest.py: tests/server has no __init__.py, so a second ``conftest`` module
would shadow tests/server/conftest.py for the tests there that import from it.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from dspark.server.oip.config import OipConfig
from dspark.server.oip.launch import OipServer

SERVER = {"host": "127.0.0.1", "port": 0, "grpc_port": 0, "metrics_port": 0, "timeout_graceful_shutdown_s": 5}


def _save(graph: Any, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def mlp(path: Path) -> Path:
    """x FP32 [batch, 4] -> Relu(x @ W + B) -> y FP32 [batch, 3]."""
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    return _save(helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "B"], ["a"]),
         helper.make_node("Relu", ["a"], ["y"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "B")]), path)


def pair(path: Path) -> Path:
    """Two inputs, two outputs: a FP32 and b INT64, both [batch, 3]; sum = a + float(b), scaled = 2a."""
    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    return _save(helper.make_graph(
        [helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT), helper.make_node("Add", ["a", "bf"], ["sum"]),
         helper.make_node("Mul", ["a", "two"], ["scaled"])], "pair",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("b", TensorProto.INT64, ["batch", 3])],
        [helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["batch", 3]),
         helper.make_tensor_value_info("scaled", TensorProto.FLOAT, ["batch", 3])], [two]), path)


def fixed(path: Path) -> Path:
    """A fixed first dim (x FP32 [2, 2] -> transpose): it cannot be batched."""
    return _save(helper.make_graph(
        [helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])], "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])]), path)


def wide(path: Path) -> Path:
    """x FP32 [batch, 256] -> Relu -> y: a row is 1 KiB, for the body size limit."""
    return _save(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 256])]), path)


def reference(path: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The outputs ONNX's reference implementation computes for ``feed``, in the model's output order."""
    return list(ReferenceEvaluator(str(path)).run(None, feed))


def start(models: list[dict[str, Any]], **server: Any) -> OipServer:
    """A server on free ports in a background thread; ``stop()`` it when done."""
    cfg = OipConfig.model_validate({"server": {**SERVER, **server}, "models": models})
    return OipServer(cfg).start(timeout=600)


def scrape(port: int) -> tuple[str, dict[str, Any]]:
    """The metrics port's text, and its families by name as prometheus-client's own parser reads them."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples with ``labels`` (the parser reads a counter's samples as NAME_total)."""
    return sum(s.value for s in families[name].samples
               if s.name in (name, f"{name}_total") and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def http(server: OipServer) -> Iterator[Any]:
    """tritonclient's HTTP client for the importing module's ``server`` fixture."""
    c = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    yield c
    c.close()


@pytest.fixture(scope="module")
def grpc_(server: OipServer) -> Iterator[Any]:
    """tritonclient's gRPC client for the importing module's ``server`` fixture."""
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    yield c
    c.close()
