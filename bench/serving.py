"""Serving benchmark: `kubetrt serve` against the model servers people pick instead, on the same
model.onnx, driven by external load generators.

    bench/peers/setup.sh                       # once: the peers' venvs, wrk and ghz (see there)
    python bench/serving.py [--models small_cnn mobilenet_v2] [--protocols json,binary,grpc,shm]
                            [--clients 1,16,64] [--seconds 10] [--warmup 3]
                            [--servers kubetrt,mlserver,kserve,triton] [--rounds 1]
                            [--kubetrt-args '--idle-poll-us 0']   # flags for kubetrt serve (an A/B)
                            [--grpc-load h2load|ghz]

Servers (each in its own venv under ~/.cache/kubetrt-bench/peers; one up at a time):
- kubetrt: `kubetrt serve PACKAGE --port P [--grpc-port G]` on the test zoo's package, at its
  defaults (dynamic batching up to 32 rows; a request that finds the engine idle runs at once).
- mlserver: Seldon MLServer 1.7.1, a custom MLModel running onnxruntime (peers/mlserver_onnx.py),
  its default inference pool (parallel_workers 1), adaptive batching on: max_batch_size 32,
  max_batch_time 500 us (0 turns MLServer's batcher off, so the shortest window that batches).
- kserve: KServe 0.21.0 `kserve.ModelServer` (one worker) with a `kserve.Model` running
  onnxruntime (peers/kserve_onnx.py); its server has no batcher of its own, so none.
- floor: no model at all (peers/transport_floor.py): uvicorn and the gRPC server as kubetrt serve runs them
  read each request (a gRPC one parsed) and answer onnxruntime's outputs encoded once. Its p50 is
  the transport's share of every server's; it is no peer (left out of the ratios).
- triton: tritonserver from the nvidia-pytriton 0.7.0 wheel (C++ HTTP and gRPC front ends, its
  dynamic batcher with max_batch_size 32 and its default queue delay of 0: it batches what queued
  while the model was busy), the model a Python callable running onnxruntime
  (peers/pytriton_onnx.py).
Every peer runs one model instance of onnxruntime with default session options.

Protocols, all Open Inference Protocol V2 with batch-1 requests pre-encoded once:
- json: REST, the tensor as a flat JSON `data` list (floats as Python's json.dumps writes them);
- binary: REST with the binary tensor extension (Inference-Header-Content-Length, raw FP32 body,
  binary_data_output asked for); a server that refuses it is printed as not supporting it;
- grpc: inference.GRPCInferenceService/ModelInfer with raw_input_contents;
- shm: REST JSON naming Triton system shared memory regions for the input and the outputs (two
  POSIX shared memory objects, the input written into one, registered with each server before its
  cells; Triton takes one region per object): what a client on the same host sends when the
  tensors need not cross the socket.
  kubetrt serve runs with --shared-memory; a server without the extension is printed as such.
REST load comes from wrk (one thread, N connections, a Lua script POSTing the body and counting
statuses). gRPC load comes from h2load (nghttp2's HTTP/2 load generator: one thread, N connections,
one call in flight on each, the length-prefixed message as the body of a gRPC POST), or with
--grpc-load ghz from ghz (N workers on N connections, one CPU, the request message
binary-encoded, template processing off). h2load sends the message as bytes and reads the answer
as bytes, where ghz marshals and unmarshals every call's message through protobuf reflection: CPU
taken a call from the cores the server runs on, more the larger the tensor. h2load knows no gRPC
status, so an answer counts as OK where it carries the answer message, as large as the one a
single call before the cell got; one without it (trailers only: any gRPC error) counts as non-OK.
Each cell is a warm-up run, then a measured run of --seconds; after each run one
more request is awaited, so that the next starts on an idle server (a load generator that stops
leaves its last requests in flight). With --rounds N every server takes its turn N times, the
servers alternating (the engine measured again before each round, its least kept), and each cell
prints the median of its rounds' req/s, p50 and p99 and the sum of their counts: on a shared
machine a noisy spell then lands in one round of one server, not in all of its cells. Latency
percentiles are the load generator's: wrk's over
every answered request (503s included), ghz's over the OK ones; nan where nothing was answered
within the run. Non-2xx (503s and RESOURCE_EXHAUSTED apart), socket errors and timeouts are
counted separately, and req/s counts only 2xx/OK answers. Before a server's cells, each
protocol's answer is checked against onnxruntime's own outputs for the same input; a protocol that
answers wrongly or not at all is not timed and prints the reason. The last tables give, per cell,
kubetrt's req/s over the best peer's (above 1: kubetrt serves more) and its p99 over the lowest
peer p99 (below 1: a shorter tail), and, at one client, each server's p50 minus its engine's
in-process time (kubetrt's also minus the engine measured just before and after the cell, the mean
of the two: the machine's speed moves between minutes), and the CPU time the load generator spent
per request: it runs on the cores the engine's threads run on, so on a small machine the engine
runs slower under load than alone.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEERS_DIR = HERE / "peers"
MODELS = ("small_cnn", "mobilenet_v2")
PROTOCOLS = ("json", "binary", "grpc", "shm")
SHM_IN, SHM_OUT = "bench-in", "bench-out"  # the regions the shm protocol's requests name
SERVERS = ("kubetrt", "mlserver", "kserve", "triton", "floor")
FLOOR = "floor"  # no model: the transport alone (peers/transport_floor.py), never a peer to beat
MAX_BATCH = 32  # rows per batch for the peers that batch (kubetrt serve's default --max-batch-size)
TRITON_QUEUE_DELAY_US = 0  # Triton's default: batch what queued while the model was busy, never wait
MLSERVER_BATCH_TIME_S = 0.0005  # MLServer turns its batcher off at 0, so the shortest window that batches
START_TIMEOUT_S = 300.0
GRPC_LOADS = ("h2load", "ghz")
GRPC_LOAD_WORDS = {"h2load": "h2load (1 thread)", "ghz": "ghz (1 CPU)"}
R = TypeVar("R")  # what a load generator's run reports
DTYPES = {"float32": "FP32", "float64": "FP64", "int32": "INT32", "int64": "INT64"}


def cache_dir() -> Path:
    """The bench cache (_machine.bench_cache): the peers' venvs and the load generators."""
    from _machine import bench_cache  # bench/ is on the path: this script's folder

    return bench_cache()


