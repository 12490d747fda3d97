"""What one gRPC ModelInfer costs the server's own thread, with no client and no socket beside it.

    python bench/grpc_call_cost.py [--models small_cnn mobilenet_v2] [--calls 3000] [--rounds 3] [--baseline DIR]

bench/serving.py measures what a client sees; on two shared cores its load generator's own CPU and
the loopback's wake-ups move a one-client p50 by more than most changes to the server do. Here the
server's gRPC connection (serving/oip_grpc/http2.py, over the registry and batcher `kubetrt serve`
runs) is fed the frames a grpc-go client sends (ghz's: HEADERS with a fresh grpc-timeout, the
request's DATA, and after the answer the window update and ping it sends) over a transport that
keeps what the server writes. A call is timed from its frames' arrival to its answer's trailers,
one call at a time. Per model: the call's p50, p10 and mean, the model's mean run over the same
calls (its kubetrt_compute_duration_seconds, read before and after them) and the mean call's time
outside its run: what serving adds besides sockets, stalls outside runs included. The last answer
is checked against the model's own output.

`--baseline DIR` adds another checkout (e.g. `git worktree add DIR main`) taking turns with this
one, each run in its own process; the two are compared by their p10 call, which the machine's slow
spells move least.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
CHECKOUT = "kubetrt"
BASELINE = "baseline"
WARMUP_CALLS = 300


class KeptWrites:
    """A transport that keeps the server's writes and says when a stream's answer has ended."""

    def __init__(self) -> None:
        from kubetrt.serving.oip_grpc.http2 import END_STREAM, HEADERS

        self._trailers = (HEADERS, END_STREAM)  # an answer's last frame: HEADERS that end the stream
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.ended: Any = None  # the future the next END_STREAM resolves

    def write(self, data: bytes | memoryview) -> None:
        headers, end_stream = self._trailers
        data, at = bytes(data), 0
        while at + 9 <= len(data):
            word, flags, stream = struct.unpack_from(">IBI", data, at)
            kind, length = word & 0xFF, word >> 8
            self.frames.append((kind, flags, stream & 0x7FFFFFFF, data[at + 9:at + 9 + length]))
            if kind == headers and flags & end_stream and self.ended is not None and not self.ended.done():
                self.ended.set_result(None)
            at += 9 + length
        del self.frames[:-8]  # the last answer is all a check needs

    def writelines(self, parts: list[bytes | memoryview]) -> None:
        self.write(b"".join(bytes(p) for p in parts))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def request_body(name: str, inputs: list[Any]) -> tuple[bytes, dict[str, np.ndarray]]:
    """A framed ModelInferRequest of one row per input (random values, raw contents) and its feeds."""
    from kubetrt.serving.oip_grpc import ModelInferRequest
    from kubetrt.serving.oip_grpc.grpc_wire import MESSAGE_PREFIX
    from kubetrt.serving.tensors import oip_datatype

    rng = np.random.default_rng(0)
    request = ModelInferRequest(model_name=name)
    feeds = {}
    for t in inputs:
        x = rng.random([1, *(max(int(d), 1) for d in t.shape[1:])]).astype(np.dtype(t.dtype))
        feeds[t.name] = x
        request.inputs.add(name=t.name, datatype=oip_datatype(x.dtype), shape=list(x.shape))
        request.raw_input_contents.append(x.tobytes())
    message = request.SerializeToString()
    return MESSAGE_PREFIX.pack(0, len(message)) + message, feeds


def call_frames(body: bytes, count: int) -> list[bytes]:
    """Each call's HEADERS and DATA frames, on streams 1, 3, 5...: headers from one encoder, in order
    (its table is the connection's, as a client's is), DATA in frames of HTTP/2's default largest
    size, which grpc-go's keep to."""
    import hpack

    from kubetrt.serving.oip_grpc.http2 import DATA, DEFAULT_FRAME, END_HEADERS, END_STREAM, HEADERS, frame

    encoder = hpack.Encoder()
    fixed = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
             (b":authority", b"127.0.0.1:8081"), (b"content-type", b"application/grpc"),
             (b"user-agent", b"grpc-go/1.60.1"), (b"te", b"trailers")]
    pieces = [body[at:at + DEFAULT_FRAME] for at in range(0, len(body), DEFAULT_FRAME)]
    out = []
    for i in range(count):
        sid = 2 * i + 1
        head = encoder.encode([*fixed, (b"grpc-timeout", b"%du" % (19_999_000 - i))])
        out.append(frame(HEADERS, END_HEADERS, sid, head) + b"".join(
            frame(DATA, END_STREAM if k == len(pieces) - 1 else 0, sid, piece) for k, piece in enumerate(pieces)))
    return out


