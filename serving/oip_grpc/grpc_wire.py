"""gRPC's rules over HTTP/2, as pure functions: which request heads a server takes (RFC 9113's
rules for a request, gRPC's for a call), its deadline, its messages, and the trailers that end
an answer."""
from __future__ import annotations

import struct
import zlib
from urllib.parse import quote

from .header_block import literal_header

# gRPC status codes by name (grpc.StatusCode's names, as serving/errors.py spells them)
STATUS = {name: code for code, name in enumerate((
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"))}
TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
CONNECTION_SPECIFIC = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
MESSAGE_PREFIX = struct.Struct(">BI")  # compressed flag, length

RESPONSE_HEADERS = (b"\x88"  # ':status: 200', the static table's 8th entry
                    + literal_header(b"content-type", b"application/grpc")
                    + literal_header(b"grpc-accept-encoding", b"identity,deflate,gzip"))
OK_TRAILERS = literal_header(b"grpc-status", b"0")


class RpcError(Exception):
    """A call's failure as gRPC reports it: a status code (a name of STATUS) and a message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class MalformedHead(ValueError):
    """A request head HTTP/2 forbids (RFC 9113 8.1.1): the stream is reset with PROTOCOL_ERROR."""


def request_head(fields: list[tuple[bytes, bytes]], trailers: bool = False) -> dict[bytes, bytes]:
    """A request's header fields as a dict, checked as RFC 9113 8.2 and 8.3.1 ask."""
    head: dict[bytes, bytes] = {}
    regular = False
    for name, value in fields:
        if name != name.lower():
            raise MalformedHead(f"header {name!r} has upper-case letters")
        if name[:1] == b":":
            if trailers or regular:
                raise MalformedHead(f"pseudo-header {name.decode()} after a regular header or in trailers")
            if name not in REQUEST_PSEUDO:
                raise MalformedHead(f"pseudo-header {name.decode()} is none of a request's")
            if name in head:
                raise MalformedHead(f"pseudo-header {name.decode()} twice")
        else:
            regular = True
            if name in CONNECTION_SPECIFIC or (name == b"te" and value != b"trailers"):
                raise MalformedHead(f"connection-specific header {name.decode()}")
        head[name] = value
    if not trailers:
        missing = [p.decode() for p in (b":method", b":scheme", b":path") if p not in head]
        if missing or not head[b":path"]:
            raise MalformedHead(f"a request needs :method, :scheme and a non-empty :path (missing {missing or [':path']})")
    return head


def content_length(head: dict[bytes, bytes]) -> int | None:
    value = head.get(b"content-length")
    if value is None:
        return None
    if not value.isdigit():
        raise MalformedHead(f"content-length {value!r} is not a number")
    return int(value)


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
    compressed, n = MESSAGE_PREFIX.unpack_from(body)
    if len(body) != 5 + n:
        raise RpcError("INTERNAL", f"the request's message says {n} bytes, the stream carried {len(body) - 5}; "
                                   "a unary call sends exactly one message")
    return open_message(compressed, memoryview(body)[5:], encoding, limit)


def take_messages(body: bytearray) -> list[tuple[int, bytes]]:
    """The whole messages at the start of a streaming call's body as (compressed flag, bytes),
    removed from it; a message still arriving stays."""
    out: list[tuple[int, bytes]] = []
    at = 0
    with memoryview(body) as view:  # each message copied once, out of the body (a slice of it would copy twice)
        while len(view) - at >= 5:
            compressed, n = MESSAGE_PREFIX.unpack_from(view, at)
            if len(view) - at < 5 + n:
                break
            out.append((compressed, bytes(view[at + 5:at + 5 + n])))
            at += 5 + n
    if at:
        del body[:at]
    return out


def open_message(compressed: int, message: memoryview, encoding: bytes | None, limit: int) -> memoryview:
    """A message's bytes, inflated where its flag says it is compressed (gzip or deflate)."""
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


def status_trailers(code: str, message: str) -> bytes:
    """grpc-status and grpc-message, the message percent-encoded as gRPC asks (printable ASCII but '%' as is)."""
    return (literal_header(b"grpc-status", str(STATUS[code]).encode())
            + literal_header(b"grpc-message", quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()))


def not_grpc_answer(status: int, why: str) -> tuple[bytes, bytes]:
    """(head, body) for a request that is no gRPC call, answered in plain HTTP as gRPC asks (415, 405)."""
    body = (why + "\n").encode()
    head = (literal_header(b":status", str(status).encode()) + literal_header(b"content-type", b"text/plain")
            + literal_header(b"content-length", str(len(body)).encode()))
    return head, body