# --------------------------------------------------------------------------- the model and its requests


@dataclass
class Model:
    """One zoo model as every server serves it: names and shapes from the package's manifest."""

    name: str
    package: Path
    onnx: Path
    inputs: list[dict[str, Any]]  # [{name, shape, dtype}]
    outputs: list[dict[str, Any]]
    x: dict[str, np.ndarray]  # one batch-1 request
    expected: dict[str, np.ndarray]  # onnxruntime's outputs for it


def load_model(name: str) -> Model:
    """The zoo's package for `name` (built or taken from the cache) and onnxruntime's answer."""
    sys.path.insert(0, str(HERE))
    import _bootstrap  # noqa: F401  kubetrt importable from this checkout
    from _zoo import zoo

    import onnxruntime as ort
    from kubetrt.runtime.package import read_manifest

    package = zoo().package(name)
    manifest = read_manifest(package)
    rng = np.random.default_rng(0)
    inputs = [{"name": t.name, "shape": [int(d) for d in t.shape], "dtype": np.dtype(t.dtype).name} for t in manifest.inputs]
    outputs = [{"name": t.name, "shape": [int(d) for d in t.shape], "dtype": np.dtype(t.dtype).name} for t in manifest.outputs]
    x = {t["name"]: rng.random([1 if i == 0 or d < 0 else d for i, d in enumerate(t["shape"])]).astype(t["dtype"])
         for t in inputs}
    session = ort.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: x[t["name"]] for t, i in zip(inputs, session.get_inputs())})
    return Model(name, package, package / "model.onnx", inputs, outputs, x,
                 {t["name"]: v for t, v in zip(outputs, got)})


@dataclass
class Bodies:
    """The pre-encoded batch-1 request of each protocol, on disk for the load generators."""

    json: Path
    binary: Path
    binary_header_length: int
    grpc: Path
    grpc_framed: Path  # the same message behind gRPC's 5-byte length prefix: an HTTP/2 POST's whole body
    shm: Path  # the JSON body naming the regions
    memory: tuple[Any, Any]  # the shared memory objects (multiprocessing.shared_memory) of the input and the outputs
    out_offsets: dict[str, int]  # each output's place in its object

    def close(self) -> None:
        for m in self.memory:
            m.close()
            m.unlink()


def json_body(model: Model) -> bytes:
    return json.dumps({"inputs": [
        {"name": t["name"], "shape": list(model.x[t["name"]].shape), "datatype": DTYPES[t["dtype"]],
         "data": model.x[t["name"]].ravel().tolist()} for t in model.inputs]}).encode()


def binary_body(model: Model) -> tuple[bytes, int]:
    header = json.dumps({
        "inputs": [{"name": t["name"], "shape": list(model.x[t["name"]].shape), "datatype": DTYPES[t["dtype"]],
                    "parameters": {"binary_data_size": model.x[t["name"]].nbytes}} for t in model.inputs],
        "outputs": [{"name": t["name"], "parameters": {"binary_data": True}} for t in model.outputs],
        "parameters": {"binary_data_output": True},
    }).encode()
    return header + b"".join(model.x[t["name"]].tobytes() for t in model.inputs), len(header)


def shm_body(model: Model) -> tuple[bytes, int, int, dict[str, int]]:
    """The request naming the input region and the output region -> (body, the inputs' bytes, the
    outputs' bytes, each output's offset in its region)."""
    inputs, at = [], 0
    for t in model.inputs:
        size = model.x[t["name"]].nbytes
        inputs.append({"name": t["name"], "shape": list(model.x[t["name"]].shape), "datatype": DTYPES[t["dtype"]],
                       "parameters": {"shared_memory_region": SHM_IN, "shared_memory_byte_size": size,
                                      "shared_memory_offset": at}})
        at += size
    outputs, out_at, offsets = [], 0, {}
    for t in model.outputs:
        size = model.expected[t["name"]].nbytes
        outputs.append({"name": t["name"], "parameters": {"shared_memory_region": SHM_OUT, "shared_memory_byte_size": size,
                                                           "shared_memory_offset": out_at}})
        offsets[t["name"]] = out_at
        out_at += size
    return json.dumps({"inputs": inputs, "outputs": outputs}).encode(), at, out_at, offsets


def _oip_grpc() -> Any:
    sys.path.insert(0, str(HERE))
    import _bootstrap  # noqa: F401  kubetrt importable from this checkout
    from kubetrt.serving import oip_grpc

    return oip_grpc


def grpc_request(model: Model) -> bytes:
    """ModelInferRequest: model_name, one InferInputTensor per input, raw_input_contents."""
    msg = _oip_grpc().ModelInferRequest(model_name=model.name)
    for t in model.inputs:
        v = model.x[t["name"]]
        msg.inputs.add(name=t["name"], datatype=DTYPES[t["dtype"]], shape=list(v.shape))
        msg.raw_input_contents.append(v.tobytes())
    return bytes(msg.SerializeToString())


def grpc_outputs(response: bytes) -> dict[str, np.ndarray]:
    """The output tensors of a ModelInferResponse, from raw_output_contents or fp32_contents."""
    msg = _oip_grpc().ModelInferResponse.FromString(response)
    out = {}
    for k, t in enumerate(msg.outputs):
        if k < len(msg.raw_output_contents):
            values = np.frombuffer(msg.raw_output_contents[k], "<f4")
        else:
            values = np.asarray(t.contents.fp32_contents, np.float32)
        out[t.name] = values.reshape(list(t.shape))
    return out


