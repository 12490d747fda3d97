"""Serving errors: one exception type per HTTP status, rendered as the OIP body {"error": "..."}.

Codecs and the registry raise these from pure code, so routes never build error responses by hand
and nothing a client sends can surface as a 500.
"""
from __future__ import annotations

import json

from starlette.responses import Response


class ServingError(Exception):
    status: int = 500

    def __init__(self, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(ServingError):
    status = 400


class NotFound(ServingError):
    status = 404


class PayloadTooLarge(ServingError):
    status = 413


class Unavailable(ServingError):
    """Not ready, shutting down or shedding load; Retry-After tells clients when to come back."""

    status = 503

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})


class Timeout(ServingError):
    status = 504


class ComputeFailed(ServingError):
    """The runtime failed on a valid request: a server-side fault, reported with its reason."""

    status = 500


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps({"error": message}),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
