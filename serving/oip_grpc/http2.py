"""gRPC calls over HTTP/2 (cleartext, prior knowledge: what gRPC's insecure channels speak),
served on the event loop the REST routes run on.

Why not grpc.aio: its calls are read by gRPC's C core on threads of its own and reach the event
loop through a poller thread, several hand-offs of the GIL per call; at one client that costs more
than the whole budget of a small model's call. Here a call's frames are read, its handler run and
its answer written by the loop itself, in one turn where the handler does not wait.

What it speaks: RFC 9113's frames, settings, stream states, flow control (both ways) and errors,
as h2spec checks them; HPACK (header_block.py); gRPC's rules (grpc_wire.py): message framing,
`grpc-timeout`, gzip and deflate request messages, trailers-only error answers, plain HTTP 415 or
405 to a request that is no gRPC call. Unary calls (every rpc of the OIP service) start once the
request has ended; streaming calls (server reflection's) start at their headers, each message
handed to the handler as it arrives and each answer sent as the handler yields it. Not spoken:
server push, TLS (a pod's port is cleartext, as with grpc.aio).
"""
from __future__ import annotations

import asyncio
import logging
import struct
import time
from dataclasses import dataclass, field
from functools import partial
from typing import AsyncIterator, Awaitable, Callable, cast

from kubetrt.telemetry.logs import log

from .grpc_wire import (
    MESSAGE_PREFIX, OK_TRAILERS, RESPONSE_HEADERS, MalformedHead, RpcError, content_length, not_grpc_answer,
    open_message, parse_timeout, request_head, status_trailers, take_messages, unframe_message,
)
from .header_block import HeaderBlockError, HeaderDecoder

logger = logging.getLogger("kubetrt.serving")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x2, 0x3, 0x4
SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x5, 0x6
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x9

DEFAULT_WINDOW = 65_535  # both directions' windows before any SETTINGS or WINDOW_UPDATE
MAX_WINDOW = (1 << 31) - 1
RECEIVE_WINDOW = 1 << 24  # what a client may send ahead of the server's reading, per stream and per connection
MAX_STREAMS = 1024  # calls open at once on one connection; past it a new one is refused (REFUSED_STREAM)
MAX_HEADER_BLOCK = 64 << 10
DEFAULT_FRAME = 16_384
RECEIVE_FRAME_LIMIT = DEFAULT_FRAME  # this server announces no larger SETTINGS_MAX_FRAME_SIZE
HOLD_S = 0.005  # the longest a PING answer waits for company
LINGER_S = 1.0  # how long a connection this side ends keeps reading what the client had already sent
RESET_MEMORY = 1024  # streams this side reset, remembered so that the frames already on their way are dropped
STREAM_BACKLOG = 256  # a streaming call's messages waiting for its handler; past it the call fails
_FRAME_HEADER = struct.Struct(">IBI")  # a 24-bit length and the type in one word, the flags, the stream
_PACK_HEADER = struct.Struct(">HBBBI")
_SETTING = struct.Struct(">HI")
_WORD = struct.Struct(">I")

# A unary method: (request message bytes, seconds left before the client's deadline or None) -> answer bytes
Unary = Callable[[memoryview, "float | None"], Awaitable[bytes]]
# A streaming method: (the request messages as they arrive, seconds left or None) -> answer messages
Streaming = Callable[[AsyncIterator[memoryview], "float | None"], AsyncIterator[bytes]]