def write_bodies(model: Model, folder: Path) -> Bodies:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "request.json").write_bytes(json_body(model))
    binary, header_length = binary_body(model)
    (folder / "request.bin").write_bytes(binary)
    message = grpc_request(model)
    (folder / "request.pb").write_bytes(message)
    from kubetrt.serving.oip_grpc.grpc_wire import MESSAGE_PREFIX

    (folder / "request.grpc").write_bytes(MESSAGE_PREFIX.pack(0, len(message)) + message)
    from multiprocessing import shared_memory

    body, in_bytes, out_bytes, out_offsets = shm_body(model)
    (folder / "request-shm.json").write_bytes(body)
    def made(part: str, size: int) -> shared_memory.SharedMemory:
        return shared_memory.SharedMemory(f"kubetrt-bench-{os.getpid()}-{model.name}-{part}", create=True, size=size)

    memory = (made("in", in_bytes), made("out", out_bytes))
    np.frombuffer(memory[0].buf, np.uint8)[:] = np.frombuffer(  # type: ignore[arg-type]
        b"".join(model.x[t["name"]].tobytes() for t in model.inputs), np.uint8)
    return Bodies(folder / "request.json", folder / "request.bin", header_length, folder / "request.pb",
                  folder / "request.grpc", folder / "request-shm.json", memory, out_offsets)


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peer_python(venv: str) -> Path:
    python = cache_dir() / "peers" / venv / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(f"{python} missing: run bench/peers/setup.sh {venv}")
    return python


@dataclass
class Server:
    """One server process (a process group: tritonserver and MLServer's workers are children)."""

    kind: str
    model: Model
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    device: str = "host"  # kubetrt's; the peers run onnxruntime on the CPU
    max_batch_size: int | None = None  # kubetrt's; None: kubetrt serve's default
    kubetrt_args: tuple[str, ...] = ()  # more flags for kubetrt serve
    grpc: bool = True
    grpc_missing: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def peer_settings(self) -> dict[str, Any]:
        return {"name": self.model.name, "onnx": str(self.model.onnx), "inputs": self.model.inputs,
                "outputs": self.model.outputs, "http_port": self.http_port, "grpc_port": self.grpc_port,
                "metrics_port": self.metrics_port, "max_batch_size": MAX_BATCH, "max_queue_delay_us": TRITON_QUEUE_DELAY_US}

    def command(self, work: Path) -> tuple[list[str], dict[str, str]]:
        env = dict(os.environ, PYTHONPATH=str(PEERS_DIR), KUBETRT_BENCH_PEER=json.dumps(self.peer_settings()))
        if self.kind == "kubetrt":
            kubetrt = Path(sys.executable).parent / "kubetrt"
            cmd = [str(kubetrt), "serve", str(self.model.package), "--host", "127.0.0.1", "--port", str(self.http_port),
                   "--device", self.device]
            if self.max_batch_size is not None:
                cmd += ["--max-batch-size", str(self.max_batch_size)]
            cmd += list(self.kubetrt_args)
            help_text = subprocess.run([str(kubetrt), "serve", "--help"], capture_output=True, text=True).stdout
            if "--grpc-port" in help_text:
                cmd += ["--grpc-port", str(self.grpc_port)]
            else:
                self.grpc, self.grpc_missing = False, "kubetrt serve has no --grpc-port yet"
            if "--shared-memory" in help_text:
                cmd += ["--shared-memory"]
            return cmd, dict(os.environ)
        if self.kind == "mlserver":
            models = work / "models"
            (models / self.model.name).mkdir(parents=True, exist_ok=True)
            (models / "settings.json").write_text(json.dumps({
                "host": "127.0.0.1", "http_port": self.http_port, "grpc_port": self.grpc_port,
                "metrics_port": self.metrics_port}))
            (models / self.model.name / "model-settings.json").write_text(json.dumps({
                "name": self.model.name, "implementation": "mlserver_onnx.OnnxRuntimeModel",
                "max_batch_size": MAX_BATCH, "max_batch_time": MLSERVER_BATCH_TIME_S}))
            return [str(peer_python("mlserver").parent / "mlserver"), "start", str(models)], env
        if self.kind == FLOOR:
            answers = work / "answers.npz"
            np.savez(answers, **self.model.expected)  # type: ignore[arg-type]
            env["KUBETRT_BENCH_PEER"] = json.dumps({**self.peer_settings(), "answers": str(answers)})
            return [sys.executable, str(PEERS_DIR / "transport_floor.py")], env
        if self.kind == "kserve":
            return [str(peer_python("kserve")), str(PEERS_DIR / "kserve_onnx.py")], env
        if self.kind == "triton":
            python = peer_python("pytriton")
            libdir = (python.parent.parent / "libpython-dir").read_text().strip()
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
            return [str(python), str(PEERS_DIR / "pytriton_onnx.py")], env
        raise ValueError(self.kind)

    def start(self, work: Path) -> None:
        import httpx

        cmd, env = self.command(work)
        self.log = work / f"{self.kind}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work,
                                         start_new_session=True)
        url = f"http://127.0.0.1:{self.http_port}/v2/models/{self.model.name}/ready"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} not ready after {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)

    def log_tail(self, lines: int = 30) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after 20 s."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
                os.killpg(self.proc.pid, 0)  # the leader is gone; are its children?
                time.sleep(0.5)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass


# --------------------------------------------------------------------------- checks


def close(got: dict[str, np.ndarray], model: Model) -> str:
    """'' where every output matches onnxruntime's within the table's fp32 host tolerance, else what
    differs (runtime/accuracy.py, the project's one comparator)."""
    from kubetrt.runtime.accuracy import HOST, compare, tolerance_for

    shaped = {}
    for t in model.outputs:
        ref = model.expected[t["name"]]
        if t["name"] not in got:
            return f"no output {t['name']!r} in the answer (got {sorted(got)})"
        value = np.asarray(got[t["name"]], dtype=ref.dtype).reshape(-1)
        if value.size != ref.size:
            return f"output {t['name']!r} has {value.size} values, expected {ref.size}"
        shaped[t["name"]] = value.reshape(ref.shape)
    return compare(shaped, model.expected, tolerance_for("fp32", HOST)).reason() or ""


