"""gRPC unary calls over HTTP/2 (cleartext, prior knowledge: what gRPC's insecure channels speak),
served on the event loop the REST routes run on.

Why not grpc.aio: its calls are read by gRPC's C core on threads of its own and reach the event
loop through a poller thread, several hand-offs of the GIL per call; at one client that costs more
than the whole budget of a small model's call. Here a call's frames are read, its handler run and
its answer written by the loop itself, in one turn where the handler does not wait.

What it speaks: the frames, settings, flow control (both ways) and errors of RFC 9113 that a gRPC
client uses; HPACK (header_block.py); gRPC's message framing, `grpc-timeout`, gzip
and deflate request messages, trailers-only error answers. Not spoken: server push, streaming
calls (every rpc of the OIP service is unary), TLS (a pod's port is cleartext, as with grpc.aio).
"""
from __future__ import annotations

import asyncio
import logging
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Awaitable, Callable, cast
from urllib.parse import quote

from kubetrt.telemetry.logs import log

from .header_block import HeaderBlockError, HeaderDecoder, literal_header

logger = logging.getLogger("kubetrt.serving")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x1, 0x3, 0x4
SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x5, 0x6
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR = 0x0, 0x1, 0x2, 0x3, 0x6
REFUSED_STREAM, COMPRESSION_ERROR = 0x7, 0x9

DEFAULT_WINDOW = 65_535  # both directions' windows before any SETTINGS or WINDOW_UPDATE
MAX_WINDOW = (1 << 31) - 1
RECEIVE_WINDOW = 1 << 24  # what a client may send ahead of the server's reading, per stream and per connection
MAX_STREAMS = 1024  # calls open at once on one connection; past it a new one is refused (REFUSED_STREAM)
MAX_HEADER_BLOCK = 64 << 10
DEFAULT_FRAME = 16_384
HOLD_S = 0.005  # the longest a PING answer waits for company
RECEIVE_FRAME_LIMIT = DEFAULT_FRAME  # this server announces no larger SETTINGS_MAX_FRAME_SIZE

# gRPC status codes by name (grpc.StatusCode's names, as serving/errors.py spells them)
STATUS = {name: code for code, name in enumerate((
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))}
TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_FRAME_HEADER = struct.Struct(">IBI")  # 24-bit length in the top of a 32-bit word with the type: unpacked by hand
_PACK_HEADER = struct.Struct(">HBBBI")
_MESSAGE_PREFIX = struct.Struct(">BI")
_SETTING = struct.Struct(">HI")
_WINDOW = struct.Struct(">I")