def frame(kind: int, flags: int, stream: int, payload: bytes | memoryview = b"") -> bytes:
    n = len(payload)
    return _PACK_HEADER.pack(n >> 8, n & 0xFF, kind, flags, stream) + bytes(payload)


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class _StreamError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass
class _Stream:
    id: int
    send_window: int
    headers: dict[bytes, bytes] = field(default_factory=dict)
    block: bytearray = field(default_factory=bytearray)  # a header block awaiting its CONTINUATION
    body: bytearray = field(default_factory=bytearray)
    pending: list[memoryview] = field(default_factory=list)  # answer DATA not yet sent for want of window
    trailers: bytes | None = None  # the answer's last HEADERS block (None: the DATA ends the stream)
    task: asyncio.Task[None] | None = None
    deadline: float | None = None
    received: bool = False  # the client's END_STREAM came (half-closed, remote)
    expected_length: int | None = None  # its content-length, where it sent one
    unacked: int = 0  # bytes read since the stream's last WINDOW_UPDATE
    inbox: asyncio.Queue[memoryview | None] | None = None  # a streaming call's messages for its handler (None: the end)
    answering: bool = False  # the answer's HEADERS went out (an error then ends it with trailers alone)
    more: bool = False  # a streaming answer not yet ended: its DATA leaves the stream open


def _frame_too_long(length: int) -> _ConnectionError:
    return _ConnectionError(FRAME_SIZE_ERROR, f"a frame of {length} bytes, past the {RECEIVE_FRAME_LIMIT} this server announced")


def _unpadded(flags: int, payload: memoryview, what: str) -> memoryview:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise _ConnectionError(PROTOCOL_ERROR, f"a {what} frame's padding is as long as the frame")
    return payload[1:len(payload) - payload[0]]


