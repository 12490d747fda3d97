"""The OIP infer route as a bare ASGI app in front of FastAPI (app.ServingApp): the hot path of
every REST inference skips FastAPI's middlewares, Starlette's Request, routing and exception layers
(which cost as much as decoding a small tensor) and answers from the same codecs, registry and
metrics as the other routes. Every other path goes on to FastAPI."""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from typing import Any, Awaitable, Callable, MutableMapping

from kubetrt.telemetry.logs import log

from . import oip
from .calls import lookup, tracked
from .errors import BadRequest, MethodNotAllowed, PayloadTooLarge, ServingError, error_body
from .registry import ModelRegistry, ServingConfig, timeout_from_params
from .shared_memory import SharedMemoryRegions

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("kubetrt.serving")
# JSON from this size on is decoded on a codec thread, where the parts of the decode that let go
# of the GIL (NumPy's copies and casts) run beside the loop; simdjson's parse keeps the GIL for its
# length. Less JSON costs less than the hand-off, and so do binary tensors (views of the body), however large.
OFFLOAD_BYTES = 128 << 10
_codec_pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kubetrt-codec")
_JSON = [(b"content-type", b"application/json")]
_HEADER_LENGTH = oip.HEADER_LENGTH.encode()


def infer_target(path: str) -> tuple[str, str | None] | None:
    """(model, version) of /v2/models/{name}[/versions/{version}]/infer, else None."""
    parts = path.split("/")
    if len(parts) == 5 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "infer" and parts[3]:
        return parts[3], None
    if (len(parts) == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions"
            and parts[6] == "infer" and parts[3] and parts[5]):
        return parts[3], parts[5]
    return None


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The body, refusing more than `limit` bytes (413); an oversize body is drained, not kept,
    so the client still reads the 413 instead of a reset connection."""
    if declared is not None:
        try:
            int(declared)
        except ValueError:
            raise BadRequest(f"Content-Length {declared!r} is not an integer") from None
    chunks, total = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        total += len(chunk)
        if total <= limit:
            chunks.append(chunk)
        else:
            chunks.clear()
        if not message.get("more_body", False):
            break
    if total > limit:
        raise PayloadTooLarge(f"request body of {total} bytes exceeds the limit of {limit} bytes (--max-body-bytes)")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class InferRoute:
    def __init__(self, app: ASGIApp, registry: ModelRegistry, config: ServingConfig,
                 regions: SharedMemoryRegions | None = None) -> None:
        self.app, self.registry, self.config, self.regions = app, registry, config, regions

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = infer_target(scope["path"]) if scope["type"] == "http" else None
        if target is None:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"method {scope['method']} is not allowed on {scope['path']}")
            status, extra, payload = 200, [], await self._infer(target, headers, receive)
            body, header_length = payload
            if header_length is None:
                out_headers = _JSON
            else:
                out_headers = [(b"content-type", b"application/octet-stream"),
                               (_HEADER_LENGTH, str(header_length).encode())]
        except ServingError as e:
            if e.status == 500:  # a runtime fault on a valid request; 4xx/503/504 are the client's news
                log(logger, logging.WARNING, "inference failed", path=scope["path"], error=e.message)
            status, body, out_headers = e.status, error_body(e.message), _JSON
            extra = [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
        except Exception as e:  # noqa: BLE001 - answered as a 500 with its reason, never a dropped connection
            logger.error("unexpected error on POST %s", scope["path"], exc_info=e)
            status, body, out_headers, extra = 500, error_body(f"internal error: {type(e).__name__}: {e}"), _JSON, []
        await send({"type": "http.response.start", "status": status,
                    "headers": [*out_headers, (b"content-length", str(len(body)).encode()), *extra]})
        await send({"type": "http.response.body", "body": body})

    async def _infer(self, target: tuple[str, str | None], headers: dict[bytes, bytes],
                     receive: Receive) -> tuple[bytes, int | None]:
        served = lookup(self.registry, *target)
        declared = headers.get(b"content-length")
        raw_header_length = headers.get(_HEADER_LENGTH)

        async def handle() -> tuple[bytes, int | None]:
            body = await read_body(receive, declared.decode("latin-1") if declared is not None else None,
                                   self.config.max_body_bytes)
            header_length = _header_length(raw_header_length)
            decode = functools.partial(oip.decode_infer_request, body, header_length, served.inputs, served.outputs,
                                       self.regions)
            if (len(body) if header_length is None else header_length) >= OFFLOAD_BYTES:
                req = await asyncio.get_running_loop().run_in_executor(_codec_pool, decode)
            else:
                req = decode()
            results = await served.infer(req.feeds, timeout_from_params(req.parameters))
            return oip.encode_infer_response(served.name, served.version, req, results, self.regions)

        return await tracked(served, handle)


def _header_length(raw: bytes | None) -> int | None:
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadRequest(f"Inference-Header-Content-Length {raw.decode('latin-1')!r} is not an integer") from None
