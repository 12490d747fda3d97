"""serving/oip_grpc/http2.py, the HTTP/2 server the gRPC endpoint runs on, driven by grpcio's C-core
client (a client we did not write) against test methods: messages past every window and frame
size both ways, calls interleaved on one connection, deadlines, compression, errors, cancellation,
a graceful stop, and a client that speaks no HTTP/2; streaming calls answered message by message;
checked by h2spec, the HTTP/2 conformance suite, case by case. Its HPACK decoder against the
`hpack` package's encoder."""
from __future__ import annotations

import asyncio
import random
import socket
import re
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator

import grpc
import hpack
import pytest
import uvloop

from kubetrt.serving.oip_grpc import http2
from kubetrt.serving.oip_grpc.header_block import HeaderBlockError, HeaderDecoder
from kubetrt.serving.oip_grpc.grpc_wire import RpcError
from kubetrt.serving.oip_grpc.http2 import GrpcServer

MAX_MESSAGE = 8 << 20
REPO = Path(__file__).resolve().parents[2]


class Methods:
    """The test service: each method sees the raw request and the seconds left to its deadline."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.entered = threading.Event()
        self.release = asyncio.Event()

    async def echo(self, message: memoryview, remaining: float | None) -> bytes:
        return bytes(message)

    async def remaining(self, message: memoryview, remaining: float | None) -> bytes:
        return repr(remaining).encode()

    async def fail(self, message: memoryview, remaining: float | None) -> bytes:
        raise RpcError("FAILED_PRECONDITION", bytes(message).decode())

    async def crash(self, message: memoryview, remaining: float | None) -> bytes:
        raise KeyError("a bug")

    async def _held(self) -> None:
        """Wait until released, saying so when entered and when cancelled instead."""
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def hold(self, message: memoryview, remaining: float | None) -> bytes:
        await self._held()
        return b"released"

    def table(self) -> dict[str, Callable[[memoryview, float | None], Awaitable[bytes]]]:
        return {f"/test.Test/{name}": getattr(self, name) for name in ("echo", "remaining", "fail", "crash", "hold")}

    # streaming methods: each request message an integer's digits
    async def running_sum(self, messages: AsyncIterator[memoryview], remaining: float | None) -> AsyncIterator[bytes]:
        total = 0
        async for m in messages:
            total += int(bytes(m))
            yield str(total).encode()

    async def sizes(self, messages: AsyncIterator[memoryview], remaining: float | None) -> AsyncIterator[bytes]:
        async for m in messages:
            yield str(len(m)).encode() + bytes(m[:8])

    async def first_only(self, messages: AsyncIterator[memoryview], remaining: float | None) -> AsyncIterator[bytes]:
        async for m in messages:
            yield bytes(m)
            return

    async def fail_at_zero(self, messages: AsyncIterator[memoryview], remaining: float | None) -> AsyncIterator[bytes]:
        async for m in messages:
            if int(bytes(m)) == 0:
                raise RpcError("ABORTED", "a zero")
            yield bytes(m)

    async def stall(self, messages: AsyncIterator[memoryview], remaining: float | None) -> AsyncIterator[bytes]:
        await self._held()
        async for m in messages:
            yield bytes(m)

    def streams(self) -> dict[str, Callable[[AsyncIterator[memoryview], float | None], AsyncIterator[bytes]]]:
        return {f"/test.Test/{name}": getattr(self, name) for name in ("running_sum", "sizes", "first_only", "fail_at_zero", "stall")}


class Served:
    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.methods = self.run(self._methods())
        self.server = GrpcServer(self.methods.table(), MAX_MESSAGE, self.methods.streams())
        self.port = self.run(self.server.start("127.0.0.1", 0))
        self.target = f"127.0.0.1:{self.port}"

    async def _methods(self) -> Methods:
        return Methods()  # its asyncio.Event belongs to this loop

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        self.run(self.server.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    if s.thread.is_alive():
        s.stop()


def call(channel: grpc.Channel, name: str) -> Any:
    return channel.unary_unary(f"/test.Test/{name}")  # bytes in, bytes out


@pytest.mark.parametrize("size", [0, 1, 16_383, 16_385, 70_000, 3 << 20])
def test_messages_of_every_size_come_back_whole(served, size):
    payload = random.Random(size).randbytes(size)
    with grpc.insecure_channel(served.target) as ch:
        for _ in range(2):  # the second call finds the windows the first left
            assert call(ch, "echo")(payload, timeout=30) == payload


def test_calls_interleaved_on_one_connection_each_get_their_own_answer(served):
    payloads = [random.Random(i).randbytes(random.Random(i).randrange(1, 300_000)) for i in range(48)]
    with grpc.insecure_channel(served.target) as ch, ThreadPoolExecutor(16) as pool:
        echo = call(ch, "echo")
        answers = list(pool.map(lambda p: echo(p, timeout=60), payloads))
    assert answers == payloads


def test_a_compressed_request_is_inflated(served):
    payload = b"0123456789" * 50_000
    with grpc.insecure_channel(served.target, compression=grpc.Compression.Gzip) as ch:
        assert call(ch, "echo")(payload, timeout=30) == payload
    with grpc.insecure_channel(served.target, compression=grpc.Compression.Deflate) as ch:
        assert call(ch, "echo")(payload, timeout=30) == payload


def test_the_clients_deadline_reaches_the_method(served):
    with grpc.insecure_channel(served.target) as ch:
        left = float(call(ch, "remaining")(b"", timeout=7))
        assert 5 < left <= 7.1  # the client rounds its deadline up to the unit it sends
        assert call(ch, "remaining")(b"") == b"None"


def test_errors_carry_their_status_and_message(served):
    message = "model 'ünïcode' wants 100% of: a, b"
    with grpc.insecure_channel(served.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            call(ch, "fail")(message.encode(), timeout=10)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and e.value.details() == message
        with pytest.raises(grpc.RpcError) as e:
            call(ch, "crash")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.INTERNAL and "KeyError" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            ch.unary_unary("/test.Test/nope")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED and "unknown method /test.Test/nope" in e.value.details()
        assert call(ch, "echo")(b"still serving", timeout=10) == b"still serving"


def test_a_message_past_the_limit_is_refused_and_the_connection_serves_on(served):
    with grpc.insecure_channel(served.target, options=[("grpc.max_send_message_length", -1)]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            call(ch, "echo")(bytes(MAX_MESSAGE + 1), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(MAX_MESSAGE) in e.value.details()
        assert call(ch, "echo")(b"after", timeout=10) == b"after"


def test_a_call_the_client_gives_up_on_is_cancelled_in_the_server(served):
    with grpc.insecure_channel(served.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            call(ch, "hold")(b"", timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert served.methods.cancelled.wait(5), "the method kept running after the client reset its stream"
        assert call(ch, "echo")(b"x", timeout=10) == b"x"


def test_stop_lets_the_call_in_flight_finish_and_takes_no_new_ones(served):
    with grpc.insecure_channel(served.target) as ch:
        held = call(ch, "hold").future(b"", timeout=30)
        assert served.methods.entered.wait(10)
        stopping = asyncio.run_coroutine_threadsafe(served.server.stop(10), served.loop)
        time.sleep(0.2)
        served.loop.call_soon_threadsafe(served.methods.release.set)
        assert held.result(10) == b"released"
        stopping.result(10)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", served.port), timeout=5)


def test_a_client_that_speaks_no_http2_is_told_so_and_others_are_served(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        seen = b""
        while chunk := s.recv(65536):
            seen += chunk
    assert b"HTTP/2 connection preface" in seen  # the GOAWAY's debug data, before the close
    with grpc.insecure_channel(served.target) as ch:
        assert call(ch, "echo")(b"ok", timeout=10) == b"ok"


def test_frames_past_the_announced_size_close_the_connection(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + http2.frame(http2.DATA, 0, 1, bytes(20_000)))
        seen = b""
        while chunk := s.recv(65536):
            seen += chunk
    assert b"past the 16384 this server announced" in seen


@pytest.mark.parametrize("ending", ["client's GOAWAY", "connection error"])
def test_a_connection_ends_cleanly_whatever_the_client_had_sent_after(served, ending):
    """Bytes the client sent past the frame that ends the connection, still unread when it ends, must
    not turn the close into a reset, which discards what the server wrote last, its GOAWAY among it
    (checked: a plain close fails this)."""
    first = (http2.frame(http2.GOAWAY, 0, 0, bytes(8)) if ending == "client's GOAWAY"
             else http2.frame(http2.PING, 0, 1, bytes(8)))  # a PING on a stream: PROTOCOL_ERROR
    after = http2.frame(http2.PING, 0, 0, b"after-it") * 60_000  # more than one read of the server's
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as s:
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0) + first + after)
        seen = b""
        while chunk := s.recv(65536):  # a reset raises ConnectionResetError here
            seen += chunk
    frames, rest = _split_frames(seen)
    assert rest == b""
    assert frames[0][0] == http2.SETTINGS
    assert all(k != http2.PING for k, _, _, _ in frames), "a PING past the end was answered"
    if ending == "connection error":
        assert frames[-1][0] == http2.GOAWAY and frames[-1][3][4:8] == http2.PROTOCOL_ERROR.to_bytes(4, "big")


def _header_lists() -> Iterator[list[tuple[bytes, bytes]]]:
    rng = random.Random(7)
    common = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
              (b"content-type", b"application/grpc"), (b"te", b"trailers")]
    for i in range(200):
        fields = list(common)
        fields.append((b"grpc-timeout", f"{rng.randrange(10**7)}u".encode()))
        for _ in range(rng.randrange(4)):
            fields.append((f"x-custom-{rng.randrange(50)}".encode(), rng.randbytes(rng.randrange(0, 300)).hex().encode()))
        yield fields


@pytest.mark.parametrize("huffman", [True, False])
def test_header_blocks_decode_as_hpack_encoded_them(huffman):
    encoder, decoder = hpack.Encoder(), HeaderDecoder(1 << 16)
    for i, fields in enumerate(_header_lists()):
        if i == 100:
            encoder.header_table_size = 256  # the encoder tells the decoder of its smaller table
        block = encoder.encode(fields, huffman=huffman)
        assert decoder.decode(block) == fields
    assert decoder.size <= 256


def test_header_blocks_that_cannot_decode_are_refused():
    decoder = HeaderDecoder(1 << 16)
    with pytest.raises(HeaderBlockError, match="table index 70"):
        decoder.decode(bytes([0x80 | 70]))
    with pytest.raises(HeaderBlockError, match="cut short"):
        decoder.decode(hpack.Encoder().encode([(b"x-long", b"v" * 100)])[:-10])
    with pytest.raises(HeaderBlockError, match="header list past 100 bytes"):
        HeaderDecoder(100).decode(hpack.Encoder().encode([(b"x-long", b"v" * 100)]))


def _read_frames(s: socket.socket, until: Callable[[list[tuple[int, int, int, bytes]]], bool]) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, stream, payload) of every frame the server sends, until `until` holds of them."""
    frames: list[tuple[int, int, int, bytes]] = []
    buf = b""
    while not until(frames):
        chunk = s.recv(65536)
        assert chunk, f"the server closed the connection after {[(k, f, sid) for k, f, sid, _ in frames]}"
        more, buf = _split_frames(buf + chunk)
        frames += more
    return frames