def rest_outputs(status: int, headers: Any, content: bytes) -> dict[str, np.ndarray]:
    """The outputs of an OIP REST answer, JSON or with the binary extension's raw tail."""
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {content[:300]!r}")
    length = headers.get("inference-header-content-length")
    header = json.loads(content[:int(length)] if length else content)
    tail = content[int(length):] if length else b""
    out, offset = {}, 0
    for o in header["outputs"]:
        size = (o.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            out[o["name"]] = np.frombuffer(tail[offset:offset + size], "<f4").reshape(o["shape"])
            offset += size
        else:
            out[o["name"]] = np.asarray(o["data"], np.float32).reshape(o["shape"])
    return out


def check(server: Server, protocol: str, bodies: Bodies) -> str:
    """'' where the server answers this protocol's request as onnxruntime does, else why not."""
    import httpx

    model = server.model
    try:
        if protocol == "grpc":
            if not server.grpc:
                return server.grpc_missing
            import grpc

            with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
                call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                got = grpc_outputs(call(bodies.grpc.read_bytes(), timeout=60))
        elif protocol == "shm":
            if server.kind == FLOOR:
                return "no shared memory: the floor answers outputs it holds, in the body"
            base = f"http://127.0.0.1:{server.http_port}/v2/systemsharedmemory/region"
            for region, memory in zip((SHM_IN, SHM_OUT), bodies.memory):
                r = httpx.post(f"{base}/{region}/register", timeout=60,
                               json={"key": f"/{memory.name}", "offset": 0, "byte_size": memory.size})
                if r.status_code != 200:
                    return f"no system shared memory extension (HTTP {r.status_code}: {r.text.splitlines()[-1][:120] if r.text else ''})"
            out = bodies.memory[1]
            np.frombuffer(out.buf, np.uint8)[:] = 0  # no answer left from another server
            r = httpx.post(f"http://127.0.0.1:{server.http_port}/v2/models/{model.name}/infer", timeout=60,
                           content=bodies.shm.read_bytes(), headers={"Content-Type": "application/json"})
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.content[:300]!r}")
            got = {name: np.frombuffer(out.buf, "<f4", model.expected[name].size, offset).copy()
                   for name, offset in bodies.out_offsets.items()}
        else:
            url = f"http://127.0.0.1:{server.http_port}/v2/models/{model.name}/infer"
            if protocol == "json":
                r = httpx.post(url, content=bodies.json.read_bytes(), headers={"Content-Type": "application/json"}, timeout=60)
            else:
                r = httpx.post(url, content=bodies.binary.read_bytes(), timeout=60, headers={
                    "Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(bodies.binary_header_length)})
                if r.status_code != 200:
                    return f"no binary tensor extension (HTTP {r.status_code}: {r.text.splitlines()[-1][:120] if r.text else ''})"
            got = rest_outputs(r.status_code, r.headers, r.content)
    except Exception as err:  # noqa: BLE001 - any failure is this protocol's reason, printed, not raised
        return f"{type(err).__name__}: {str(err)[:300]}"
    wrong = close(got, model)
    return f"wrong answer: {wrong}" if wrong else ""


# --------------------------------------------------------------------------- load


@dataclass
class Cell:
    server: str
    model: str
    protocol: str
    clients: int
    rps: float = float("nan")
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    ok: int = 0
    non2xx: int = 0  # answered with another status (503 / RESOURCE_EXHAUSTED apart)
    unavailable: int = 0  # 503 / RESOURCE_EXHAUSTED: overload answered
    errors: int = 0  # socket or transport errors
    timeouts: int = 0
    missing: str = ""  # why the cell was not measured
    in_server_ms: float = float("nan")  # kubetrt: mean time a request spent in the server (its /metrics)
    compute_ms: float = float("nan")  # kubetrt: of that, mean time in the runtime's run of its batch
    client_cpu_ms: float = float("nan")  # the load generator's CPU time per answered request (same cores)
    engine_ms: float = float("nan")  # kubetrt at one client: its engine's in-process p50 just before and after the cell


TIMINGS = ("rps", "p50_ms", "p99_ms", "in_server_ms", "compute_ms", "client_cpu_ms", "engine_ms")
COUNTS = ("ok", "non2xx", "unavailable", "errors", "timeouts")


def combine_rounds(rounds: list[Cell]) -> Cell:
    """One cell from its rounds: the median of each timing (a noisy spell of the machine lands in
    one server's turn, not in every round of it), the sum of each count; not measured where any
    round was not (that round's reason)."""
    first = rounds[0]
    out = Cell(first.server, first.model, first.protocol, first.clients,
               missing=next((c.missing for c in rounds if c.missing), ""))
    if out.missing:
        return out
    for name in TIMINGS:
        values = [v for v in (getattr(c, name) for c in rounds) if v == v]  # nan: not known that round
        setattr(out, name, statistics.median(values) if values else float("nan"))
    for name in COUNTS:
        setattr(out, name, sum(getattr(c, name) for c in rounds))
    return out


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's waited-for children: the load generators."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


WRK_LUA = r"""
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = os.getenv("BENCH_CONTENT_TYPE")
local hlen = os.getenv("BENCH_HEADER_LENGTH")
if hlen ~= nil and hlen ~= "" then wrk.headers["Inference-Header-Content-Length"] = hlen end

local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) ok = 0; unavailable = 0; other = 0 end
function response(status, headers, body)
  if status == 503 then unavailable = unavailable + 1
  elseif status >= 200 and status < 300 then ok = ok + 1
  else other = other + 1 end
end
function done(summary, latency, requests)
  local n_ok, n_unavailable, n_other = 0, 0, 0
  for _, t in ipairs(threads) do
    n_ok = n_ok + t:get("ok"); n_unavailable = n_unavailable + t:get("unavailable"); n_other = n_other + t:get("other")
  end
  local e = summary.errors
  io.write(string.format('BENCH {"requests": %d, "duration_us": %d, "ok": %d, "unavailable": %d, "other": %d, ' ..
    '"socket_errors": %d, "timeouts": %d, "p50_us": %d, "p99_us": %d}\n', summary.requests, summary.duration,
    n_ok, n_unavailable, n_other, e.connect + e.read + e.write, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


def kubetrt_sums(server: Server) -> dict[str, float]:
    """kubetrt serve's request and compute duration and batch size sums and counts, from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    wanted = {"kubetrt_request_duration_seconds": "request_duration", "kubetrt_compute_duration_seconds": "compute_duration",
              "kubetrt_batch_size": "batch_size"}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for prefix, short in wanted.items():
                for part in ("sum", "count"):
                    if sample.name == f"{prefix}_{part}":
                        sums[f"{short}_{part}"] = sums.get(f"{short}_{part}", 0.0) + sample.value
    return sums


def drain(server: Server, bodies: Bodies) -> None:
    """Wait for one more JSON request's answer: the requests a load generator left in flight when it
    stopped (their connections closed, the server still working through them) are done by then, so
    the next run starts on an idle server instead of inheriting the last one's backlog."""
    import httpx

    url = f"http://127.0.0.1:{server.http_port}/v2/models/{server.model.name}/infer"
    try:
        httpx.post(url, content=bodies.json.read_bytes(), headers={"Content-Type": "application/json"}, timeout=600)
    except httpx.HTTPError:
        pass


def warm_then_measure(run: Callable[[float], R], server: Server, bodies: Bodies, seconds: float,
                      warmup: float) -> tuple[R, float]:
    """A load generator's warm-up run (unless `warmup` is 0) and its measured run, each followed by
    drain -> (the measured run's result, the CPU seconds the load generator spent in it)."""
    if warmup > 0:
        run(warmup)
        drain(server, bodies)
    cpu = children_cpu_s()
    result = run(seconds)
    spent = children_cpu_s() - cpu
    drain(server, bodies)
    return result, spent


def wrk_cell(cell: Cell, server: Server, bodies: Bodies, seconds: float, warmup: float, timeout: float,
             work: Path) -> None:
    lua = work / "post.lua"
    lua.write_text(WRK_LUA)
    body, ctype, hlen = {"json": (bodies.json, "application/json", ""), "shm": (bodies.shm, "application/json", ""),
                         "binary": (bodies.binary, "application/octet-stream", str(bodies.binary_header_length))}[cell.protocol]
    env = dict(os.environ, BENCH_BODY=str(body), BENCH_CONTENT_TYPE=ctype, BENCH_HEADER_LENGTH=hlen)
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{cell.model}/infer"

    def run(duration: float) -> dict[str, Any]:
        cmd = ["wrk", "-t1", f"-c{cell.clients}", f"-d{max(1, round(duration))}s", f"--timeout={timeout:g}s",
               "-s", str(lua), url]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=duration + timeout + 60)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
        if line is None:
            raise RuntimeError(f"wrk printed no result: {out.stdout[-300:]} {out.stderr[-300:]}")
        return json.loads(line[6:])

    r, cpu_s = warm_then_measure(run, server, bodies, seconds, warmup)
    cell.client_cpu_ms = cpu_s * 1e3 / max(1, r["requests"])
    cell.ok, cell.unavailable, cell.non2xx = r["ok"], r["unavailable"], r["other"]
    cell.errors, cell.timeouts = r["socket_errors"], r["timeouts"]
    cell.rps = r["ok"] / (r["duration_us"] / 1e6)
    if r["requests"]:
        cell.p50_ms, cell.p99_ms = r["p50_us"] / 1e3, r["p99_us"] / 1e3


