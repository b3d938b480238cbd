"""One error type for both protocols: an HTTP status that maps onto a gRPC status code.

Triton's table (docs/protocol/README.md, "Mapping Triton Server Error Codes to
HTTP Status Codes") is the anchor: bad input 400, unknown model 404,
unavailable (draining) 503, unsupported 501, internal 500.
"""

from __future__ import annotations

import grpc

_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED, 500: grpc.StatusCode.INTERNAL, 501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class OipError(Exception):
    """A request the server answers with an error: ``{"error": message}`` over REST, a status over gRPC."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC.get(self.status, grpc.StatusCode.UNKNOWN)


def bad_request(message: str) -> OipError:
    return OipError(400, message)


def not_found(message: str) -> OipError:
    return OipError(404, message)


def draining() -> OipError:
    return OipError(503, "the server is shutting down and accepts no new inference requests")