def _split_frames(data: bytes) -> tuple[list[tuple[int, int, int, bytes]], bytes]:
    """The whole frames at the start of `data` as (type, flags, stream, payload), and the bytes after them."""
    frames = []
    while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
        n = int.from_bytes(data[:3], "big")
        frames.append((data[3], data[4], int.from_bytes(data[5:9], "big") & 0x7FFFFFFF, data[9:9 + n]))
        data = data[9 + n:]
    return frames, data


def test_answers_wait_for_the_clients_window(served):
    """A client that announces a 1000-byte window gets 1000 bytes of its answer, the rest as it opens
    the window, in frames no larger than it allows, then the trailers."""
    payload = random.Random(3).randbytes(5000)
    block = hpack.Encoder().encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/test.Test/echo"),
                                    (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    message = b"\x00" + len(payload).to_bytes(4, "big") + payload
    settings = (4).to_bytes(2, "big") + (1000).to_bytes(4, "big")  # SETTINGS_INITIAL_WINDOW_SIZE
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0, settings)
                  + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, block) + http2.frame(http2.DATA, http2.END_STREAM, 1, message))

        def data(frames: list) -> bytes:
            return b"".join(p for k, _, sid, p in frames if k == http2.DATA and sid == 1)

        frames = _read_frames(s, lambda fs: len(data(fs)) >= 1000)
        s.settimeout(0.3)
        with pytest.raises(socket.timeout):  # nothing more until the window opens
            frames += _read_frames(s, lambda fs: False)
        s.settimeout(10)
        assert len(data(frames)) == 1000
        s.sendall(http2.frame(http2.WINDOW_UPDATE, 0, 1, (10_000).to_bytes(4, "big")))
        frames += _read_frames(s, lambda fs: any(k == http2.HEADERS and f & http2.END_STREAM for k, f, _, _ in fs))
    assert data(frames) == message
    assert max(len(p) for k, _, _, p in frames if k == http2.DATA) <= http2.DEFAULT_FRAME
    trailers = HeaderDecoder(1 << 16).decode(frames[-1][3])
    assert trailers == [(b"grpc-status", b"0")]