def ghz_binary() -> str:
    found = shutil.which("ghz") or str(cache_dir() / "bin" / "ghz")
    if not Path(found).exists():
        raise FileNotFoundError(f"ghz missing: run bench/peers/setup.sh tools (looked on PATH and in {cache_dir() / 'bin'})")
    return found


def ghz_cell(cell: Cell, server: Server, bodies: Bodies, seconds: float, warmup: float, timeout: float) -> None:
    def run(duration: float) -> dict[str, Any]:
        cmd = [ghz_binary(), "--insecure", "--proto", str(_oip_grpc().DESCRIPTOR_SET.with_suffix(".proto")),
               "--call", "inference.GRPCInferenceService.ModelInfer", "--binary-file", str(bodies.grpc),
               "-c", str(cell.clients), "--connections", str(cell.clients), "-z", f"{max(1, round(duration))}s",
               "--timeout", f"{timeout:g}s", "--cpus", "1", "-O", "json",
               # the message is fixed bytes, no template: ghz's per-call template pass is client time in every p50
               "--disable-template-functions", "--disable-template-data", f"127.0.0.1:{server.grpc_port}"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + timeout + 60)
        if not out.stdout.strip():
            raise RuntimeError(f"ghz printed no result: {out.stderr[-300:]}")
        return json.loads(out.stdout)

    r, cpu_s = warm_then_measure(run, server, bodies, seconds, warmup)
    codes: dict[str, int] = r.get("statusCodeDistribution") or {}
    cell.client_cpu_ms = cpu_s * 1e3 / max(1, sum(codes.values()))
    cell.ok = codes.get("OK", 0)
    cell.unavailable = codes.get("ResourceExhausted", 0)
    cell.timeouts = codes.get("DeadlineExceeded", 0)
    # When the duration ends ghz cancels the calls in flight and closes its connections under them
    # (Canceled, or Unavailable "use of closed network connection"): the client's doing, not counted
    own = codes.get("Canceled", 0) + sum(n for msg, n in (r.get("errorDistribution") or {}).items()
                                         if "use of closed network connection" in msg)
    cell.errors = max(0, codes.get("Unavailable", 0) + codes.get("Canceled", 0) - own)
    cell.non2xx = sum(codes.values()) - cell.ok - cell.unavailable - cell.timeouts - cell.errors - own
    cell.rps = cell.ok / (r["total"] / 1e9)
    lat = {int(d["percentage"]): d["latency"] / 1e6 for d in r.get("latencyDistribution") or []}
    cell.p50_ms, cell.p99_ms = lat.get(50, float("nan")), lat.get(99, float("nan"))


H2LOAD_SUMMARY = re.compile(r"finished in (?P<value>[\d.]+)(?P<unit>us|ms|s),")
H2LOAD_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
H2LOAD_TRAFFIC = re.compile(r"traffic: .*?, (?:[\d.]+\w*B )?\((?P<data>\d+)\) data")


def h2load_command(cell: Cell, server: Server, bodies: Bodies, log: Path, timeout: float,
                   duration: float | None = None) -> list[str]:
    """One thread, `cell.clients` connections, one call in flight on each: ModelInfer POSTed as gRPC
    over cleartext HTTP/2, with the deadline ghz would send. Timed by `duration`, else one call."""
    timed = ["-D", f"{max(1, round(duration))}"] if duration is not None else ["-n", "1"]
    return ["h2load", *timed, "-c", str(cell.clients if duration is not None else 1), "-m", "1", "-t", "1",
            "-H", "content-type: application/grpc", "-H", "te: trailers", "-H", f"grpc-timeout: {max(1, round(timeout))}S",
            "-d", str(bodies.grpc_framed), "--log-file", str(log),
            f"http://127.0.0.1:{server.grpc_port}/inference.GRPCInferenceService/ModelInfer"]