class RpcError(Exception):
    """A call's failure as gRPC reports it: a status code (a name of STATUS) and a message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# A unary method: (request message bytes, seconds left before the client's deadline or None) -> answer bytes
Unary = Callable[[memoryview, "float | None"], Awaitable[bytes]]


def frame(kind: int, flags: int, stream: int, payload: bytes | memoryview = b"") -> bytes:
    n = len(payload)
    return _PACK_HEADER.pack(n >> 8, n & 0xFF, kind, flags, stream) + bytes(payload)


RESPONSE_HEADERS = (b"\x88"  # ':status: 200', the static table's 8th entry
                    + literal_header(b"content-type", b"application/grpc")
                    + literal_header(b"grpc-accept-encoding", b"identity,deflate,gzip"))
OK_TRAILERS = literal_header(b"grpc-status", b"0")


def status_trailers(code: str, message: str) -> bytes:
    return (literal_header(b"grpc-status", str(STATUS[code]).encode())
            + literal_header(b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()))


def parse_timeout(value: bytes) -> float:
    """A grpc-timeout header ('100m', '5S') in seconds."""
    unit = TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit() or len(value) > 9:
        raise RpcError("INVALID_ARGUMENT", f"grpc-timeout {value.decode(errors='replace')!r}: expected up to 8 digits "
                                           "and a unit of H, M, S, m, u or n")
    return int(value[:-1]) * unit


def unframe_message(body: bytearray, encoding: bytes | None, limit: int) -> memoryview:
    """The one message of a unary request body: a flag byte (compressed or not), a 32-bit length, the bytes."""
    if len(body) < 5:
        raise RpcError("INTERNAL", "the request carries no message; a unary call sends exactly one")
    compressed, n = _MESSAGE_PREFIX.unpack_from(body)
    if len(body) != 5 + n:
        raise RpcError("INTERNAL", f"the request's message says {n} bytes, the stream carried {len(body) - 5}; "
                                   "a unary call sends exactly one message")
    message = memoryview(body)[5:]
    if not compressed:
        return message
    if encoding in (b"gzip", b"deflate"):
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == b"gzip" else zlib.MAX_WBITS)
        try:
            plain = inflater.decompress(message, limit + 1)
        except zlib.error as e:
            raise RpcError("INTERNAL", f"the request's {encoding.decode()} message does not inflate: {e}") from None
        if len(plain) > limit:
            raise RpcError("RESOURCE_EXHAUSTED", f"the request's message inflates past {limit} bytes, the most this server takes")
        return memoryview(plain)
    name = "none" if encoding is None else encoding.decode(errors="replace")
    raise RpcError("UNIMPLEMENTED", f"the message is compressed with grpc-encoding {name!r}; "
                                    "expected identity, gzip or deflate")


@dataclass
class _Stream:
    id: int
    headers: dict[bytes, bytes] = field(default_factory=dict)
    block: bytearray = field(default_factory=bytearray)  # a header block awaiting its CONTINUATION
    body: bytearray = field(default_factory=bytearray)
    send_window: int = DEFAULT_WINDOW
    pending: list[memoryview] = field(default_factory=list)  # answer DATA not yet sent for want of window
    trailers: bytes = b""
    task: asyncio.Task[None] | None = None
    deadline: float | None = None
    received: bool = False
    unacked: int = 0  # bytes read since the stream's last WINDOW_UPDATE


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
        self.last_stream = 0
        self.continuing: _Stream | None = None  # the stream whose header block is being continued
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_frame = DEFAULT_FRAME
        self.receive_window = RECEIVE_WINDOW
        self.unacked = 0  # bytes read since the last connection WINDOW_UPDATE
        self.going_away = False

    # --- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream's (uvloop's is no asyncio.Transport subclass)
        self.server.connections.add(self)
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (SETTINGS_MAX_CONCURRENT_STREAMS, MAX_STREAMS), (SETTINGS_INITIAL_WINDOW_SIZE, RECEIVE_WINDOW),
            (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK)))
        self.transport.write(frame(SETTINGS, 0, 0, settings)
                             + frame(WINDOW_UPDATE, 0, 0, _WINDOW.pack(RECEIVE_WINDOW - DEFAULT_WINDOW)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for s in self.streams.values():
            if s.task is not None:
                s.task.cancel()
        self.streams.clear()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        if not self.preface:
            if len(buf) < len(PREFACE):
                if not PREFACE.startswith(bytes(buf)):
                    self._close_with(PROTOCOL_ERROR, "expected the HTTP/2 connection preface (gRPC over h2c)")
                return
            if not buf.startswith(PREFACE):
                self._close_with(PROTOCOL_ERROR, "expected the HTTP/2 connection preface (gRPC over h2c)")
                return
            del buf[:len(PREFACE)]
            self.preface = True
        view = memoryview(buf)
        at, end = 0, len(buf)
        try:
            while end - at >= 9:
                word, flags, stream = _FRAME_HEADER.unpack_from(view, at)
                length, kind = word >> 8, word & 0xFF
                if length > RECEIVE_FRAME_LIMIT:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"a frame of {length} bytes, past the {RECEIVE_FRAME_LIMIT} "
                                                             "this server announced")
                if end - at < 9 + length:
                    break
                self._frame(kind, flags, stream & 0x7FFFFFFF, view[at + 9:at + 9 + length])
                at += 9 + length
        except _ConnectionError as e:
            view.release()
            self._close_with(e.code, str(e))
            return
        except Exception as e:  # a bug here must cost one connection, not the loop's other work
            view.release()
            log(logger, logging.ERROR, "gRPC connection failed", error=repr(e))
            self._close_with(INTERNAL_ERROR, f"the server failed: {type(e).__name__}")
            return
        view.release()
        del buf[:at]
        if self.unacked >= RECEIVE_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, _WINDOW.pack(self.unacked)))
            self.receive_window += self.unacked
            self.unacked = 0

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
                self._header_block(s, bool(s.headers), s.received)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif kind == PING:
            if not flags & ACK:
                self._hold(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            s = self.streams.pop(sid, None)
            if s is not None and s.task is not None:
                s.task.cancel()
        elif kind == GOAWAY:
            self.going_away = True
            self._close_when_idle()
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client may not push")
        # PRIORITY and unknown frame types are ignored, as RFC 9113 asks

    def _headers(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS on stream 0")
        start, end = 0, len(payload)
        if flags & PADDED:
            start, end = 1, end - payload[0]
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS padding longer than the frame")
        s = self.streams.get(sid)
        trailers = s is not None
        if s is None:
            if sid % 2 == 0 or sid <= self.last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, f"stream {sid}: a client's new stream takes an odd id above {self.last_stream}")
            self.last_stream = sid
            s = _Stream(sid, send_window=self.peer_initial_window)
            self.streams[sid] = s
        s.block = bytearray(payload[start:end])
        s.received = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block(s, trailers, s.received)
        else:
            self.continuing = s

    def _header_block(self, s: _Stream, trailers: bool, ended: bool) -> None:
        try:
            fields = self.decoder.decode(bytes(s.block))
        except HeaderBlockError as e:
            raise _ConnectionError(COMPRESSION_ERROR, f"a header block does not decode: {e}") from None
        s.block = bytearray()
        if trailers:  # a client's trailers end its stream; a unary request has nothing in them we read
            if not ended:
                self._reset(s, PROTOCOL_ERROR)
                return
        else:
            s.headers = fields
            if len(self.streams) > MAX_STREAMS or self.going_away or self.server.closing:
                self._reset(s, REFUSED_STREAM)
                return
            timeout = s.headers.get(b"grpc-timeout")
            if timeout is not None:
                try:
                    s.deadline = time.monotonic() + parse_timeout(timeout)
                except RpcError as e:
                    self._answer_error(s, e)
                    return
        if ended:
            self._start(s)

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        n = len(payload)
        self.receive_window -= n
        self.unacked += n
        if self.receive_window < 0:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA past the connection's window")
        s = self.streams.get(sid)
        if s is None or s.received:
            if sid == 0 or sid > self.last_stream:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on stream {sid}, which was never opened")
            return  # a stream already reset or answered: its data is dropped (its window is still counted above)
        start, end = 0, n
        if flags & PADDED:
            start, end = 1, n - payload[0]
        if len(s.body) + end - start > self.server.max_message + 5:
            self._answer_error(s, RpcError("RESOURCE_EXHAUSTED", f"the request's message is larger than "
                                                               f"{self.server.max_message} bytes, the most this server takes"))
            return
        s.body += payload[start:end]
        s.unacked += n
        if s.unacked >= RECEIVE_WINDOW // 2 and not flags & END_STREAM:  # a message larger than the window
            self._write(frame(WINDOW_UPDATE, 0, sid, _WINDOW.pack(s.unacked)))
            s.unacked = 0
        if flags & END_STREAM:
            s.received = True
            self._start(s)

    def _settings(self, payload: memoryview) -> None:
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
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_pending()

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "a WINDOW_UPDATE frame carries 4 bytes")
        increment = _WINDOW.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection's window grew past 2^31-1")
        else:
            s = self.streams.get(sid)
            if s is None:
                return
            s.send_window += increment
        self._flush_pending()

    # --- calls
    def _start(self, s: _Stream) -> None:
        h = s.headers
        method = self.server.methods.get(h.get(b":path", b""))
        if h.get(b":method") != b"POST" or not h.get(b"content-type", b"").startswith(b"application/grpc"):
            self._answer_error(s, RpcError("UNIMPLEMENTED", "expected a gRPC call: POST with content-type application/grpc"))
            return
        if method is None:
            path = h.get(b":path", b"").decode(errors="replace")
            self._answer_error(s, RpcError("UNIMPLEMENTED", f"unknown method {path}; this server answers "
                                                            f"{', '.join(sorted(p.decode() for p in self.server.methods))}"))
            return
        try:
            message = unframe_message(s.body, h.get(b"grpc-encoding"), self.server.max_message)
        except RpcError as e:
            self._answer_error(s, e)
            return
        s.task = asyncio.get_running_loop().create_task(self._call(s, method, message))

    async def _call(self, s: _Stream, method: Unary, message: memoryview) -> None:
        try:
            remaining = None if s.deadline is None else s.deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise RpcError("DEADLINE_EXCEEDED", "the call's deadline passed before it started")
            answer = await method(message, remaining)
        except RpcError as e:
            self._answer_error(s, e)
        except asyncio.CancelledError:
            if self.streams.get(s.id) is s:  # the server stops under the call; the client's reset ends it otherwise
                self._answer_error(s, RpcError("CANCELLED", "the server stopped before the call ended"))
            raise
        except Exception as e:  # a handler's bug: the client hears INTERNAL, the log says what it was
            log(logger, logging.ERROR, "gRPC call failed", stream=s.id, error=repr(e))
            self._answer_error(s, RpcError("INTERNAL", f"the server failed: {type(e).__name__}"))
        else:
            self._answer(s, answer)
        finally:
            s.task = None
            self._close_when_idle()

    def _answer(self, s: _Stream, message: bytes) -> None:
        if self.streams.get(s.id) is not s or self.transport is None:
            return
        s.pending = [memoryview(_MESSAGE_PREFIX.pack(0, len(message)) + message)]
        s.trailers = OK_TRAILERS
        self._send(s, frame(HEADERS, END_HEADERS, s.id, RESPONSE_HEADERS))

    def _answer_error(self, s: _Stream, e: RpcError) -> None:
        """A trailers-only answer: one HEADERS frame with the status, ending the stream."""
        if self.streams.pop(s.id, None) is None or self.transport is None:
            return
        self._write(frame(HEADERS, END_HEADERS | END_STREAM, s.id, RESPONSE_HEADERS + status_trailers(e.code, e.message)))
        if not s.received:
            self._reset(s, NO_ERROR)  # the client may stop sending: the answer is complete

    def _send(self, s: _Stream, head: bytes = b"") -> None:
        """Write what the windows allow of a stream's answer (after its head, where given); its
        trailers once all of it is out."""
        out: list[bytes | memoryview] = [head] if head else []
        while s.pending:
            chunk = s.pending[0]
            n = min(len(chunk), self.peer_frame, self.send_window, s.send_window)
            if n <= 0 and chunk:
                break
            out.append(_PACK_HEADER.pack(n >> 8, n & 0xFF, DATA, 0, s.id))
            out.append(chunk[:n])
            self.send_window -= n
            s.send_window -= n
            if n == len(chunk):
                s.pending.pop(0)
            else:
                s.pending[0] = chunk[n:]
        if not s.pending:
            out.append(frame(HEADERS, END_HEADERS | END_STREAM, s.id, s.trailers))
            self.streams.pop(s.id, None)
        if out:
            self._write(b"".join(out) if len(out) <= 4 else out)

    def _flush_pending(self) -> None:
        for s in [s for s in self.streams.values() if s.pending]:
            if self.send_window <= 0:
                break
            self._send(s)

    # --- connection
    def _reset(self, s: _Stream, code: int) -> None:
        self.streams.pop(s.id, None)
        if s.task is not None:
            s.task.cancel()
        self._write(frame(RST_STREAM, 0, s.id, _WINDOW.pack(code)))

    def _write(self, data: bytes | list[bytes | memoryview]) -> None:
        """Send now, after any PING answers held back: one system call where it can be."""
        if self.transport is None or self.transport.is_closing():
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
        if self.going_away and not self.streams and self.transport is not None:
            self.transport.close()

    def _close_with(self, code: int, reason: str) -> None:
        log(logger, logging.INFO, "gRPC connection closed", error=reason)
        self._write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, code) + reason.encode()))
        if self.transport is not None:
            self.transport.close()


class _ConnectionError(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class GrpcServer:
    """Unary methods by path ('/package.Service/Method') served on one listening socket."""

    def __init__(self, methods: dict[str, Unary], max_message: int) -> None:
        self.methods = {path.encode(): m for path, m in methods.items()}
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