@pytest.mark.parametrize("pieces", [[1, 3, 9, 2, 7, 16_400, 40_000], [24, 9, 5, 4, 16_393, 1, 33_000, 8], [70_000]])
def test_reads_cut_anywhere_in_a_frame_give_the_same_calls(served, pieces):
    """The client's bytes arrive in reads cut inside the preface, inside a frame's 9-byte header, at
    its end, inside a payload and across several frames: each call's message is read whole.
    (Sent a piece at a time with pauses, so that the server reads each on its own.)"""
    block = hpack.Encoder().encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/test.Test/echo"),
                                    (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    rng = random.Random(5)
    messages = {sid: rng.randbytes(size) for sid, size in ((1, 40_000), (3, 9_000))}
    wire = [http2.PREFACE, http2.frame(http2.SETTINGS, 0, 0)]
    for sid, payload in messages.items():
        body = b"\x00" + len(payload).to_bytes(4, "big") + payload
        wire.append(http2.frame(http2.HEADERS, http2.END_HEADERS, sid, block))
        for at in range(0, len(body), http2.DEFAULT_FRAME):
            last = at + http2.DEFAULT_FRAME >= len(body)
            wire.append(http2.frame(http2.DATA, http2.END_STREAM if last else 0, sid, body[at:at + http2.DEFAULT_FRAME]))
        wire.append(http2.frame(http2.PING, 0, 0, b"between!"))
    data = b"".join(wire)
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        at, i = 0, 0
        while at < len(data):
            s.sendall(data[at:at + pieces[i % len(pieces)]])
            at += pieces[i % len(pieces)]
            i += 1
            time.sleep(0.002)
        frames = _read_frames(s, lambda fs: sum(k == http2.HEADERS and f & http2.END_STREAM for k, f, _, _ in fs) == 2)
    for sid, payload in messages.items():
        answer = b"".join(p for k, _, f_sid, p in frames if k == http2.DATA and f_sid == sid)
        assert answer == b"\x00" + len(payload).to_bytes(4, "big") + payload, f"stream {sid}"
    assert [p for k, f, _, p in frames if k == http2.PING] == [b"between!"] * 2


def stream(channel: grpc.Channel, name: str) -> Any:
    return channel.stream_stream(f"/test.Test/{name}")


def test_a_streaming_call_answers_each_message_before_the_next_is_sent(served):
    """The client sends its next number only once the last one's answer came: a server that waited
    for the end of the request would answer none (and the call's deadline would end it)."""
    sent: list[int] = []
    answered = threading.Event()

    def requests() -> Iterator[bytes]:
        for n in (5, 7, 30, 0, 1):
            sent.append(n)
            yield str(n).encode()
            assert answered.wait(10), f"no answer to {n} before the next message"
            answered.clear()

    with grpc.insecure_channel(served.target) as ch:
        got = []
        for answer in stream(ch, "running_sum")(requests(), timeout=30):
            got.append(int(answer))
            answered.set()
    assert got == [5, 12, 42, 42, 43] and sent == [5, 7, 30, 0, 1]


@pytest.mark.parametrize("compression", [grpc.Compression.NoCompression, grpc.Compression.Gzip])
def test_a_streaming_calls_messages_of_every_size_each_come_whole(served, compression):
    """Messages across frames, reads and windows (and compressed ones inflated), interleaved with
    unary calls on the same connection."""
    payloads = [random.Random(i).randbytes(size) for i, size in enumerate((0, 1, 16_379, 16_384, 70_001, 2 << 20, 9))]
    with grpc.insecure_channel(served.target, compression=compression) as ch:
        answers = stream(ch, "sizes")(iter(payloads * 3), timeout=60)
        assert call(ch, "echo")(b"between", timeout=10) == b"between"
        assert list(answers) == [str(len(p)).encode() + p[:8] for p in payloads * 3]


def test_a_streaming_call_without_messages_ends_ok_with_no_answers(served):
    with grpc.insecure_channel(served.target) as ch:
        answers = stream(ch, "running_sum")(iter(()), timeout=10)
        assert list(answers) == [] and answers.code() == grpc.StatusCode.OK


def test_a_handler_that_ends_early_ends_the_call_ok_while_the_client_still_sends(served):
    def requests() -> Iterator[bytes]:
        yield b"1"
        for _ in range(200):
            time.sleep(0.005)
            yield b"2"

    with grpc.insecure_channel(served.target) as ch:
        answers = stream(ch, "first_only")(requests(), timeout=30)
        assert list(answers) == [b"1"] and answers.code() == grpc.StatusCode.OK
        assert call(ch, "echo")(b"after", timeout=10) == b"after"


def test_a_streaming_error_after_answers_ends_the_call_with_its_status(served):
    with grpc.insecure_channel(served.target) as ch:
        answers = stream(ch, "fail_at_zero")(iter([b"3", b"4", b"0", b"5"]), timeout=10)
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for answer in answers:
                got.append(answer)
        assert got == [b"3", b"4"]
        assert e.value.code() == grpc.StatusCode.ABORTED and e.value.details() == "a zero"
        assert call(ch, "echo")(b"after", timeout=10) == b"after"


def test_a_streaming_call_whose_handler_falls_behind_is_refused_not_buffered_without_end(served):
    with grpc.insecure_channel(served.target) as ch:
        answers = stream(ch, "stall")(iter([b"1"] * (http2.STREAM_BACKLOG + 50)), timeout=30)
        with pytest.raises(grpc.RpcError) as e:
            list(answers)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(http2.STREAM_BACKLOG) in e.value.details()
        assert served.methods.cancelled.wait(5), "the handler kept running after its call failed"


def test_a_streaming_call_the_client_cancels_is_cancelled_in_the_server(served):
    def requests() -> Iterator[bytes]:
        yield b"1"
        time.sleep(30)

    with grpc.insecure_channel(served.target) as ch:
        answers = stream(ch, "stall")(requests(), timeout=30)
        assert served.methods.entered.wait(10)
        answers.cancel()
        assert served.methods.cancelled.wait(5), "the handler kept running after the client cancelled"
        assert call(ch, "echo")(b"after", timeout=10) == b"after"


def test_h2spec_finds_every_case_of_rfc_9113_and_7541_answered_as_they_ask(served):
    """h2spec's 145 cases: frame and stream errors, flow control, settings, header rules, HPACK.
    (Its requests are no gRPC calls; they are answered 415 with a body, which its cases read.)"""
    h2spec = subprocess.run(["bash", str(REPO / "scripts" / "get-go-tool.sh"), "h2spec"], capture_output=True, text=True, check=True)
    run = subprocess.run([h2spec.stdout.strip(), "-h", "127.0.0.1", "-p", str(served.port)],
                         capture_output=True, text=True, timeout=300)
    summary = re.search(r"(\d+) tests, (\d+) passed, (\d+) skipped, (\d+) failed", run.stdout)
    assert summary is not None, run.stdout[-2000:] + run.stderr[-2000:]
    failed = [line.strip() for line in run.stdout.splitlines() if "\u00d7" in line]
    assert summary.groups() == ("145", "145", "0", "0"), f"{summary.group(0)}; failed: {failed}"


def test_a_request_that_is_no_grpc_call_is_told_what_this_port_serves(served):
    block = hpack.Encoder().encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/v2/models/m/infer"),
                                    (b":authority", b"x"), (b"content-type", b"application/json")])
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(http2.PREFACE + http2.frame(http2.SETTINGS, 0, 0)
                  + http2.frame(http2.HEADERS, http2.END_HEADERS, 1, block) + http2.frame(http2.DATA, http2.END_STREAM, 1, b"{}"))
        frames = _read_frames(s, lambda fs: any(k == http2.DATA and f & http2.END_STREAM for k, f, _, _ in fs))
    head = dict(HeaderDecoder(1 << 16).decode(next(p for k, _, sid, p in frames if k == http2.HEADERS and sid == 1)))
    body = b"".join(p for k, _, sid, p in frames if k == http2.DATA and sid == 1)
    assert head[b":status"] == b"415" and b"serves gRPC calls (content-type application/grpc)" in body
