"""Serving benchmark: bounded closed-loop load on a real `kubetrt serve` process.

    python bench/serving.py [PACKAGE] [--seconds 3] [--concurrency 1,8,64]

Starts the server twice in a subprocess (batching on: --max-batch-size N; off: --max-batch-size 1)
so the load generator (asyncio + httpx, batch-1 OIP requests with the binary tensor extension,
bodies pre-encoded) never shares a GIL with it. Each cell runs `--seconds` after a short warm-up
and reports throughput, p50 and p99. Also reported, against the targets:
- throughput ratio on/off at the highest concurrency (target >= 4x),
- p99 with batching vs max queue delay + 3x the mean batch compute time the server measured
  (its kubetrt_compute_duration_seconds histogram over the cell),
- server overhead at concurrency 1: end-to-end p50 minus the runtime's own model.predict p50 for
  one row, measured in this process (target <= 1 ms).
Without PACKAGE, the small CNN is built (or taken from the cache) by the test zoo.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np



@dataclass
class Cell:
    mode: str
    concurrency: int
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p99_ms: float
    mean_batch: float
    compute_ms: float  # mean server-side compute per batch over the cell
    server_ms: float  # mean time a request spent in the server's handler (queue + compute + codecs)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


class Server:
    def __init__(self, package: Path, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "kubetrt.cli", "-v", "serve", str(package), "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = ""
        found = threading.Event()
        self.log: list[str] = []

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line)
                m = re.search(r"running on (http://[\d.]+:\d+)", line)
                if m:
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(120) or not self.url:
            raise RuntimeError("server did not start:\n" + "".join(self.log))
        deadline = time.monotonic() + 120
        while httpx.get(self.url + "/v2/health/ready").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("server not ready:\n" + "".join(self.log))
            time.sleep(0.05)

    def metric_sums(self, model: str) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        out = {}
        for name in ("kubetrt_batch_size", "kubetrt_compute_duration_seconds", "kubetrt_request_duration_seconds"):
            for suffix in ("sum", "count"):
                m = re.search(rf'^{name}_{suffix}{{model="{re.escape(model)}"}} (\S+)$', text, re.M)
                out[f"{name}_{suffix}"] = float(m.group(1)) if m else 0.0
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def request_body(name: str, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({
        "inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes}}],
        "parameters": {"binary_data_output": True},
    }).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header)),
                                  "Content-Type": "application/octet-stream"}


WIRE_MS = float("nan")
CONNECTIONS_PER_CLIENT = 8  # httpcore's pool scans every connection per request: keep pools small


async def closed_loop(url: str, model: str, body: bytes, headers: dict[str, str], concurrency: int,
                      warmup_s: float, seconds: float) -> tuple[list[float], int, float]:
    """`concurrency` workers, each sending its next request when the last one returned."""
    n_clients = -(-concurrency // CONNECTIONS_PER_CLIENT)
    per = min(concurrency, CONNECTIONS_PER_CLIENT)
    clients = [httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=per, max_keepalive_connections=per))
               for _ in range(n_clients)]
    latencies: list[float] = []
    errors = 0
    path = f"/v2/models/{model}/infer"
    start = time.perf_counter()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at:
                return
            r = await client.post(path, content=body, headers=headers)
            t1 = time.perf_counter()
            if t0 >= measure_from and t1 <= stop_at:
                if r.status_code == 200:
                    latencies.append(t1 - t0)
                else:
                    errors += 1

    try:
        await asyncio.gather(*(worker(clients[i // CONNECTIONS_PER_CLIENT]) for i in range(concurrency)))
    finally:
        for c in clients:
            await c.aclose()
    return latencies, errors, seconds


def wire_p50_ms(url: str, model: str, body: bytes, headers: dict[str, str], n: int = 300) -> float:
    """c=1 latency seen by a minimal keep-alive HTTP/1.1 socket client: the server's share of the
    end-to-end time without the client library's (httpx costs milliseconds on a busy 2-core box)."""
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    raw = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n{head}\r\n"
           ).encode() + body
    ts = []
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(n + 20):
            t0 = time.perf_counter()
            sock.sendall(raw)
            buf = b""
            while True:
                buf += sock.recv(1 << 16)
                head_end = buf.find(b"\r\n\r\n")
                if head_end >= 0 and not buf.startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"the server answered {buf[:head_end].splitlines()[0].decode()}: "
                                       f"{buf[head_end + 4:][:300]!r}")
                if head_end >= 0:
                    m = re.search(rb"content-length: (\d+)", buf[:head_end], re.I)
                    if m and len(buf) - head_end - 4 >= int(m.group(1)):
                        break
            if i >= 20:
                ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def one_row(spec: Any) -> np.ndarray:
    """A batch-1 request tensor for an input of the manifest: its shape and dtype as declared."""
    shape = [1 if i == 0 or d < 0 else d for i, d in enumerate(spec.shape)]
    return np.random.default_rng(0).random(shape).astype(spec.dtype)


