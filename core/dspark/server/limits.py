"""Request body size limit (a pure ASGI middleware answering 413) and the API key check, shared by the servers.

A declared ``Content-Length`` over the limit is refused before any of the
body is read; a chunked body is counted as it arrives and refused once it
passes the limit, so no request can make the server buffer more than that. The 413 body is
OpenAI's error shape unless the app passes its own (``error_body``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


def bearer_ok(authorization: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` value is ``Bearer <api_key>`` (scheme case-insensitive)."""
    scheme, _, token = (authorization or "").partition(" ")
    # Hash both sides first so the comparison time depends on neither length nor content.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        hashlib.sha256(token.strip().encode()).digest(), hashlib.sha256(api_key.encode()).digest())


def openai_too_large(max_bytes: int) -> bytes:
    return json.dumps({"error": {
        "message": f"The request body is larger than this server accepts ({max_bytes} bytes; "
                   "server.max_body_bytes).", "type": "invalid_request_error", "param": None,
        "code": "request_too_large"}}).encode()


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, error_body: Callable[[int], bytes] = openai_too_large) -> None:
        self.app, self.max_bytes, self.error_body = app, max_bytes, error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        if declared is not None:  # h11 holds the client to its declared length
            await self.app(scope, receive, send)
            return
        # Chunked: read it here, counting, and replay it to the app.
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        payload = self.error_body(self.max_bytes)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