@dataclass
class H2loadRun:
    """One h2load run: its answers' DATA bytes, its seconds, and the latency of each call answered
    with HTTP status 200 (a call cut off when the duration ends is not in its log: the client's doing)."""

    data_bytes: int
    seconds: float
    answered_us: list[float]


def read_h2load(stdout: str, log: str) -> H2loadRun:
    """From h2load's summary and its --log-file (start in us since the epoch, HTTP status, us to
    the answer's end; tab-separated)."""
    traffic, took = H2LOAD_TRAFFIC.search(stdout), H2LOAD_SUMMARY.search(stdout)
    if traffic is None or took is None:
        raise RuntimeError(f"h2load printed no summary: {stdout[-300:]}")
    rows = [line.split("\t") for line in log.splitlines()]
    return H2loadRun(int(traffic["data"]), float(took["value"]) * H2LOAD_UNITS[took["unit"]],
                     [float(r[2]) for r in rows if len(r) == 3 and r[1] == "200"])


def grpc_outcomes(run: H2loadRun, answer_bytes: int) -> tuple[int, int]:
    """(OK, not OK) of a run's calls answered with HTTP 200: an OK call carries one answer message
    of `answer_bytes` in DATA, a failed one (gRPC's trailers-only error) none."""
    if answer_bytes <= 0:
        raise ValueError(f"answer_bytes {answer_bytes}: expected the size of one OK answer's DATA")
    ok = min(len(run.answered_us), run.data_bytes // answer_bytes)
    return ok, len(run.answered_us) - ok


def h2load_cell(cell: Cell, server: Server, bodies: Bodies, seconds: float, warmup: float, timeout: float,
                work: Path) -> None:
    log = work / f"h2load-{cell.clients}.log"

    def run(duration: float | None) -> H2loadRun:
        log.unlink(missing_ok=True)
        out = subprocess.run(h2load_command(cell, server, bodies, log, timeout, duration), capture_output=True,
                             text=True, timeout=(duration or 0) + timeout + 60)
        return read_h2load(out.stdout, log.read_text() if log.exists() else "")

    one = run(None)  # this server's OK answer: its size (check() made sure the answer is right)
    if not one.data_bytes or len(one.answered_us) != 1:
        raise RuntimeError("h2load's single call got no gRPC answer message")
    measured, cpu_s = warm_then_measure(run, server, bodies, seconds, warmup)
    cell.client_cpu_ms = cpu_s * 1e3 / max(1, len(measured.answered_us))
    cell.ok, cell.non2xx = grpc_outcomes(measured, one.data_bytes)
    cell.rps = cell.ok / measured.seconds
    if measured.answered_us:
        cell.p50_ms, cell.p99_ms = (float(v) / 1e3 for v in np.percentile(measured.answered_us, [50, 99]))


# --------------------------------------------------------------------------- the run


def engine_p50_ms(model: Model, device: str, seconds: float = 2.0,
                  engines: tuple[str, ...] = ("kubetrt", "onnxruntime")) -> dict[str, float]:
    """In-process batch-1 median of kubetrt's runtime and of onnxruntime on the same input, each
    in a subprocess of its own (no thread pool left spinning here), the least of four windows'
    medians (a shared machine's noisy spells land in some): what serving adds is a cell's one-client
    p50 minus this."""
    code = (
        "import sys, time, json, numpy as np\n"
        "sys.path.insert(0, sys.argv[1]); import _bootstrap\n"
        "x = dict(np.load(sys.argv[3]))\n"
        "if sys.argv[2] == 'onnxruntime':\n"
        "    import onnxruntime as ort\n"
        "    s = ort.InferenceSession(sys.argv[4], providers=['CPUExecutionProvider'])\n"
        "    feed = {i.name: v for i, v in zip(s.get_inputs(), x.values())}\n"
        "    run = lambda: s.run(None, feed)\n"
        "else:\n"
        "    from kubetrt.runtime import load_model\n"
        "    m = load_model(sys.argv[4], sys.argv[2])\n"
        "    run = lambda: m.predict(x)\n"
        "for _ in range(10): run()\n"
        "medians = []\n"
        "for _ in range(4):\n"
        "    ts, end = [], time.perf_counter() + float(sys.argv[5]) / 4\n"
        "    while time.perf_counter() < end or len(ts) < 5:\n"
        "        t0 = time.perf_counter(); run(); ts.append(time.perf_counter() - t0)\n"
        "    medians.append(float(np.median(ts)))\n"
        "print(json.dumps(min(medians) * 1e3))\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(Path(tmp) / "x.npz", **model.x)  # type: ignore[arg-type]
        out = {}
        for engine, path in ((e, {"kubetrt": model.package, "onnxruntime": model.onnx}[e]) for e in engines):
            r = subprocess.run([sys.executable, "-c", code, str(HERE), device if engine == "kubetrt" else engine,
                                str(Path(tmp) / "x.npz"), str(path), str(seconds)], capture_output=True, text=True)
            out[engine] = float(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else float("nan")
    return out


def kubetrt_engine_ms(model: Model, device: str) -> float:
    """kubetrt's in-process batch-1 p50 alone (engine_p50_ms), for a cell read against it."""
    return engine_p50_ms(model, device, engines=("kubetrt",))["kubetrt"]


def progress(msg: str) -> None:
    print(f"[serving] {msg}", file=sys.stderr, flush=True)


def serve_and_measure(kind: str, model: Model, bodies: Bodies, protocols: list[str], clients: list[int],
                      seconds: float, warmup: float, timeout: float, work: Path, device: str,
                      max_batch_size: int | None = None, kubetrt_args: tuple[str, ...] = (),
                      grpc_load: str = "h2load") -> list[Cell]:
    """One server up, its answers checked, its cells measured, the server stopped."""
    cells = [Cell(kind, model.name, p, c) for p in protocols for c in clients]
    server = Server(kind, model, device=device, max_batch_size=max_batch_size, kubetrt_args=kubetrt_args)
    t0 = time.monotonic()
    try:
        server.start(work)
    except Exception as err:  # noqa: BLE001 - a server that does not start is reported in its cells
        server.stop()
        for c in cells:
            c.missing = f"did not start: {str(err).splitlines()[0][:200]}"
        progress(f"{kind} {model.name}: {err}")
        return cells
    progress(f"{kind} {model.name}: ready in {time.monotonic() - t0:.1f} s")
    try:
        for protocol in protocols:
            why = check(server, protocol, bodies)
            progress(f"{kind} {model.name} {protocol}: {'answers as onnxruntime does' if not why else why}")
            for cell in (c for c in cells if c.protocol == protocol):
                if why:
                    cell.missing = why
                    continue
                try:
                    # the machine's speed moves between minutes: kubetrt's one-client cells, which
                    # are read against the engine, have it measured beside them
                    beside = kind == "kubetrt" and cell.clients == 1
                    engine = [kubetrt_engine_ms(model, device)] if beside else []
                    before = kubetrt_sums(server) if kind == "kubetrt" else {}
                    if protocol == "grpc" and grpc_load == "ghz":
                        ghz_cell(cell, server, bodies, seconds, warmup, timeout)
                    elif protocol == "grpc":
                        h2load_cell(cell, server, bodies, seconds, warmup, timeout, work)
                    else:
                        wrk_cell(cell, server, bodies, seconds, warmup, timeout, work)
                    if kind == "kubetrt":
                        d = {k: v - before.get(k, 0.0) for k, v in kubetrt_sums(server).items()}
                        if d.get("request_duration_count") and d.get("batch_size_sum"):
                            cell.in_server_ms = d["request_duration_sum"] / d["request_duration_count"] * 1e3
                            # each request's share of its batch's run
                            cell.compute_ms = d["compute_duration_sum"] / d["batch_size_sum"] * 1e3
                    if beside:
                        engine.append(kubetrt_engine_ms(model, device))
                        cell.engine_ms = statistics.mean(engine)
                except Exception as err:  # noqa: BLE001 - the load generator's failure is this cell's reason
                    cell.missing = f"{type(err).__name__}: {str(err)[:200]}"
                if server.proc is not None and server.proc.poll() is not None:
                    cell.missing = cell.missing or f"server died:\n{server.log_tail(10)}"
                progress(f"  {kind:<8} {protocol:<6} c={cell.clients:<3} " + (
                    cell.missing or f"{cell.rps:9.1f} req/s  p50 {cell.p50_ms:8.2f} ms  p99 {cell.p99_ms:8.2f} ms  "
                                    f"non-2xx {cell.non2xx}  503 {cell.unavailable}  err {cell.errors}  timeouts {cell.timeouts}"))
    finally:
        server.stop()
    return cells


def peer_versions(servers: list[str]) -> str:
    """The pinned versions each peer's venv holds (bench/peers/setup.sh writes freeze.txt)."""
    wanted = ("mlserver", "kserve", "nvidia-pytriton", "onnxruntime")
    parts = []
    for kind, venv in (("mlserver", "mlserver"), ("kserve", "kserve"), ("triton", "pytriton")):
        freeze = cache_dir() / "peers" / venv / "freeze.txt"
        if kind in servers and freeze.exists():
            pins = [ln for ln in freeze.read_text().splitlines() if ln.split("==")[0].lower() in wanted]
            parts.append(f"{kind} ({', '.join(pins)})")
    return "; ".join(parts) or "none"


def fmt_cell(c: Cell) -> str:
    if c.missing:
        return f"{c.server:<9}{'-':>9}  {c.missing.splitlines()[0][:90]}"
    return (f"{c.server:<9}{c.rps:9.1f}{c.p50_ms:9.2f}{c.p99_ms:9.2f}{c.non2xx:8d}{c.unavailable:7d}"
            f"{c.errors:7d}{c.timeouts:9d}")


def report(cells: list[Cell], models: list[str], protocols: list[str], clients: list[int], servers: list[str]) -> None:
    print(f"{'model':<14}{'proto':<7}{'clients':>7}  {'server':<9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'non-2xx':>8}{'503':>7}{'errors':>7}{'timeouts':>9}")
    key: dict[tuple[str, str, int, str], Cell] = {(c.model, c.protocol, c.clients, c.server): c for c in cells}
    for m in models:
        for p in protocols:
            for n in clients:
                for s in servers:
                    print(f"{m:<14}{p:<7}{n:>7}  {fmt_cell(key[m, p, n, s])}")
    print("\nkubetrt / best peer: req/s over the highest peer's (above 1: kubetrt serves more), "
          "p99 over the lowest peer p99 (below 1: kubetrt's tail is shorter)")
    for m in models:
        for p in protocols:
            for n in clients:
                k = key.get((m, p, n, "kubetrt"))
                peers = [key[m, p, n, s] for s in servers if s not in ("kubetrt", FLOOR) and not key[m, p, n, s].missing]
                best = max(peers, key=lambda c: c.rps, default=None)
                if k is None or k.missing or best is None or not best.rps:
                    why = "kubetrt not measured" if k is None or k.missing else "no peer measured"
                    print(f"{m:<14}{p:<7}{n:>7}  {'-':>6}  ({why})")
                    continue
                tail = min(peers, key=lambda c: c.p99_ms if c.p99_ms == c.p99_ms else float("inf"))
                print(f"{m:<14}{p:<7}{n:>7}  req/s {k.rps / best.rps:5.2f}  p99 {k.p99_ms / tail.p99_ms:5.2f}  "
                      f"(kubetrt {k.rps:.1f}/s p99 {k.p99_ms:.2f} ms; {best.server} {best.rps:.1f}/s; "
                      f"{tail.server} p99 {tail.p99_ms:.2f} ms)")


def csv_list(kind: Callable[[str], Any], allowed: tuple[str, ...] | None = None) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        items = [kind(t) for t in text.split(",") if t]
        bad = [i for i in items if allowed is not None and i not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad} not among {', '.join(allowed or ())}")
        return items
    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--protocols", type=csv_list(str, PROTOCOLS), default=list(PROTOCOLS), help=",".join(PROTOCOLS))
    p.add_argument("--clients", type=csv_list(int), default=[1, 16, 64], help="concurrent connections per cell")
    p.add_argument("--servers", type=csv_list(str, SERVERS), default=list(SERVERS), help=",".join(SERVERS))
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell")
    p.add_argument("--warmup", type=float, default=3.0, help="warm-up seconds before each cell (not counted)")
    p.add_argument("--timeout", type=float, default=10.0, help="a request unanswered this long counts as a timeout")
    p.add_argument("--rounds", type=int, default=1,
                   help="each server's turn this many times, the servers alternating; per cell the median round")
    p.add_argument("--device", default="host", help="kubetrt serve --device (the peers run onnxruntime on the CPU)")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="kubetrt serve --max-batch-size (1 turns its batching off; default: serve's own)")
    p.add_argument("--kubetrt-args", type=shlex.split, default=[], metavar="'FLAGS'",
                   help="more flags for kubetrt serve, e.g. '--idle-poll-us 0' (an A/B of a setting)")
    p.add_argument("--grpc-load", choices=GRPC_LOADS, default=GRPC_LOADS[0],
                   help="gRPC's load generator: h2load (bytes in, bytes out) or ghz (protobuf per call)")
    a = p.parse_args(argv)
    for tool, protocols in (("wrk", {"json", "binary", "shm"}), ("h2load", {"grpc"} if a.grpc_load == "h2load" else set())):
        if shutil.which(tool) is None and protocols & set(a.protocols):
            p.error(f"{tool} not found: run bench/peers/setup.sh tools")

    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: expected 1 or more")
    by_cell: dict[tuple[str, str, str, int], list[Cell]] = {}
    engines: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kubetrt-serving-bench-") as tmp:
        work = Path(tmp)
        for name in a.models:
            progress(f"preparing {name}")
            model = load_model(name)
            bodies = write_bodies(model, work / name)
            engine_rounds: list[dict[str, float]] = []
            try:
                for r in range(a.rounds):
                    if a.rounds > 1:
                        progress(f"{name}: round {r + 1} of {a.rounds}")
                    engine_rounds.append(engine_p50_ms(model, a.device))
                    progress(f"{name} batch 1 in-process p50: "
                             + ", ".join(f"{k} {v:.3f} ms" for k, v in engine_rounds[-1].items()))
                    for kind in a.servers:
                        server_dir = work / name / f"{kind}-{r}"
                        server_dir.mkdir(parents=True, exist_ok=True)
                        for cell in serve_and_measure(kind, model, bodies, a.protocols, a.clients, a.seconds, a.warmup,
                                                      a.timeout, server_dir, a.device, a.max_batch_size,
                                                      tuple(a.kubetrt_args), a.grpc_load):
                            by_cell.setdefault((cell.server, cell.model, cell.protocol, cell.clients), []).append(cell)
            finally:
                bodies.close()
            # the least over the rounds, as within one: the engine's time where the machine was quiet
            engines[name] = {k: min(e[k] for e in engine_rounds) for k in engine_rounds[0]}
    cells = [combine_rounds(rounds) for rounds in by_cell.values()]
    print(f"\nkubetrt serving bench: OIP V2 batch-1 requests, {a.seconds:g} s per cell after {a.warmup:g} s warm-up, "
          f"servers taking turns ({a.rounds} round{'s' if a.rounds > 1 else ''}"
          f"{', per cell the median round' if a.rounds > 1 else ''}); REST load by wrk (1 thread), gRPC by {GRPC_LOAD_WORDS[a.grpc_load]}; timeout {a.timeout:g} s; "
          f"kubetrt --max-batch-size {a.max_batch_size if a.max_batch_size is not None else 'default'}"
          f"{' ' + shlex.join(a.kubetrt_args) if a.kubetrt_args else ''}")
    sys.path.insert(0, str(HERE))
    from _machine import cpu_line, device_line

    print(cpu_line())
    if a.device != "host":
        print(f"kubetrt's device: {device_line(a.device)}")
    print(f"Python {platform.python_version()} ({sys.executable}); peers in {cache_dir() / 'peers'}: {peer_versions(a.servers)}\n")
    report(cells, a.models, a.protocols, a.clients, a.servers)
    print(f"\nwhat serving adds at one client: p50 minus the engine's in-process batch-1 p50 (kubetrt on {a.device}, "
          "the peers on onnxruntime)")
    for name in a.models:
        eng = engines[name]
        print(f"{name}: engine kubetrt {eng['kubetrt']:.3f} ms, onnxruntime {eng['onnxruntime']:.3f} ms")
        one_client = [c for c in cells if c.model == name and c.clients == 1 and not c.missing]
        for c in one_client:
            if c.server == FLOOR:
                print(f"  {c.server:<9}{c.protocol:<7} p50 {c.p50_ms:8.2f} ms, no model: the transport alone")
                continue
            base = eng["kubetrt"] if c.server == "kubetrt" else eng["onnxruntime"]
            print(f"  {c.server:<9}{c.protocol:<7} p50 {c.p50_ms:8.2f} ms = engine + {c.p50_ms - base:.2f} ms")
        floors = {c.protocol: c for c in one_client if c.server == FLOOR}
        kubetrt = [c for c in one_client if c.server == "kubetrt"]
        for c in kubetrt:
            f = floors.get(c.protocol)
            if f is not None:
                print(f"  kubetrt  {c.protocol:<7} p50 {c.p50_ms:8.2f} ms = transport floor {f.p50_ms:.2f} ms + engine "
                      f"{eng['kubetrt']:.2f} ms + {c.p50_ms - f.p50_ms - eng['kubetrt']:.2f} ms")
        for c in kubetrt:  # the engine measured just before and after the cell: the same spell of the machine
            if c.engine_ms == c.engine_ms:
                print(f"  kubetrt  {c.protocol:<7} p50 {c.p50_ms:8.2f} ms = engine beside the cell {c.engine_ms:.2f} ms + "
                      f"{c.p50_ms - c.engine_ms:.2f} ms")
        for c in kubetrt:  # timed inside the server, so a neighbour's load on the engine is not counted as serving
            if c.in_server_ms == c.in_server_ms:
                print(f"  kubetrt  {c.protocol:<7} in the server {c.in_server_ms:.2f} ms a request = its run "
                      f"{c.compute_ms:.2f} ms + {c.in_server_ms - c.compute_ms:.2f} ms outside the engine (its /metrics)")
        for c in kubetrt:  # what the client takes from the cores the engine's team runs on
            print(f"  kubetrt  {c.protocol:<7} the load generator used {c.client_cpu_ms:.2f} ms of CPU a request, "
                  f"on the same {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
