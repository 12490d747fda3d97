"""`kubetrt serve` as a pod runs it: each flag the operator passes is observed to take effect.

The server is the real CLI in a subprocess on a loopback port; effects are read from the
protocol routes and /metrics, never from the flags themselves.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from kubetrt.operators.names import TRACE_PATH
from kubetrt.pipeline.demo import free_port
from batching_probe import batch_sizes, burst
from serving_support import cnn_input


class Served:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def wait(self, path: str = "/v2/health/ready", timeout: float = 60.0) -> httpx.Response:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"kubetrt serve exited {self.proc.returncode}: {self.log.read_text()}"
            try:
                last = httpx.get(self.url + path, timeout=2)
                if last.status_code == 200:
                    return last
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"{path} not 200 within {timeout}s: {last and last.text}")


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Served:
        port = free_port()
        log = tmp_path / f"serve-{port}.log"
        cmd = [sys.executable, "-m", "kubetrt.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port),
               "--grpc-port", "0"]
        with open(log, "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}))
        return Served(procs[-1], f"http://127.0.0.1:{port}", log)

    yield start
    for p in procs:
        p.terminate()
        p.wait(20)


@pytest.fixture
def store_with_engine(published_cnn: tuple[Path, str, str]) -> tuple[str, str, str]:
    """(package URI, store URI, engine key) as the pipeline publishes them."""
    root, package, key = published_cnn
    return package, "file://" + str(root), key


def infer(url: str, name: str, rows: int = 1, seed: int = 0) -> httpx.Response:
    x = cnn_input(rows, seed)
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    return httpx.post(f"{url}/v2/models/{name}/infer", json=body, timeout=30)


def send(url: str, name: str) -> Callable[[int], object]:
    """A binary tritonclient request of `rows` rows (cheap to encode, so a burst arrives together)."""
    import tritonclient.http as triton

    def one(rows: int) -> object:
        client = triton.InferenceServerClient(url[len("http://"):], network_timeout=60)
        x = triton.InferInput("image", [rows, 32, 32, 3], "FP32")
        x.set_data_from_numpy(cnn_input(rows, rows), binary_data=True)
        return client.infer(name, [x])

    return one


def test_engine_from_the_store_served_under_the_deployments_name_and_version(serve, store_with_engine,
                                                                            tmp_path: Path) -> None:
    package, store, key = store_with_engine
    s = serve(package, "--store", store, "--engine-key", key, "--cache-dir", str(tmp_path / "cache"),
              "--model-name", "cnn-prod", "--model-version", "7")
    s.wait()
    meta = httpx.get(s.url + "/v2/models/cnn-prod/versions/7").json()
    assert meta["name"] == "cnn-prod" and meta["versions"] == ["7"]
    assert httpx.get(s.url + "/v2/models/small_cnn").status_code == 404, "served under the given name only"
    assert infer(s.url, "cnn-prod").status_code == 200
    assert httpx.get(s.url + "/v1/models/cnn-prod").json()["model_version_status"][0]["version"] == "7"


@pytest.mark.parametrize("flags,bound", [(("--max-batch-size", "2"), 2), (("--max-batch-size", "8"), 8),
                                          (("--max-batch-size", "8", "--preferred-batch-sizes", "4"), 4)])
def test_batching_flags_shape_the_batches_the_runtime_sees(serve, store_with_engine, tmp_path: Path,
                                                           flags: tuple[str, ...], bound: int) -> None:
    package, store, key = store_with_engine
    s = serve(package, "--store", store, "--engine-key", key, "--cache-dir", str(tmp_path / "cache"),
              "--model-name", "cnn", "--model-version", "1", "--max-queue-delay-us", "1500000", *flags)
    s.wait()
    before = batch_sizes(s.url, "cnn")
    burst(send(s.url, "cnn"), 8)
    count, rows, buckets = batch_sizes(s.url, "cnn")
    small = {le: c - before[2][le] for le, c in buckets.items() if le <= 256}  # the 512-row blocker aside
    assert rows - before[1] == 8 + 512 and count - before[0] - 1 == small[256]
    assert small[bound] == small[256], f"every one-row batch holds at most {bound} rows: {small}"
    assert small[bound // 2] < small[256], f"the queued requests batched up to {bound} rows: {small}"


def test_traces_written_to_stdout_as_a_pod_is_told_to(serve, store_with_engine, tmp_path: Path) -> None:
    """spec.tracing's flags (operators/objects.serve_command): one call in `rate` is a whole JSON line
    on the process's standard output, which a pod's log shows beside its log lines."""
    package, store, key = store_with_engine
    s = serve(package, "--store", store, "--engine-key", key, "--cache-dir", str(tmp_path / "cache"),
              "--model-name", "cnn", "--model-version", "1", "--trace-file", TRACE_PATH, "--trace-rate", "2")
    s.wait()
    for seed in range(4):
        assert infer(s.url, "cnn", seed=seed).status_code == 200
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in s.log.read_text().splitlines() if line.startswith("{")]
        if len(lines) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(lines) == 2, s.log.read_text()
    for trace in lines:
        assert (trace["model"], trace["version"], trace["outcome"]) == ("cnn", "1", "success"), trace
        stamps = [t["name"] for t in trace["timestamps"]]
        assert stamps == ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"], stamps
        times = [t["ns"] for t in trace["timestamps"]]
        assert times == sorted(times), trace


def test_a_missing_engine_is_an_unready_model_with_the_reason_not_a_crash(serve, store_with_engine, tmp_path: Path) -> None:
    package, store, key = store_with_engine
    s = serve(package, "--store", store, "--engine-key", "host_no_such_engine", "--cache-dir", str(tmp_path / "c"),
              "--model-name", "cnn", "--model-version", "1")
    s.wait("/v2/health/live")
    deadline = time.monotonic() + 30
    while "host_no_such_engine" not in (r := httpx.get(s.url + "/v2/health/ready")).text:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    assert r.status_code == 503 and key in r.text, "the reason names the missing key and what the store has"
    assert s.proc.poll() is None, "the server stays up: the readiness probe fails, the pod does not crash-loop"
    assert "Traceback" not in s.log.read_text()


def test_without_a_name_a_bad_package_fails_the_start_with_one_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kubetrt.cli", "serve", f"file://{tmp_path}/missing",
                        "--cache-dir", str(tmp_path / "c")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert re.search(rf"kubetrt serve: error: .*{tmp_path}/missing", r.stderr), r.stderr


@pytest.mark.parametrize("threads", ["1", "3"])
def test_the_host_pool_is_as_wide_as_kubetrt_threads(threads: str) -> None:
    code = ("import threading, time\n"
            "from kubetrt.runtime.kernels.parallel import shared_pool\n"
            "names = set(shared_pool().map(lambda i: (time.sleep(0.05), threading.current_thread().name)[1], range(12)))\n"
            "print(len(names))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KUBETRT_THREADS": threads})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [threads]


def test_a_bad_thread_count_names_the_variable() -> None:
    r = subprocess.run([sys.executable, "-c", "import kubetrt.runtime.devices.host"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "KUBETRT_THREADS": "0.5"})
    assert r.returncode != 0 and "KUBETRT_THREADS='0.5': expected a positive number of threads" in r.stderr


@pytest.mark.parametrize("seconds", ["0", "-1", "soon", "nan"])
def test_a_request_timeout_that_is_no_positive_number_is_refused_at_start(seconds: str, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kubetrt.cli", "serve", str(tmp_path), "--request-timeout-s", seconds],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"argument --request-timeout-s: {seconds}: expected a positive number of seconds" in r.stderr, r.stderr
