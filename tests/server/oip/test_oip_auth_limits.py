"""The API key on both protocols (health checks open, everything else behind ``Bearer KEY``) and the body size
limit (REST 413 with the protocol's ``{"error": ...}``, gRPC RESOURCE_EXHAUSTED), with the real clients."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from oip_fixtures import grpc_, http, start, wide  # noqa: F401 (grpc_, http: fixtures)
from tritonclient.utils import InferenceServerException

from dspark.server.oip.launch import OipServer

KEY = "s3cret-key"


def auth() -> dict[str, str]:
    # A fresh dict per call (tritonclient.http adds its own headers to the dict it is given), the key in
    # lower case (gRPC metadata keys must be; HTTP header names are case-blind).
    return {"authorization": f"Bearer {KEY}"}

LIMIT = 4096  # bytes: one 1 KiB row fits, eight do not


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OipServer]:
    path = wide(tmp_path_factory.mktemp("oip-auth") / "wide.onnx")
    srv = start([{"path": str(path)}], api_key=KEY, max_body_bytes=LIMIT, metrics_port=None)
    yield srv
    srv.stop()


def _rows(n: int) -> np.ndarray:
    return np.linspace(-1, 1, n * 256, dtype=np.float32).reshape(n, 256)


def _inputs(module: Any, x: np.ndarray) -> list[Any]:
    inp = module.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return [inp]


def _fails(fn: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        fn()
    return e.value


def test_the_api_key_is_required_on_both_protocols_but_not_for_health(http: Any, grpc_: Any) -> None:
    x = _rows(1)
    assert http.is_server_live() and http.is_server_ready()  # probes need no key
    assert grpc_.is_server_live() and grpc_.is_server_ready()
    e = _fails(lambda: http.infer("wide", _inputs(httpclient, x)))
    assert e.status() == "401" and "API key" in e.message()
    e = _fails(lambda: http.infer("wide", _inputs(httpclient, x), headers={"Authorization": "Bearer wrong"}))
    assert e.status() == "401"
    assert _fails(lambda: http.get_model_metadata("wide")).status() == "401"
    e = _fails(lambda: grpc_.infer("wide", _inputs(grpcclient, x)))
    assert e.status() == "StatusCode.UNAUTHENTICATED" and "API key" in e.message()
    assert _fails(lambda: grpc_.get_model_metadata("wide")).status() == "StatusCode.UNAUTHENTICATED"

    r = http.infer("wide", _inputs(httpclient, x), headers=auth())
    np.testing.assert_array_equal(r.as_numpy("y"), np.maximum(x, 0))
    g = grpc_.infer("wide", _inputs(grpcclient, x), headers=auth())
    np.testing.assert_array_equal(g.as_numpy("y"), np.maximum(x, 0))
    assert grpc_.is_model_ready("wide", headers=auth())
    assert http.get_model_metadata("wide", headers=auth())["name"] == "wide"


def test_bodies_over_the_limit_are_refused(server: OipServer, http: Any, grpc_: Any) -> None:
    big = _rows(8)  # 8 KiB of binary data
    e = _fails(lambda: http.infer("wide", _inputs(httpclient, big), headers=auth()))
    assert e.status() == "413" and f"{LIMIT} bytes" in e.message()
    r = httpx.post(f"http://127.0.0.1:{server.http_port}/v2/models/wide/infer", content=b"x" * (LIMIT + 1),
                   headers=auth())
    assert r.status_code == 413 and set(r.json()) == {"error"}  # the protocol's error object, not OpenAI's
    e = _fails(lambda: grpc_.infer("wide", _inputs(grpcclient, big), headers=auth()))
    assert e.status() == "StatusCode.RESOURCE_EXHAUSTED"
    # The server is fine after refusing: a small request goes through.
    assert http.infer("wide", _inputs(httpclient, _rows(1)), headers=auth()).as_numpy("y").shape == (1, 256)
