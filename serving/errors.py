"""Serving errors: one exception type per outcome, with its HTTP status (rendered as the OIP body
{"error": "..."}) and its gRPC status code name, so both transports answer a fault alike.

Codecs and the registry raise these from pure code, so routes never build error responses by hand
and nothing a client sends can surface as a 500.
"""
from __future__ import annotations

import json

from starlette.responses import Response


class ServingError(Exception):
    status: int = 500
    grpc_code: str = "INTERNAL"  # a grpc.StatusCode name

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(ServingError):
    status = 400
    grpc_code = "INVALID_ARGUMENT"


class NotFound(ServingError):
    status = 404
    grpc_code = "NOT_FOUND"


class MethodNotAllowed(ServingError):
    status = 405
    grpc_code = "UNIMPLEMENTED"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Allow": "POST"})


class PayloadTooLarge(ServingError):
    status = 413
    grpc_code = "RESOURCE_EXHAUSTED"


class Unavailable(ServingError):
    """Not ready, shutting down or shedding load; Retry-After tells clients when to come back."""

    status = 503
    grpc_code = "UNAVAILABLE"

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class Overloaded(Unavailable):
    """The model's queue is full: shed at once rather than let the request time out."""

    grpc_code = "RESOURCE_EXHAUSTED"


class Timeout(ServingError):
    status = 504
    grpc_code = "DEADLINE_EXCEEDED"


class ComputeFailed(ServingError):
    """The runtime failed on a valid request: a server-side fault, reported with its reason."""

    status = 500


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        error_body(message),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