class GrpcConnection(asyncio.Protocol):
    """One client connection: many calls at once, each a stream, each answered as its handler ends."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface = False
        self.decoder = HeaderDecoder(MAX_HEADER_BLOCK)
        self.held: list[bytes] = []  # PING answers waiting to leave with the next write
        self.release: asyncio.TimerHandle | None = None  # ...or when this fires
        self.streams: dict[int, _Stream] = {}
        self.reset: dict[int, None] = {}  # ids of streams this side reset, oldest first (RESET_MEMORY of them)
        self.last_stream = 0
        self.continuing: _Stream | None = None  # the stream whose header block is being continued
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_frame = DEFAULT_FRAME
        self.receive_window = RECEIVE_WINDOW
        self.unacked = 0  # bytes read since the last connection WINDOW_UPDATE
        self.going_away = False
        self.shut = False  # this side sent its last byte; what arrives now is read and dropped
        self.linger: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream's (uvloop's is no asyncio.Transport subclass)
        self.server.connections.add(self)
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (SETTINGS_MAX_CONCURRENT_STREAMS, MAX_STREAMS), (SETTINGS_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW),
            (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK)))
        self.transport.write(frame(SETTINGS, 0, 0, settings)
                             + frame(WINDOW_UPDATE, 0, 0, _WORD.pack(RECEIVE_WINDOW - DEFAULT_WINDOW)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for timer in (self.release, self.linger):
            if timer is not None:
                timer.cancel()
        for s in self.streams.values():
            if s.task is not None:
                s.task.cancel()
        self.streams.clear()

    def data_received(self, data: bytes) -> None:
        """Frames are read in place from `data`: only a frame cut by the read's end is copied aside,
        and the next read copies into it only the bytes that frame lacks (a large message arrives as
        reads of hundreds of KB, and copying each whole behind a partial frame cost a copy of the message)."""
        if self.shut:
            return
        try:
            rest = self._complete_buffered(memoryview(data)) if not self.preface or self.buffer else memoryview(data)
            if rest is not None:
                at = self._frames(rest)
                if at < len(rest) and not self.shut:
                    self.buffer += rest[at:]
        except _ConnectionError as e:
            self._close_with(e.code, str(e))
            return
        except Exception as e:  # a bug here must cost one connection, not the loop's other work
            log(logger, logging.ERROR, "gRPC connection failed", error=repr(e))
            self._close_with(INTERNAL_ERROR, f"the server failed: {type(e).__name__}")
            return
        if self.unacked >= RECEIVE_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, _WORD.pack(self.unacked)))
            self.receive_window += self.unacked
            self.unacked = 0

    def _complete_buffered(self, view: memoryview) -> memoryview | None:
        """Move into the buffer what the preface, or the frame the last read cut, lacks; read that
        frame -> the rest of `view`, or None where the buffer still waits for more."""
        buf = self.buffer
        if not self.preface:
            view = self._top_up(view, len(PREFACE))
            if not PREFACE.startswith(bytes(buf)):
                raise _ConnectionError(PROTOCOL_ERROR, "expected the HTTP/2 connection preface (gRPC over h2c)")
            if len(buf) < len(PREFACE):
                return None
            buf.clear()
            self.preface = True
            return view
        view = self._top_up(view, 9)
        if len(buf) < 9:
            return None
        length = _FRAME_HEADER.unpack_from(buf)[0] >> 8
        if length > RECEIVE_FRAME_LIMIT:
            raise _frame_too_long(length)
        view = self._top_up(view, 9 + length)
        if len(buf) < 9 + length:
            return None
        whole = memoryview(buf)
        try:
            self._frames(whole)
        finally:
            whole.release()
        buf.clear()
        return view

    def _top_up(self, view: memoryview, size: int) -> memoryview:
        """Copy from `view` into the buffer up to `size` bytes there -> the rest of `view`."""
        take = max(0, size - len(self.buffer))
        self.buffer += view[:take]
        return view[take:]

    def _frames(self, view: memoryview) -> int:
        """Read the whole frames at the start of `view` -> the bytes they took. Past the connection's
        end (shut), what the client still sends is dropped."""
        at, end = 0, len(view)
        while end - at >= 9 and not self.shut:
            word, flags, stream = _FRAME_HEADER.unpack_from(view, at)
            length, kind = word >> 8, word & 0xFF
            if length > RECEIVE_FRAME_LIMIT:
                raise _frame_too_long(length)
            if end - at < 9 + length:
                break
            sid = stream & 0x7FFFFFFF
            try:
                self._frame(kind, flags, sid, view[at + 9:at + 9 + length])
            except _StreamError as e:
                self._reset(sid, e.code)
            at += 9 + length
        return at if not self.shut else end

    # --- frames
    def _frame(self, kind: int, flags: int, sid: int, payload: memoryview) -> None:
        if self.continuing is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "a header block was interrupted before its END_HEADERS")
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            self._headers(flags, sid, payload)
        elif kind == CONTINUATION:
            s = self.continuing
            if s is None or s.id != sid:
                raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without the HEADERS it continues")
            s.block += payload
            if flags & END_HEADERS:
                self.continuing = None
                self._header_block(s)
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if sid != 0:
                raise _ConnectionError(PROTOCOL_ERROR, "PING on a stream; it belongs to the connection")
            if len(payload) != 8:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a PING frame carries 8 bytes")
            if not flags & ACK:
                self._hold(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            self._check_stream_frame(sid, "RST_STREAM")
            if len(payload) != 4:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a RST_STREAM frame carries 4 bytes")
            s = self.streams.pop(sid, None)
            if s is not None and s.task is not None:
                s.task.cancel()
        elif kind == PRIORITY:
            if sid == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise _StreamError(FRAME_SIZE_ERROR, "a PRIORITY frame carries 5 bytes")
            if _WORD.unpack_from(payload)[0] & 0x7FFFFFFF == sid:
                raise _StreamError(PROTOCOL_ERROR, "a stream that depends on itself")
        elif kind == GOAWAY:
            if sid != 0:
                raise _ConnectionError(PROTOCOL_ERROR, "GOAWAY on a stream; it belongs to the connection")
            self.going_away = True
            self._close_when_idle()
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not push")
        # unknown frame types are ignored, as RFC 9113 asks

    def _check_stream_frame(self, sid: int, what: str) -> None:
        if sid == 0:
            raise _ConnectionError(PROTOCOL_ERROR, f"{what} on stream 0")
        if sid > self.last_stream:
            raise _ConnectionError(PROTOCOL_ERROR, f"{what} on stream {sid}, which was never opened")

    def _headers(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        payload = _unpadded(flags, payload, "HEADERS")
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise _ConnectionError(FRAME_SIZE_ERROR, "HEADERS with a priority shorter than 5 bytes")
            depends = _WORD.unpack_from(payload)[0] & 0x7FFFFFFF
            payload = payload[5:]
            if depends == sid:
                self._open(sid)  # the stream opens, then fails
                raise _StreamError(PROTOCOL_ERROR, "a stream that depends on itself")
        s = self.streams.get(sid)
        if s is None:
            if sid <= self.last_stream:
                raise _ConnectionError(STREAM_CLOSED, f"HEADERS on stream {sid}, which is closed")
            if sid % 2 == 0:
                raise _ConnectionError(PROTOCOL_ERROR, f"stream {sid}: a client's streams take odd ids")
            s = self._open(sid)
        elif s.received:
            raise _StreamError(STREAM_CLOSED, f"HEADERS on stream {sid} after its END_STREAM")
        elif not flags & END_STREAM:
            raise _StreamError(PROTOCOL_ERROR, "trailers without END_STREAM")
        s.block = bytearray(payload)
        s.received = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block(s)
        else:
            self.continuing = s

    def _open(self, sid: int) -> _Stream:
        self.last_stream = sid
        s = self.streams[sid] = _Stream(sid, self.peer_initial_window)
        return s

    def _header_block(self, s: _Stream) -> None:
        try:
            fields = self.decoder.decode(bytes(s.block))
        except HeaderBlockError as e:
            raise _ConnectionError(COMPRESSION_ERROR, f"a header block does not decode: {e}") from None
        s.block = bytearray()
        trailers = bool(s.headers)
        try:
            head = request_head(fields, trailers)
            if not trailers:
                s.expected_length = content_length(head)
        except MalformedHead as e:
            raise _StreamError(PROTOCOL_ERROR, str(e)) from None
        if not trailers:
            s.headers = head
            if len(self.streams) > MAX_STREAMS or self.going_away or self.server.closing:
                raise _StreamError(REFUSED_STREAM, "too many calls open on this connection, or the server is stopping")
            timeout = head.get(b"grpc-timeout")
            if timeout is not None:
                try:
                    s.deadline = time.monotonic() + parse_timeout(timeout)
                except RpcError as e:
                    self._answer_error(s, e)
                    return
        if s.inbox is not None:
            self._deliver(s)
        elif s.received or (not trailers and s.headers.get(b":path") in self.server.streaming):
            self._start(s)

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "DATA on stream 0")
        n = len(payload)
        self.receive_window -= n
        self.unacked += n
        if self.receive_window < 0:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        payload = _unpadded(flags, payload, "DATA")
        s = self.streams.get(sid)
        if s is None:
            if sid > self.last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on stream {sid}, which was never opened")
            if sid in self.reset:
                return  # already on its way when this side reset the stream
            raise _StreamError(STREAM_CLOSED, f"DATA on stream {sid}, which is closed")
        if s.received:
            raise _StreamError(STREAM_CLOSED, f"DATA on stream {sid} after its END_STREAM")
        if len(s.body) + len(payload) > self.server.max_message + 5:
            self._answer_error(s, RpcError("RESOURCE_EXHAUSTED", f"the request's message is larger than "
                                                               f"{self.server.max_message} bytes, the most this server takes"))
            return
        s.body += payload
        s.unacked += n
        if flags & END_STREAM:
            s.received = True
            if s.expected_length is not None and s.expected_length != len(s.body):
                raise _StreamError(PROTOCOL_ERROR, f"content-length {s.expected_length}, DATA of {len(s.body)} bytes")
        if s.inbox is not None:
            self._deliver(s)
        elif s.received:
            self._start(s)
        if not s.received and s.unacked >= RECEIVE_WINDOW // 2:  # a message larger than the window
            self._write(frame(WINDOW_UPDATE, 0, sid, _WORD.pack(s.unacked)))
            s.unacked = 0

    def _settings(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid != 0:
            raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream; they belong to the connection")
        if flags & ACK:
            if payload:
                raise _ConnectionError(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement carries nothing")
            return
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a SETTINGS frame's length is not a multiple of 6")
        for at in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, at)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "SETTINGS_INITIAL_WINDOW_SIZE past 2^31-1")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for s in self.streams.values():
                    s.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= (1 << 24) - 1:
                    raise _ConnectionError(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value} outside 2^14..2^24-1")
                self.peer_frame = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}: expected 0 or 1")
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_pending()

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame carries 4 bytes")
        increment = _WORD.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0 for the connection")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection's window grew past 2^31-1")
        else:
            self._check_stream_frame(sid, "WINDOW_UPDATE")
            if increment == 0:
                raise _StreamError(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            s = self.streams.get(sid)
            if s is None:
                return
            s.send_window += increment
            if s.send_window > MAX_WINDOW:
                raise _StreamError(FLOW_CONTROL_ERROR, f"stream {sid}'s window grew past 2^31-1")
        self._flush_pending()

    # --- calls
    def _start(self, s: _Stream) -> None:
        h = s.headers
        if not h.get(b"content-type", b"").startswith(b"application/grpc"):
            self._answer_plain(s, 415, "this port serves gRPC calls (content-type application/grpc); "
                                       "REST is on the server's HTTP port")
            return
        if h.get(b":method") != b"POST":
            self._answer_plain(s, 405, "a gRPC call is a POST")
            return
        streaming = self.server.streaming.get(h[b":path"])
        if streaming is not None:
            s.inbox = asyncio.Queue()
            self._deliver(s)
            if self.streams.get(s.id) is s:
                s.task = asyncio.get_running_loop().create_task(self._call(s, partial(self._stream_answers, s, streaming)))
            return
        method = self.server.methods.get(h[b":path"])
        if method is None:
            path = h[b":path"].decode(errors="replace")
            known = sorted(p.decode() for p in (*self.server.methods, *self.server.streaming))
            self._answer_error(s, RpcError("UNIMPLEMENTED", f"unknown method {path}; this server answers {', '.join(known)}"))
            return
        try:
            message = unframe_message(s.body, h.get(b"grpc-encoding"), self.server.max_message)
        except RpcError as e:
            self._answer_error(s, e)
            return
        s.task = asyncio.get_running_loop().create_task(self._call(s, partial(self._unary_answer, s, method, message)))

    async def _unary_answer(self, s: _Stream, method: Unary, message: memoryview, remaining: float | None) -> None:
        self._answer(s, await method(message, remaining))

    async def _stream_answers(self, s: _Stream, method: Streaming, remaining: float | None) -> None:
        async def requests() -> AsyncIterator[memoryview]:
            assert s.inbox is not None
            while (message := await s.inbox.get()) is not None:
                yield message

        async for answer in method(requests(), remaining):
            self._answer_part(s, answer)
        self._answer_end(s)

    def _deliver(self, s: _Stream) -> None:
        """Hand a streaming call's whole messages to its handler, and the end of them once the client's
        side has ended."""
        assert s.inbox is not None
        try:
            for compressed, data in take_messages(s.body):
                s.inbox.put_nowait(open_message(compressed, memoryview(data), s.headers.get(b"grpc-encoding"), self.server.max_message))
            if s.inbox.qsize() > STREAM_BACKLOG:
                raise RpcError("RESOURCE_EXHAUSTED", f"more than {STREAM_BACKLOG} messages wait for the call's handler")
            if s.received and s.body:
                raise RpcError("INTERNAL", f"the request ended inside a message ({len(s.body)} bytes of it)")
        except RpcError as e:
            if s.task is not None:
                s.task.cancel()
            self._answer_error(s, e)
            return
        if s.received:
            s.inbox.put_nowait(None)

    async def _call(self, s: _Stream, answer: Callable[[float | None], Awaitable[None]]) -> None:
        try:
            remaining = None if s.deadline is None else s.deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise RpcError("DEADLINE_EXCEEDED", "the call's deadline passed before it started")
            await answer(remaining)
        except RpcError as e:
            self._answer_error(s, e)
        except asyncio.CancelledError:
            if self.streams.get(s.id) is s:  # the server stops under the call; the client's reset ends it otherwise
                self._answer_error(s, RpcError("CANCELLED", "the server stopped before the call ended"))
            raise
        except Exception as e:  # a handler's bug: the client hears INTERNAL, the log says what it was
            log(logger, logging.ERROR, "gRPC call failed", stream=s.id, error=repr(e))
            self._answer_error(s, RpcError("INTERNAL", f"the server failed: {type(e).__name__}"))
        finally:
            s.task = None
            self._close_when_idle()

    def _answer(self, s: _Stream, message: bytes) -> None:
        if self.streams.get(s.id) is not s or self.transport is None:
            return
        s.pending = [memoryview(MESSAGE_PREFIX.pack(0, len(message)) + message)]
        s.trailers = OK_TRAILERS
        self._send(s, frame(HEADERS, END_HEADERS, s.id, RESPONSE_HEADERS))

    def _answer_part(self, s: _Stream, message: bytes) -> None:
        """One message of a streaming answer; the stream stays open for more."""
        if self.streams.get(s.id) is not s or self.transport is None:
            return
        head = b"" if s.answering else frame(HEADERS, END_HEADERS, s.id, RESPONSE_HEADERS)
        s.answering = s.more = True
        s.pending.append(memoryview(MESSAGE_PREFIX.pack(0, len(message)) + message))
        self._send(s, head)

    def _answer_end(self, s: _Stream) -> None:
        """The end of a streaming answer: OK in trailers, after what is still waiting for window."""
        if self.streams.get(s.id) is not s or self.transport is None:
            return
        if not s.answering:
            self._answer_status(s, OK_TRAILERS)
            return
        s.more = False
        s.trailers = OK_TRAILERS
        self._send(s)

    def _answer_plain(self, s: _Stream, status: int, why: str) -> None:
        head, body = not_grpc_answer(status, why)
        s.pending = [memoryview(body)]
        s.trailers = None
        self._send(s, frame(HEADERS, END_HEADERS, s.id, head))

    def _answer_error(self, s: _Stream, e: RpcError) -> None:
        self._answer_status(s, status_trailers(e.code, e.message))

    def _answer_status(self, s: _Stream, trailers: bytes) -> None:
        """End the stream with its status: trailers alone where the answer has begun, else a
        trailers-only answer (one HEADERS frame with the head and the status)."""
        if self.streams.pop(s.id, None) is None or self.transport is None:
            return
        self._write(frame(HEADERS, END_HEADERS | END_STREAM, s.id, (b"" if s.answering else RESPONSE_HEADERS) + trailers))
        self._stop_reading(s)

    def _send(self, s: _Stream, head: bytes = b"") -> None:
        """Write what the windows allow of a stream's answer (after its head, where given); the end
        of the stream once all of it is out."""
        out: list[bytes | memoryview] = [head] if head else []
        while s.pending:
            chunk = s.pending[0]
            n = min(len(chunk), self.peer_frame, self.send_window, s.send_window)
            if n <= 0:
                break
            last = n == len(chunk) and len(s.pending) == 1 and s.trailers is None and not s.more
            out.append(_PACK_HEADER.pack(n >> 8, n & 0xFF, DATA, END_STREAM if last else 0, s.id))
            out.append(chunk[:n])
            self.send_window -= n
            s.send_window -= n
            if n == len(chunk):
                s.pending.pop(0)
            else:
                s.pending[0] = chunk[n:]
        ended = not s.pending and not s.more
        if ended:
            if s.trailers is not None:
                out.append(frame(HEADERS, END_HEADERS | END_STREAM, s.id, s.trailers))
            self.streams.pop(s.id, None)
        if out:
            self._write(b"".join(out) if len(out) <= 4 else out)
        if ended:
            self._stop_reading(s)

    def _flush_pending(self) -> None:
        for s in [s for s in self.streams.values() if s.pending]:
            if self.send_window <= 0:
                break
            self._send(s)

    # --- connection
    def _stop_reading(self, s: _Stream) -> None:
        """After a stream's answer has ended: a client still sending on it (a streaming call whose
        handler ended early, a call refused before its request was whole) is told to stop
        (RST_STREAM NO_ERROR), and what it had already sent is dropped."""
        if not s.received:
            self._forget(s.id)
            self._write(frame(RST_STREAM, 0, s.id, _WORD.pack(NO_ERROR)))

    def _forget(self, sid: int) -> None:
        self.reset[sid] = None
        if len(self.reset) > RESET_MEMORY:
            del self.reset[next(iter(self.reset))]

    def _reset(self, sid: int, code: int) -> None:
        s = self.streams.pop(sid, None)
        if s is not None and s.task is not None:
            s.task.cancel()
        if self.continuing is not None and self.continuing.id == sid:
            self.continuing = None
        self._forget(sid)
        self._write(frame(RST_STREAM, 0, sid, _WORD.pack(code)))

    def _write(self, data: bytes | list[bytes | memoryview]) -> None:
        """Send now, after any PING answers held back: one system call where it can be."""
        if self.transport is None or self.shut or self.transport.is_closing():
            return
        if isinstance(data, list):
            self.transport.writelines([*self.held, *data])
        else:
            self.transport.write(b"".join((*self.held, data)) if self.held else data)
        if self.held:
            self.held.clear()
            if self.release is not None:
                self.release.cancel()
                self.release = None

    def _hold(self, data: bytes) -> None:
        """A PING answer leaves with the next write, or within HOLD_S: a client that pings after every
        answer (gRPC's window estimate) would otherwise cost the server a system call per call."""
        if not self.held:
            self.release = asyncio.get_running_loop().call_later(HOLD_S, self._release)
        self.held.append(data)

    def _release(self) -> None:
        self.release = None
        self._write(b"")

    def go_away(self) -> None:
        """Refuse new calls; the open ones finish, then the connection closes."""
        if not self.going_away:
            self.going_away = True
            self._write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, NO_ERROR)))
        self._close_when_idle()

    def _close_when_idle(self) -> None:
        if self.going_away and not self.streams:
            self._shut()

    def _close_with(self, code: int, reason: str) -> None:
        log(logger, logging.INFO, "gRPC connection closed", error=reason)
        self._write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, code) + reason.encode()))
        self._shut()

    def _shut(self) -> None:
        """End the connection with a FIN after what was written, and read (dropping it) what the client
        still sends until it closes too, or LINGER_S passes: a socket closed with unread bytes answers
        them with a reset, which can destroy the GOAWAY before the client reads it."""
        t = self.transport
        if t is None or self.shut:
            return
        if self.held:
            self._write(b"")
        self.shut = True
        if t.is_closing() or not t.can_write_eof():
            t.close()
            return
        t.write_eof()
        self.linger = asyncio.get_running_loop().call_later(LINGER_S, t.close)


class GrpcServer:
    """Unary and streaming methods by path ('/package.Service/Method') served on one listening socket."""

    def __init__(self, methods: dict[str, Unary], max_message: int, streaming: dict[str, Streaming] | None = None) -> None:
        self.methods = {path.encode(): m for path, m in methods.items()}
        self.streaming = {path.encode(): m for path, m in (streaming or {}).items()}
        self.max_message = max_message
        self.connections: set[GrpcConnection] = set()
        self.closing = False
        self._listener: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port) -> the bound port."""
        loop = asyncio.get_running_loop()
        self._listener = await loop.create_server(lambda: GrpcConnection(self), host, port, reuse_address=True)
        return int(self._listener.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        """Stop listening, let the calls in flight finish for up to grace_s, then close every connection."""
        self.closing = True
        if self._listener is not None:
            self._listener.close()
        for c in list(self.connections):
            c.go_away()
        deadline = time.monotonic() + grace_s
        while any(c.streams for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for c in list(self.connections):
            for s in list(c.streams.values()):
                if s.task is not None:
                    s.task.cancel()
            if c.transport is not None:
                c.transport.close()
        if self._listener is not None:
            await self._listener.wait_closed()
