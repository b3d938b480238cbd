"""Every error leaves as OpenAI's ``{"error": {message, type, param, code}}``.

Bad input is always a 4xx: validation problems are 400, not FastAPI's 422.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.host.log import get_logger
from dspark.server.protocol.openai_schema import APIError, ErrorBody, ErrorResponse

log = get_logger("dspark.server")

# Fields typed to accept only their neutral value: say so when a client sends anything else.
_UNSUPPORTED = {"best_of", "suffix", "tools", "tool_choice", "functions", "modalities"}
# The error statuses every authenticated route documents in the OpenAPI spec.
ERRORS: dict[int | str, dict[str, Any]] = {
    c: {"model": ErrorResponse} for c in (400, 401, 404, 413, 503)}
_UNION_TAGS = {"body", "str", "int", "float", "bool", "list", "dict", "none"}


class _AsciiJSON(JSONResponse):
    """Error bodies quote client input, which JSON lets carry lone surrogates: escape, never fail to encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(status: int, body: ErrorBody) -> JSONResponse:
    return _AsciiJSON({"error": body.model_dump()}, status_code=status)


def param_path(loc: tuple[Any, ...]) -> str | None:
    """The request field a validation error is about (``messages.0.content``), None for the whole body."""
    # Drop "body" and pydantic's union-member tags ("str", "list[constrained-str]"): keep the field path.
    parts = [str(x) for x in loc if isinstance(x, int) or (str(x).isidentifier() and x not in _UNION_TAGS)]
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.body)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = list(exc.errors())
        if any(e.get("type") == "json_invalid" for e in errs):
            ctx = errs[0].get("ctx") or {}
            return error_response(400, ErrorBody(message=f"The request body is not valid JSON: {ctx.get('error', '')}",
                                                 type="invalid_request_error"))
        msgs = []
        for e in errs:
            where = param_path(tuple(e.get("loc", ())))
            msg = e.get("msg", "invalid")
            if e.get("type") == "extra_forbidden":
                msg = "unrecognized request argument"
            elif where and where.split(".")[0] in _UNSUPPORTED:
                msg += " (not supported by this server)"
            msgs.append(f"{where}: {msg}" if where else f"request body: {msg}")
        first = param_path(tuple(errs[0].get("loc", ()))) if errs else None
        return error_response(400, ErrorBody(message="; ".join(msgs), type="invalid_request_error", param=first))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        resp = error_response(exc.status_code, ErrorBody(message=str(exc.detail), type=kind))
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", error=repr(exc))
        return error_response(500, ErrorBody(message="internal server error", type="server_error"))
