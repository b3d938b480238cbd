"""The peer of benchmarks/serve_oip.py: ONNX Runtime behind a plain FastAPI app, as users write it by hand.

One ``onnxruntime.InferenceSession(path)`` with default options (ONNX Runtime picks its intra-op threads:
one per physical core), created at import; a plain ``def`` endpoint, which FastAPI runs in its thread pool
(so concurrent requests call ``session.run`` concurrently, each with batch 1, nothing batched); the request
body is the raw little-endian float32 bytes of one image (1, 3, H, W), the response the raw float32 bytes
of its logits. Raw bytes rather than JSON lists on purpose: the peer pays no JSON cost, so a gap to
dspark is scheduling and batching, not serialization.

    ORT_PEER_MODEL=benchmarks/out/serve_oip/models/resnet50.onnx \\
        .venv/bin/python -m uvicorn --app-dir benchmarks/peers ort_fastapi_app:app --port 8001 --workers 1

Routes: ``POST /infer`` (body: the image bytes), ``GET /health`` (200 once the session is loaded).
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
from fastapi import Depends, FastAPI, HTTPException, Request, Response

session = ort.InferenceSession(os.environ["ORT_PEER_MODEL"], providers=["CPUExecutionProvider"])
_input = session.get_inputs()[0]
_shape = (1, *(int(d) for d in _input.shape[1:]))  # (batch, 3, H, W): the batch dim is dynamic
_nbytes = int(np.prod(_shape)) * 4

app = FastAPI()


async def _body(request: Request) -> bytes:
    return await request.body()


@app.get("/health")
def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/infer")
def infer(body: bytes = Depends(_body)) -> Response:
    if len(body) != _nbytes:
        raise HTTPException(400, f"expected {_nbytes} bytes (float32 {_shape}), got {len(body)}")
    x = np.frombuffer(body, dtype="<f4").reshape(_shape)
    (logits,) = session.run(None, {_input.name: x})
    return Response(content=np.ascontiguousarray(logits, dtype="<f4").tobytes(),
                    media_type="application/octet-stream")
