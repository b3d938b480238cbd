"""``dspark serve MODEL.onnx`` as a user runs it (a subprocess), and its graceful drain: a request in flight
at SIGTERM completes, new ones are refused on both protocols, the process exits 0."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from conftest import wait_for
from oip_fixtures import mlp, reference, sample, scrape
from tritonclient.utils import InferenceServerException


def _log(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _event(path: Path, prefix: str) -> dict[str, Any] | None:
    return next((x for x in _log(path) if str(x.get("event", "")).startswith(prefix)), None)


@pytest.mark.timeout(300)
def test_dspark_serve_model_onnx_then_sigterm_drains(tmp_path: Path) -> None:
    model = mlp(tmp_path / "mlp.onnx")
    log_path = tmp_path / "server.log"
    dspark = Path(sys.executable).with_name("dspark")
    # A queue delay no test waits out: a lone request stays queued (in flight) until the drain sends it.
    cmd = [str(dspark), "serve", str(model), "--port", "0", "--grpc-port", "0", "--metrics-port", "0",
           "--max-batch-size", "8", "--max-queue-delay-us", "600000000"]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                env={**os.environ, "DSPARK_LOG_LEVEL": "INFO", "PYTHONUNBUFFERED": "1"})
    try:
        def listening() -> dict[str, Any] | None:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log_path.read_text()}"
            return _event(log_path, "DSpark OIP server is listening")

        ports = wait_for(listening, 240, "the server's listening line")
        http_url, grpc_url = f"127.0.0.1:{ports['port']}", f"127.0.0.1:{ports['grpc_port']}"
        client = httpclient.InferenceServerClient(http_url)
        assert client.is_server_ready() and client.get_model_metadata("mlp")["inputs"][0]["shape"] == [-1, 4]
        assert client.get_model_config("mlp")["dynamic_batching"]["max_queue_delay_microseconds"] == 600000000
        gclient = grpcclient.InferenceServerClient(grpc_url)
        assert gclient.is_server_ready()

        x = np.linspace(-2, 2, 4, dtype=np.float32).reshape(1, 4)
        inp = httpclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        done: dict[str, Any] = {}

        def in_flight() -> None:
            with httpclient.InferenceServerClient(http_url, network_timeout=120) as c:
                try:
                    done["y"] = c.infer("mlp", [inp]).as_numpy("y")
                except Exception as e:  # noqa: BLE001  (reported by the assertion below)
                    done["error"] = e

        t = threading.Thread(target=in_flight)
        t.start()
        wait_for(lambda: sample(scrape(ports["metrics_port"])[1], "nv_inference_pending_request_count",
                                model="mlp") == 1, 30, "the request to wait in the batcher's queue")
        kept = http.client.HTTPConnection("127.0.0.1", ports["port"], timeout=30)  # open before the signal
        kept.request("GET", "/v2/health/live")
        assert kept.getresponse().read() == b""

        proc.send_signal(signal.SIGTERM)
        drain = wait_for(lambda: _event(log_path, "Shutdown requested"), 30, "the drain to start")
        assert drain["open_requests"] == 1  # the queued request was in flight when the signal came
        t.join(60)
        assert "error" not in done, done.get("error")
        np.testing.assert_allclose(done["y"], reference(model, {"x": x})[0], rtol=1e-5, atol=1e-6)

        # New requests are refused: 503 on a connection still open, else the connection is already closed.
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": x.ravel().tolist()}]})
        try:
            kept.request("POST", "/v2/models/mlp/infer", body=body, headers={"Content-Type": "application/json"})
            r = kept.getresponse()
            assert r.status == 503 and "shutting down" in json.loads(r.read())["error"]
        except (OSError, http.client.HTTPException):
            pass
        with pytest.raises(InferenceServerException) as e:
            ginp = grpcclient.InferInput("x", [1, 4], "FP32")
            ginp.set_data_from_numpy(x)
            gclient.infer("mlp", [ginp], client_timeout=30)
        assert e.value.status() == "StatusCode.UNAVAILABLE"

        assert proc.wait(60) == 0, log_path.read_text()[-4000:]
        assert _event(log_path, "Drained: every open request finished") is not None
        assert _event(log_path, "DSpark OIP server stopped") is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
