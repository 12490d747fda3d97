"""The HTTP/1.1 protocol `kubetrt serve` runs under uvicorn: httptools, with each response leaving
in one send.

uvicorn writes a response's head when the app sends `http.response.start` and its body when the app
sends the body: two sends on the socket, two trips through the loopback or the pod network, and
two wake-ups of the client for one answer. Here the head waits for the body's first write and
leaves with it in one send; a head the app sends alone (an answer streamed later) leaves at the end
of the loop's turn.
"""
from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class JoinedWrites:
    """An asyncio transport that holds a response head until the next write, and sends the two as
    one; a head with nothing after it leaves at the end of the loop's turn. Everything else is the
    wrapped transport's."""

    __slots__ = ("_transport", "_loop", "_head")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._head = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._head:
            head, self._head = self._head, b""
            self._transport.write(head + data)
        elif data[:5] == b"HTTP/":  # uvicorn writes a head, and only a head, in one write
            self._head = bytes(data)
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        if self._head:
            head, self._head = self._head, b""
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self.flush()  # a head written before close still goes out, as with the transport itself
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + len(self._head)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class ServingHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over JoinedWrites."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(JoinedWrites(transport, self.loop))  # type: ignore[arg-type]
