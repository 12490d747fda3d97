"""The HTTP protocol `kubetrt serve` runs: each response reaches the socket in one write (head and
body together), streamed and bodiless answers still arrive whole and in order."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kubetrt.serving.app import create_app
from kubetrt.serving.http_protocol import ServingHttpProtocol
from kubetrt.serving.registry import ServingConfig
from serving_support import LiveServer, body_reader, cnn_input


class SocketWrites:
    """The socket's transport, recording every write that reaches it (under JoinedWrites)."""

    def __init__(self, transport: asyncio.Transport, writes: list[tuple[float, bytes]]) -> None:
        self._transport, self._writes = transport, writes

    def write(self, data: bytes) -> None:
        self._writes.append((time.monotonic(), bytes(data)))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


WRITES: list[tuple[float, bytes]] = []


class RecordedProtocol(ServingHttpProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(SocketWrites(transport, WRITES))  # type: ignore[arg-type]


def writes_of(client: httpx.Client, method: str, path: str, **kwargs: Any) -> tuple[httpx.Response, list[bytes]]:
    WRITES.clear()
    response = client.request(method, path, **kwargs)
    return response, [data for _, data in WRITES]


def test_every_answer_of_the_serving_app_leaves_in_one_write(cnn_model):
    app = create_app(config=ServingConfig(device="host"), models=[cnn_model])
    x = cnn_input(1, seed=3)
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 32, 32, 3], "data": x.ravel().tolist()}]}
    with LiveServer(app, http=RecordedProtocol) as live, httpx.Client(base_url=live.url) as client:
        live.wait_ready()
        cases = [
            ("POST", "/v2/models/small_cnn/infer", {"json": body}, 200),
            ("POST", "/v2/models/nope/infer", {"json": body}, 404),
            ("POST", "/v2/models/small_cnn/infer", {"content": b"{not json"}, 400),
            ("GET", "/v2/health/live", {}, 200),
            ("GET", "/metrics", {}, 200),
            ("HEAD", "/v2/health/live", {}, 405),
        ]
        for method, path, kwargs, status in cases:
            response, writes = writes_of(client, method, path, **kwargs)
            assert response.status_code == status, (method, path, response.text)
            assert len(writes) == 1, f"{method} {path}: {len(writes)} writes, expected the head and body in one"
            head, _, rest = writes[0].partition(b"\r\n\r\n")
            assert head.startswith(f"HTTP/1.1 {status}".encode())
            assert rest == (b"" if method == "HEAD" else response.content)
        want = cnn_model.predict({"image": x})["output_0"]
        got = client.post("/v2/models/small_cnn/infer", json=body).json()["outputs"][0]["data"]
        np.testing.assert_allclose(got, want.ravel(), rtol=1e-6)


async def streamed(request: Any) -> StreamingResponse:
    async def chunks() -> Any:
        for part in (b"first,", b"second,", b"third"):
            yield part
            await asyncio.sleep(0.05)
    return StreamingResponse(chunks(), media_type="text/plain")


async def head_then_body(scope: Any, receive: Any, send: Any) -> None:
    """An app that sends its head, waits, then its body."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
    await asyncio.sleep(0.2)
    await send({"type": "http.response.body", "body": b"late"})


async def empty(request: Any) -> Response:
    return Response(status_code=204)


def test_streamed_and_late_bodies_arrive_whole_and_the_head_does_not_wait_for_them():
    app = Starlette(routes=[Route("/stream", streamed), Route("/empty", empty)])
    with LiveServer(app, http=RecordedProtocol) as live, httpx.Client(base_url=live.url) as client:
        response, writes = writes_of(client, "GET", "/stream")
        assert response.text == "first,second,third"
        assert len(writes) >= 3 and writes[0].startswith(b"HTTP/1.1 200") and b"first," in writes[0]
        response, writes = writes_of(client, "GET", "/empty")
        assert response.status_code == 204 and len(writes) == 1
    with LiveServer(head_then_body, http=RecordedProtocol) as live, httpx.Client(base_url=live.url) as client:
        WRITES.clear()
        with client.stream("GET", "/") as response:
            assert response.status_code == 200  # the head came on its own, before the body was sent
            head_seen = time.monotonic()
            assert response.read() == b"late"
        (t_head, head), (t_body, late) = WRITES
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n") and late == b"late"
        assert t_head < head_seen < t_body


class HeldBodies(ServingHttpProtocol):
    """Records the most body bytes a request cycle held unread."""

    most_held = 0

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        HeldBodies.most_held = max(HeldBodies.most_held, len(self.cycle.body))


def test_request_bodies_reach_the_app_whole_in_few_reads_and_reading_pauses_at_the_high_water_mark():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from kubetrt.serving.http_protocol import HIGH_WATER_BYTES

    body = np.random.default_rng(0).bytes(3 << 20)
    reads: list[int] = []

    def send_all(protocol: Any, wait_s: float, streamed: bool = False) -> int:
        reads.clear()
        with LiveServer(body_reader(reads, wait_s), http=protocol) as live, httpx.Client(base_url=live.url) as client:
            content = iter([body[: 1 << 20], body[1 << 20:]]) if streamed else body  # chunked transfer coding
            response = client.post("/", content=content, timeout=30)
        assert response.text == f"{len(body)} {hash(body)}"
        return reads[0]

    # the app reads after the body has come: uvicorn's own protocol hands it on in pieces of 64 KiB
    # read one turn of the loop apart; this one in pieces of about HIGH_WATER_BYTES
    most = len(body) // HIGH_WATER_BYTES + 1
    ours, uvicorns = send_all(HeldBodies, 0.3), send_all(HttpToolsProtocol, 0.3)
    assert ours <= most < 12 <= uvicorns, (ours, uvicorns)
    # the app waits in its read while the body comes: woken at the high-water mark or the body's end,
    # not for every piece the socket gives (uvicorn's protocol wakes it for each)
    assert 1 <= send_all(HeldBodies, 0.0) <= most < send_all(HttpToolsProtocol, 0.0), reads
    assert 1 <= send_all(HeldBodies, 0.0, streamed=True) <= most, reads
    # reading stopped once HIGH_WATER_BYTES were held: at most one more read of the socket (256 KiB) beyond
    assert HIGH_WATER_BYTES <= HeldBodies.most_held <= HIGH_WATER_BYTES + (256 << 10), HeldBodies.most_held
