"""The Open Inference Protocol server end to end, driven by NVIDIA's own clients (tritonclient.http and
tritonclient.grpc, unmodified): health, metadata, config, inference in JSON and binary, several models,
errors naming what is wrong, dynamic batching across both protocols, statistics, Triton's metric names.

One server (three models) is shared by the module, in-process on free ports.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from oip_fixtures import grpc_, http, mlp, pair, reference, sample, scrape, start  # noqa: F401 (grpc_, http: fixtures)
from tritonclient.utils import InferenceServerException

from dspark.server.oip.launch import OipServer
from dspark.server.oip.metrics import METRIC_NAMES

DELAY_US = 5_000_000  # mlp_dyn's max_queue_delay: far longer than the concurrent requests take to arrive
DOCS = Path(__file__).resolve().parents[3] / "docs" / "serving-models.md"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("oip-models")
    return {"mlp": mlp(d / "mlp.onnx"), "pair": pair(d / "pair.onnx")}


@pytest.fixture(scope="module")
def server(models: dict[str, Path]) -> Iterator[OipServer]:
    srv = start([
        {"name": "mlp", "path": str(models["mlp"]), "max_batch_size": 8},
        {"name": "mlp_dyn", "path": str(models["mlp"]), "max_batch_size": 8,
         "dynamic_batching": {"max_queue_delay_microseconds": DELAY_US}},
        {"name": "pair", "path": str(models["pair"])},
    ])
    yield srv
    srv.stop()


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 4)).astype(np.float32)


def _fails(fn: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        fn()
    return e.value


def _http_input(name: str, arr: np.ndarray, datatype: str, binary: bool = True) -> Any:
    inp = httpclient.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr, binary_data=binary)
    return inp


def _grpc_input(name: str, arr: np.ndarray, datatype: str) -> Any:
    inp = grpcclient.InferInput(name, list(arr.shape), datatype)
    inp.set_data_from_numpy(arr)
    return inp


def test_health_metadata_and_config_on_both_protocols(http: Any, grpc_: Any) -> None:
    assert http.is_server_live() and http.is_server_ready()
    assert grpc_.is_server_live() and grpc_.is_server_ready()
    for name in ("mlp", "mlp_dyn", "pair"):
        assert http.is_model_ready(name) and grpc_.is_model_ready(name)
    assert not http.is_model_ready("nope") and not grpc_.is_model_ready("nope")
    meta = http.get_server_metadata()
    assert meta["name"] == "dspark" and "binary_tensor_data" in meta["extensions"]
    assert grpc_.get_server_metadata().name == "dspark"

    assert http.get_model_metadata("mlp") == {
        "name": "mlp", "versions": ["1"], "platform": "onnx_onnxv1",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]}
    assert http.get_model_metadata("mlp", model_version="1")["name"] == "mlp"
    gmd = grpc_.get_model_metadata("pair")
    assert [(t.name, t.datatype, list(t.shape)) for t in gmd.inputs] == [("a", "FP32", [-1, 3]),
                                                                          ("b", "INT64", [-1, 3])]
    assert [t.name for t in gmd.outputs] == ["sum", "scaled"]

    cfg = http.get_model_config("mlp_dyn")
    assert cfg["name"] == "mlp_dyn" and cfg["max_batch_size"] == 8
    assert cfg["input"] == [{**cfg["input"][0], "name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == DELAY_US
    gcfg = grpc_.get_model_config("mlp").config
    assert gcfg.max_batch_size == 8 and list(gcfg.output[0].dims) == [3]
    assert not gcfg.HasField("dynamic_batching")
    assert grpc_.get_model_config("pair").config.max_batch_size == 0


def test_http_infer_json_and_binary_tensor_data(http: Any, models: dict[str, Path]) -> None:
    x = _x(3)
    (want,) = reference(models["mlp"], {"x": x})
    for binary_in in (False, True):
        for binary_out in (False, True):
            rid = f"req-{binary_in}-{binary_out}"
            r = http.infer("mlp", [_http_input("x", x, "FP32", binary_in)], request_id=rid,
                           outputs=[httpclient.InferRequestedOutput("y", binary_data=binary_out)])
            np.testing.assert_allclose(r.as_numpy("y"), want, rtol=1e-5, atol=1e-6)
            resp = r.get_response()
            assert resp["id"] == rid and resp["model_name"] == "mlp" and resp["model_version"] == "1"
            out = resp["outputs"][0]
            assert out["shape"] == [3, 3] and out["datatype"] == "FP32"
            assert ("data" in out) == (not binary_out)
            assert (out.get("parameters", {}).get("binary_data_size") == want.nbytes) == binary_out
    # No outputs named: tritonclient asks for all of them as binary data (binary_data_output).
    r = http.infer("mlp", [_http_input("x", x, "FP32")])
    np.testing.assert_allclose(r.as_numpy("y"), want, rtol=1e-5, atol=1e-6)
    # A gzip-compressed request body (tritonclient's request_compression_algorithm).
    r = http.infer("mlp", [_http_input("x", x, "FP32", False)], request_compression_algorithm="gzip")
    np.testing.assert_allclose(r.as_numpy("y"), want, rtol=1e-5, atol=1e-6)


def test_two_inputs_of_two_dtypes_and_a_chosen_output(http: Any, grpc_: Any, models: dict[str, Path]) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3) / 3
    b = np.array([[1, -2, 3], [40, 50, -60]], dtype=np.int64)
    want_sum, want_scaled = reference(models["pair"], {"a": a, "b": b})
    r = http.infer("pair", [_http_input("a", a, "FP32", False), _http_input("b", b, "INT64", True)],
                   outputs=[httpclient.InferRequestedOutput("scaled", binary_data=False)])
    assert [o["name"] for o in r.get_response()["outputs"]] == ["scaled"]
    np.testing.assert_allclose(r.as_numpy("scaled"), want_scaled)
    g = grpc_.infer("pair", [_grpc_input("a", a, "FP32"), _grpc_input("b", b, "INT64")])
    np.testing.assert_allclose(g.as_numpy("sum"), want_sum)
    np.testing.assert_allclose(g.as_numpy("scaled"), want_scaled)


def test_grpc_infer_raw_and_typed_contents(grpc_: Any, server: OipServer, models: dict[str, Path]) -> None:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    x = _x(2, seed=1)
    (want,) = reference(models["mlp"], {"x": x})
    r = grpc_.infer("mlp", [_grpc_input("x", x, "FP32")], request_id="g-1")  # raw_input_contents
    np.testing.assert_allclose(r.as_numpy("y"), want, rtol=1e-5, atol=1e-6)
    assert r.get_response().id == "g-1" and r.get_response().model_name == "mlp"
    # Typed contents (fp32_contents), sent with tritonclient's own generated stub: outputs come back raw.
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        req = service_pb2.ModelInferRequest(model_name="mlp")
        inp = req.inputs.add(name="x", datatype="FP32", shape=[2, 4])
        inp.contents.fp32_contents.extend(x.ravel().tolist())
        resp = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
    assert [(o.name, o.datatype, list(o.shape)) for o in resp.outputs] == [("y", "FP32", [2, 3])]
    np.testing.assert_allclose(np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(2, 3), want,
                               rtol=1e-5, atol=1e-6)


def test_errors_name_the_input_and_the_shapes(http: Any, grpc_: Any) -> None:
    x = _x(1)
    e = _fails(lambda: http.infer("nope", [_http_input("x", x, "FP32")]))
    assert e.status() == "404" and "nope" in e.message()
    e = _fails(lambda: grpc_.infer("nope", [_grpc_input("x", x, "FP32")]))
    assert e.status() == "StatusCode.NOT_FOUND" and "nope" in e.message()
    e = _fails(lambda: http.get_model_metadata("nope"))
    assert e.status() == "404"

    cases: list[tuple[str, np.ndarray, str, list[str]]] = [
        ("x", x.astype(np.float64), "FP64", ["'x'", "FP64", "FP32"]),  # dtype
        ("x", np.zeros((2, 5), np.float32), "FP32", ["'x'", "[2, 5]", "[-1, 4]"]),  # a non-batch dim
        ("x", np.zeros((9, 4), np.float32), "FP32", ["'x'", "9", "max_batch_size 8"]),  # batch too large
        ("z", x, "FP32", ["unknown input 'z'", "['x']"]),  # name
    ]
    for name, arr, datatype, words in cases:
        for client, make, status in ((http, _http_input, "400"), (grpc_, _grpc_input, "StatusCode.INVALID_ARGUMENT")):
            e = _fails(lambda: client.infer("mlp", [make(name, arr, datatype)]))
            assert e.status() == status, e
            assert all(w in e.message() for w in words), (words, e.message())
    e = _fails(lambda: http.infer("pair", [_http_input("a", np.zeros((1, 3), np.float32), "FP32")]))
    assert e.status() == "400" and "['b']" in e.message()
    e = _fails(lambda: grpc_.infer("mlp", [_grpc_input("x", x, "FP32")],
                                   outputs=[grpcclient.InferRequestedOutput("nope")]))
    assert e.status() == "StatusCode.INVALID_ARGUMENT" and "unknown output 'nope'" in e.message()


def test_raw_bodies_malformed_requests_and_unknown_routes(server: OipServer, models: dict[str, Path]) -> None:
    base = f"http://127.0.0.1:{server.http_port}"
    x = _x(1, seed=2)
    (want,) = reference(models["mlp"], {"x": x})
    # Raw binary request (Inference-Header-Content-Length: 0): the body is the one input; batch-1; binary out.
    r = httpx.post(f"{base}/v2/models/mlp/infer", content=x.tobytes(),
                   headers={"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    header = json.loads(r.content[:n])
    assert header["outputs"][0]["shape"] == [1, 3]
    np.testing.assert_allclose(np.frombuffer(r.content[n:], np.float32).reshape(1, 3), want, rtol=1e-5, atol=1e-6)
    # Nested JSON data is accepted as well as flat.
    r = httpx.post(f"{base}/v2/models/mlp/infer", json={"inputs": [
        {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x.tolist()}]})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    np.testing.assert_allclose(np.array(r.json()["outputs"][0]["data"]).reshape(1, 3), want, rtol=1e-5, atol=1e-6)
    short = json.dumps({"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 16}}]}).encode()
    one = short.replace(b"[2, 4]", b"[1, 4]")
    bad = [
        (b"{not json", {}, "not valid JSON"),
        (b'{"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [1, 2, 3]}]}', {},
         "3 data elements do not fill shape [2, 4]"),
        (short + bytes(16), {"Inference-Header-Content-Length": str(len(short))}, "do not fill shape [2, 4]"),
        (one + bytes(20), {"Inference-Header-Content-Length": str(len(one))}, "4 bytes of binary data left over"),
    ]
    for body, headers, words in bad:
        r = httpx.post(f"{base}/v2/models/mlp/infer", content=body, headers=headers)
        assert r.status_code == 400 and words in r.json()["error"], (r.status_code, r.text)
    r = httpx.get(f"{base}/v2/nothing/here")
    assert r.status_code == 404 and "no such route" in r.json()["error"]
    r = httpx.get(f"{base}/v2/models/mlp/versions/7")
    assert r.status_code == 404 and "version" in r.json()["error"]


def test_repository_index_statistics_and_what_is_not_implemented(http: Any, grpc_: Any) -> None:
    assert sorted((m["name"], m["state"]) for m in http.get_model_repository_index()) == [
        ("mlp", "READY"), ("mlp_dyn", "READY"), ("pair", "READY")]
    assert sorted(m.name for m in grpc_.get_model_repository_index().models) == ["mlp", "mlp_dyn", "pair"]
    before = http.get_inference_statistics("mlp")["model_stats"][0]
    http.infer("mlp", [_http_input("x", _x(5), "FP32")])
    after = http.get_inference_statistics("mlp")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 5
    assert after["execution_count"] - before["execution_count"] == 1
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 1
    g = grpc_.get_inference_statistics("mlp").model_stats[0]
    assert g.name == "mlp" and g.inference_count >= after["inference_count"]
    assert {s["name"] for s in http.get_inference_statistics()["model_stats"]} == {"mlp", "mlp_dyn", "pair"}
    for call in (lambda: grpc_.load_model("mlp"), lambda: grpc_.get_system_shared_memory_status()):
        assert _fails(call).status() == "StatusCode.UNIMPLEMENTED"


def test_dynamic_batching_combines_requests_from_both_protocols(server: OipServer, http: Any,
                                                                models: dict[str, Path]) -> None:
    rows = [1, 2, 1, 1, 2, 1]  # 8 rows, mlp_dyn's max_batch_size: the batch is sent once all are queued
    xs = [_x(n, seed=10 + i) for i, n in enumerate(rows)]
    before = http.get_inference_statistics("mlp_dyn")["model_stats"][0]
    barrier = threading.Barrier(len(rows))

    def call(i: int) -> np.ndarray:
        barrier.wait(60)
        if i % 2:  # half over gRPC, half over REST: one batcher serves both
            with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}") as g:
                return g.infer("mlp_dyn", [_grpc_input("x", xs[i], "FP32")], client_timeout=60).as_numpy("y")
        with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}", network_timeout=60) as h:
            return h.infer("mlp_dyn", [_http_input("x", xs[i], "FP32")]).as_numpy("y")

    with ThreadPoolExecutor(len(rows)) as pool:
        got = list(pool.map(call, range(len(rows))))
    for x, y in zip(xs, got):  # each caller got its own rows back
        np.testing.assert_allclose(y, reference(models["mlp"], {"x": x})[0], rtol=1e-5, atol=1e-6)
    after = http.get_inference_statistics("mlp_dyn")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == sum(rows)
    executions = after["execution_count"] - before["execution_count"]
    assert executions < len(rows), f"{len(rows)} requests ran in {executions} executions: none were combined"
    assert max(b["batch_size"] for b in after["batch_stats"]) > max(rows)
    _, fams = scrape(server.metrics_port)  # the same story in Triton's metrics
    assert sample(fams, "nv_inference_exec_count", model="mlp_dyn") < sample(
        fams, "nv_inference_request_success", model="mlp_dyn")
    assert sample(fams, "nv_inference_pending_request_count", model="mlp_dyn") == 0


def test_metrics_carry_tritons_names_and_labels(server: OipServer, http: Any) -> None:
    http.infer("mlp", [_http_input("x", _x(1), "FP32")])
    _fails(lambda: http.infer("mlp", [_http_input("x", _x(1).astype(np.float64), "FP64")]))
    text, fams = scrape(server.metrics_port)
    for name in METRIC_NAMES:
        kind = "gauge" if name == "nv_inference_pending_request_count" else "counter"
        assert re.search(rf"^# TYPE {name} {kind}$", text, re.M), name
        assert re.search(rf'^{name}{{.*model="mlp".*version="1".*}} ', text, re.M), name
    assert sample(fams, "nv_inference_request_success", model="mlp", version="1") >= 1
    assert sample(fams, "nv_inference_request_failure", model="mlp", reason="OTHER") >= 1
    assert sample(fams, "nv_inference_request_duration_us", model="mlp") > 0
    assert sample(fams, "nv_inference_compute_infer_duration_us", model="mlp") > 0


def test_live_plan_routes(server: OipServer) -> None:
    base = f"http://127.0.0.1:{server.http_port}"
    plan = httpx.get(f"{base}/v2/models/mlp/plan", timeout=30)
    assert plan.status_code == 200 and plan.json()["partitions"]
    page = httpx.get(f"{base}/v2/models/mlp/plan.html", timeout=60)
    assert page.status_code == 200, page.text
    assert page.headers["content-type"].startswith("text/html") and "mlp" in page.text


def _doc_snippets() -> list[str]:
    """The Python blocks of docs/serving-models.md marked as run by this test."""
    text = DOCS.read_text()
    return re.findall(r"<!-- run by tests/server/oip/test_oip_serving\.py -->\n```python\n(.*?)```", text, re.S)


def test_the_docs_client_examples_run_unmodified(server: OipServer, models: dict[str, Path]) -> None:
    snippets = _doc_snippets()
    assert len(snippets) >= 2, "docs/serving-models.md lost its tested client examples"
    for code in snippets:  # written for localhost:8000 / :8001 and a model "mlp" with x [batch, 4]
        code = code.replace("localhost:8000", f"127.0.0.1:{server.http_port}")
        code = code.replace("localhost:8001", f"127.0.0.1:{server.grpc_port}")
        scope: dict[str, Any] = {}
        exec(compile(code, str(DOCS), "exec"), scope)  # noqa: S102  (our own documentation)
        x = scope["x"]
        np.testing.assert_allclose(scope["y"], reference(models["mlp"], {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_draining_turns_readiness_off_and_refuses_new_requests(server: OipServer, http: Any, grpc_: Any) -> None:
    # The state DrainingServer sets at SIGTERM (the real signal is tested on a subprocess in test_oip_cli.py).
    assert server.service is not None
    server.service.draining = True
    try:
        assert not http.is_server_ready() and not grpc_.is_server_ready()
        assert not http.is_model_ready("mlp") and not grpc_.is_model_ready("mlp")
        assert http.is_server_live() and grpc_.is_server_live()
        assert _fails(lambda: http.infer("mlp", [_http_input("x", _x(1), "FP32")])).status() == "503"
        e = _fails(lambda: grpc_.infer("mlp", [_grpc_input("x", _x(1), "FP32")]))
        assert e.status() == "StatusCode.UNAVAILABLE"
    finally:
        server.service.draining = False
    assert http.is_server_ready()
