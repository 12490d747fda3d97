"""The HTTP/1.1 protocol `kubetrt serve` runs under uvicorn: httptools, with each response leaving
in one send, and request bodies handed on without copies of their own.

uvicorn writes a response's head when the app sends `http.response.start` and its body when the app
sends the body: two sends on the socket, two trips through the loopback or the pod network, and
two wake-ups of the client for one answer. Here the head waits for the body's first write and
leaves with it in one send; a head the app sends alone (an answer streamed later) leaves at the end
of the loop's turn.

uvicorn appends every piece of a request body to a bytearray and copies it out again for the app,
wakes the app for every piece, and stops reading the socket at 64 KiB until the app has taken it: a
tensor of megabytes was copied twice more than it needs and took a dozen turns of the event loop,
all of it holding the GIL that the parsing threads and the runtime's run threads wait for. Here the
pieces httptools makes are kept as they are and joined once, when the app reads them; the app is
woken when the body has ended or HIGH_WATER_BYTES are held, when reading pauses until it has taken them.
"""
from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HIGH_WATER_BYTES = 1 << 20  # a request body held unread before the socket's reading pauses


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


class BodyPieces:
    """The body pieces a request cycle holds for its app's next read, as httptools made them;
    uvicorn's cycle reads it with len() and bytes(), as it would its bytearray."""

    __slots__ = ("pieces", "size")

    def __init__(self, held: bytes | bytearray = b"") -> None:
        self.pieces = [bytes(held)] if held else []
        self.size = len(held)

    def append(self, piece: bytes) -> None:
        self.pieces.append(piece)
        self.size += len(piece)

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return self.pieces[0] if len(self.pieces) == 1 else b"".join(self.pieces)


class ServingHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over JoinedWrites, holding request bodies as BodyPieces."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(JoinedWrites(transport, self.loop))  # type: ignore[arg-type]

    def on_body(self, body: bytes) -> None:
        # uvicorn's on_body, with the pieces kept and the higher water mark
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        held: BodyPieces | bytearray = cycle.body
        if not isinstance(held, BodyPieces):  # the cycle's own bytearray: new, or reset by a read
            held = BodyPieces(held)
            cycle.body = held  # type: ignore[assignment]  # the cycle takes only len() and bytes() of it
        held.append(body)
        if len(held) > HIGH_WATER_BYTES:  # the app takes what is held; the body's end wakes it otherwise
            self.flow.pause_reading()
            cycle.message_event.set()