async def measure(package: Path, calls: int, warmup: int = WARMUP_CALLS) -> dict[str, float]:
    """Serve the package as `kubetrt serve` does and time `calls` ModelInfer calls after `warmup`."""
    from kubetrt.serving.metrics import ServingMetrics
    from kubetrt.serving.oip_grpc import ModelInferResponse
    from kubetrt.serving.oip_grpc.grpc_wire import MESSAGE_PREFIX
    from kubetrt.serving.oip_grpc.http2 import ACK, DATA, PING, PREFACE, SETTINGS, WINDOW_UPDATE, GrpcConnection, frame
    from kubetrt.serving.oip_grpc.server import create_grpc_server
    from kubetrt.serving.registry import ModelRegistry, ModelSource, ServingConfig

    config = ServingConfig(device="host", grpc_port=0)
    registry = ModelRegistry(config, ServingMetrics())
    served = registry.add_source(ModelSource.local(package))
    await registry.load_all()
    if served.model is None:
        raise RuntimeError(f"{package}: the model did not load: {served.reason}")
    body, feeds = request_body(served.name, served.inputs)
    incoming = call_frames(body, warmup + calls)
    after_answer = frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", len(body))) + frame(PING, 0, 0, bytes(8))

    loop = asyncio.get_running_loop()
    transport = KeptWrites()
    connection = GrpcConnection(create_grpc_server(registry, config))
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.data_received(PREFACE + frame(SETTINGS, 0, 0) + frame(SETTINGS, ACK, 0))

    def run_seconds() -> tuple[float, float]:
        served.metrics.fold()  # what the batcher has reported, observed
        sample, labels = registry.metrics.registry.get_sample_value, {"model": served.name}
        return (sample("kubetrt_compute_duration_seconds_sum", labels) or 0.0,
                sample("kubetrt_compute_duration_seconds_count", labels) or 0.0)

    seconds, before = [], run_seconds()
    for i, frames in enumerate(incoming):
        if i == warmup:
            before = run_seconds()
        transport.ended = loop.create_future()
        t0 = time.perf_counter()
        connection.data_received(frames)
        await transport.ended
        seconds.append(time.perf_counter() - t0)
        connection.data_received(after_answer)
    after = run_seconds()
    if after[1] - before[1] != calls:
        raise RuntimeError(f"{calls} calls ran the model {after[1] - before[1]:g} times, expected once each")
    answer = b"".join(p for kind, _, sid, p in transport.frames if kind == DATA and sid == 2 * len(incoming) - 1)
    got = ModelInferResponse.FromString(answer[MESSAGE_PREFIX.size:])
    want = served.model.predict(feeds)
    for k, out in enumerate(got.outputs):
        dtype = want[out.name].dtype.newbyteorder("<")
        np.testing.assert_allclose(np.frombuffer(got.raw_output_contents[k], dtype).reshape(list(out.shape)),
                                   want[out.name], rtol=1e-5, atol=1e-6)
    registry.close()
    call_us = np.array(seconds[warmup:]) * 1e6
    run_us = (after[0] - before[0]) / calls * 1e6
    return {"p50_us": float(np.median(call_us)), "p10_us": float(np.percentile(call_us, 10)),
            "mean_us": float(call_us.mean()), "run_us": run_us, "outside_us": float(call_us.mean()) - run_us}


def spawn(name: str, calls: int, checkout: Path | None) -> dict[str, float]:
    env = dict(os.environ)
    if checkout is not None:
        env["KUBETRT_BENCH_CHECKOUT"] = str(checkout)
    out = subprocess.run([sys.executable, __file__, "--child", name, "--calls", str(calls)], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {out.stderr.strip()[-600:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["small_cnn", "mobilenet_v2"])
    p.add_argument("--calls", type=int, default=3000, help="timed calls per run, after a warm-up")
    p.add_argument("--rounds", type=int, default=3, help="runs per checkout, taking turns; per model the median")
    p.add_argument("--baseline", type=Path, metavar="DIR", help="another kubetrt checkout, measured as 'baseline'")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    sys.path.insert(0, str(HERE))
    if a.child:
        import _bootstrap  # noqa: F401  kubetrt from this checkout, or the one KUBETRT_BENCH_CHECKOUT names
        import uvloop  # the loop kubetrt serve runs on

        from _zoo import zoo

        print(json.dumps(uvloop.run(measure(zoo().package(a.child), a.calls))))
        return
    from _machine import cpu_line, cpu_tag

    checkouts: dict[str, Path | None] = {CHECKOUT: None}
    if a.baseline is not None:
        if not (a.baseline / "pyproject.toml").is_file():
            p.error(f"--baseline {a.baseline}: not a kubetrt checkout (no pyproject.toml)")
        checkouts[BASELINE] = a.baseline.resolve()
    print(cpu_line())
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for r in range(a.rounds):
        for name in a.models:
            for label, checkout in checkouts.items():
                print(f"[call-cost] {name} {label} (round {r + 1}/{a.rounds})", file=sys.stderr, flush=True)
                results.setdefault((name, label), []).append(spawn(name, a.calls, checkout))
    print(f"\nper gRPC ModelInfer, in process, one call at a time ({a.calls} calls per run, median of {a.rounds} runs)")
    print(f"{'model':<14}{'checkout':<10}{'p50 us':>9}{'p10 us':>9}{'mean us':>9}{'run us':>9}{'outside us':>12}")
    for name in a.models:
        added = {}
        for label in checkouts:
            rows = results[(name, label)]
            p50, p10, mean, run, outside = (statistics.median(r[k] for r in rows)
                                            for k in ("p50_us", "p10_us", "mean_us", "run_us", "outside_us"))
            added[label] = p10
            print(f"{name:<14}{label:<10}{p50:9.1f}{p10:9.1f}{mean:9.1f}{run:9.1f}{outside:12.1f}  {cpu_tag()}")
        if BASELINE in added:
            print(f"{name:<14}p10 call, baseline / kubetrt: {added[BASELINE] / added[CHECKOUT]:.2f} (above 1: this checkout is faster)  {cpu_tag()}")


if __name__ == "__main__":
    main()
