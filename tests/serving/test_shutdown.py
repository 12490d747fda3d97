"""Graceful shutdown: SIGTERM stops accepting, in-flight requests finish, the process exits 0."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from serving_support import ServerProcess, cnn_input

HERE = Path(__file__).resolve().parent


def infer_body(x: np.ndarray) -> dict:
    return {"inputs": [{"name": "image", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}


def inflight(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith('kubetrt_inflight_requests{model="small_cnn"}'):
            return float(line.split()[-1])
    return 0.0


def test_sigterm_finishes_the_in_flight_request_and_exits_0(cnn_package, cnn_model, tmp_path):
    hold = tmp_path / "hold"
    server = ServerProcess([str(HERE / "held_server_main.py"), str(cnn_package), str(hold)])
    try:
        server.wait_ready()
        hold.touch()  # from now on the model's compute waits until the file is gone
        x = cnn_input(1, seed=11)
        result: dict = {}

        def request() -> None:
            result["response"] = httpx.post(server.url + "/v2/models/small_cnn/infer", json=infer_body(x), timeout=60)

        t = threading.Thread(target=request)
        t.start()
        deadline = time.monotonic() + 30
        while inflight(server.url) < 1:
            assert time.monotonic() < deadline, "request never reached the server"
            time.sleep(0.01)

        server.proc.send_signal(signal.SIGTERM)
        refused = False  # the listener closes while the request is still held
        while time.monotonic() < deadline and not refused:
            try:
                httpx.get(server.url + "/v2/health/live", timeout=1)
                time.sleep(0.02)
            except httpx.TransportError:
                refused = True
        assert refused, "server kept accepting after SIGTERM"
        assert server.proc.poll() is None, "server exited with a request in flight"

        hold.unlink()
        t.join(30)
        r = result["response"]
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(1, 10),
                                   cnn_model.predict({"image": x})["output_0"], rtol=1e-5)
        assert server.proc.wait(30) == 0, "".join(server.stderr)
    finally:
        hold.unlink(missing_ok=True)
        server.close()


def test_cli_serve_answers_and_exits_0_on_sigterm(cnn_package, two_package, cnn_model):
    server = ServerProcess(["-m", "kubetrt.cli", "-v", "serve", str(cnn_package), str(two_package),
                            "--port", "0", "--grpc-port", "0", "--device", "host", "--max-batch-size", "8"])
    try:
        server.wait_ready()
        x = cnn_input(2, seed=12)
        r = httpx.post(server.url + "/v2/models/small_cnn/infer", json=infer_body(x), timeout=30)
        assert r.status_code == 200
        np.testing.assert_allclose(np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(2, 10),
                                   cnn_model.predict({"image": x})["output_0"], rtol=1e-5)
        assert httpx.get(server.url + "/v2/models/two_in_two_out").json()["versions"] == ["1"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, "".join(server.stderr)
    finally:
        server.close()


def test_cli_serve_rejects_a_missing_package(tmp_path):
    p = subprocess.run([sys.executable, "-m", "kubetrt.cli", "serve", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "does not exist" in p.stderr