def run_cells(package: Path, model: str, body: bytes, headers: dict[str, str], mode: str, server_args: list[str],
              concurrencies: list[int], seconds: float) -> list[Cell]:
    server = Server(package, server_args)
    cells = []
    try:
        if mode == "on":
            global WIRE_MS
            WIRE_MS = wire_p50_ms(server.url, model, body, headers)
        for c in concurrencies:
            before = server.metric_sums(model)
            lat, errors, secs = asyncio.run(closed_loop(server.url, model, body, headers, c, min(1.0, seconds / 3), seconds))
            after = server.metric_sums(model)
            d = {k: after[k] - before[k] for k in after}
            n_batches = max(d["kubetrt_batch_size_count"], 1)
            lat_ms = np.asarray(lat) * 1e3 if lat else np.asarray([np.nan])
            cells.append(Cell(mode, c, len(lat), errors, secs, float(np.percentile(lat_ms, 50)),
                              float(np.percentile(lat_ms, 99)), d["kubetrt_batch_size_sum"] / n_batches,
                              d["kubetrt_compute_duration_seconds_sum"] / n_batches * 1e3,
                              d["kubetrt_request_duration_seconds_sum"]
                              / max(d["kubetrt_request_duration_seconds_count"], 1) * 1e3))
            print(f"  {mode:<4} c={c:<3} {cells[-1].rps:8.1f} req/s  p50 {cells[-1].p50_ms:7.2f} ms  "
                  f"p99 {cells[-1].p99_ms:7.2f} ms  batch {cells[-1].mean_batch:5.1f}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return cells


def predict_p50_ms(package: Path, device: str, rows: int = 1, runs: int = 200) -> float:
    from kubetrt.runtime import load_model

    m = load_model(package, device)
    x = {m.inputs[0].name: np.random.default_rng(0).random((rows, *m.inputs[0].shape[1:]), dtype=np.float32)}
    for _ in range(10):
        m.predict(x)
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        m.predict(x)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) * 1e3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package", nargs="?", type=Path, help="model package (default: the zoo's small_cnn)")
    p.add_argument("--seconds", type=float, default=3.0, help="measured seconds per cell")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-queue-delay-us", type=int, default=500)
    p.add_argument("--device", default="host")
    args = p.parse_args(argv)

    package = args.package
    if package is None:
        from _zoo import zoo  # bench/_zoo.py: the test zoo's cached small CNN

        package = zoo().package("small_cnn")
    from kubetrt.runtime.package import read_manifest

    manifest = read_manifest(package)
    model = manifest.name
    body, headers = request_body(manifest.inputs[0].name, one_row(manifest.inputs[0]))
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    common = ["--device", args.device, "--max-queue-delay-us", str(args.max_queue_delay_us),
              "--max-queue-size", "4096"]

    predict_ms = predict_p50_ms(package, args.device)
    predict_max_ms = predict_p50_ms(package, args.device, rows=args.max_batch_size, runs=20)
    on = run_cells(package, model, body, headers, "on", [*common, "--max-batch-size", str(args.max_batch_size)],
                   concurrencies, args.seconds)
    off = run_cells(package, model, body, headers, "off", [*common, "--max-batch-size", "1"], concurrencies, args.seconds)

    print(f"\nkubetrt serving bench: {model} ({package}), device {args.device}, batch-1 OIP binary requests, "
          f"{args.seconds:g} s per cell, max batch {args.max_batch_size}, max queue delay {args.max_queue_delay_us} us")
    print(f"runtime model.predict, 1 row, in-process p50: {predict_ms:.3f} ms; "
          f"{args.max_batch_size} rows: {predict_max_ms:.3f} ms ({predict_max_ms / args.max_batch_size:.3f} ms/row)")
    print("compute ms = mean server-side runtime call per batch; in-server = mean handler time per request\n")
    print(f"{'conc':>5} | {'on req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6} {'compute ms':>10} {'in-server':>9} | "
          f"{'off req/s':>9} {'p50 ms':>8} {'p99 ms':>8} | {'on/off':>6}")
    for a, b in zip(on, off):
        print(f"{a.concurrency:>5} | {a.rps:9.1f} {a.p50_ms:8.2f} {a.p99_ms:8.2f} {a.mean_batch:6.1f} {a.compute_ms:10.2f} "
              f"{a.server_ms:9.2f} | "
              f"{b.rps:9.1f} {b.p50_ms:8.2f} {b.p99_ms:8.2f} | {a.rps / max(b.rps, 1e-9):5.2f}x")
    errors = sum(c.errors for c in on + off)
    hi_on, hi_off = on[-1], off[-1]
    ratio = hi_on.rps / max(hi_off.rps, 1e-9)
    bound = args.max_queue_delay_us / 1e3 + 3 * hi_on.compute_ms
    c1 = next((c for c in on if c.concurrency == 1), None)
    print()
    print(f"throughput on/off at c={hi_on.concurrency}: {ratio:.2f}x (target >= 4x) -> {'PASS' if ratio >= 4 else 'MISS'}")
    print(f"p99 on at c={hi_on.concurrency}: {hi_on.p99_ms:.2f} ms vs queue delay + 3 x batch compute = {bound:.2f} ms "
          f"-> {'PASS' if hi_on.p99_ms <= bound else 'MISS'}")
    if c1 is not None:
        overhead = c1.p50_ms - predict_ms
        print(f"overhead at c=1 (httpx client): p50 {c1.p50_ms:.3f} ms - predict {predict_ms:.3f} ms = {overhead:.3f} ms "
              f"(target <= 1 ms) -> {'PASS' if overhead <= 1 else 'MISS'}")
        wire = WIRE_MS - predict_ms
        print(f"overhead at c=1 (raw socket client): p50 {WIRE_MS:.3f} ms - predict {predict_ms:.3f} ms = {wire:.3f} ms "
              f"(target <= 1 ms) -> {'PASS' if wire <= 1 else 'MISS'}")
    print(f"non-200 responses: {errors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
