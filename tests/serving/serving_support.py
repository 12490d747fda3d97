"""Serving test support: a live uvicorn server in a thread, input makers, model doubles.

`LiveServer` runs uvicorn in a thread (signal handling is exercised by the subprocess shutdown
tests). Model doubles are real runtime models with a hook at the compute boundary (counting,
gating, perturbing), never reimplementations.
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any, Mapping

import httpx
import numpy as np
import uvicorn
from hypothesis import strategies as st

from kubetrt.runtime.kernels import omp
from kubetrt.runtime.run_threads import run_threads
from kubetrt.serving.server import uvicorn_config

MAX_BODY = 1 << 20  # the session server's --max-body-bytes

# Every decimal form JSON allows: digits past 19, exponents past float32's and float64's ranges
# both ways, written e or E, with or without +.
json_decimals = st.builds(
    lambda sign, whole, frac, exp: f"{sign}{whole}{'.' + frac if frac else ''}{exp}",
    st.sampled_from(["", "-"]),
    st.from_regex(r"0|[1-9][0-9]{0,24}", fullmatch=True),
    st.from_regex(r"[0-9]{0,25}", fullmatch=True),
    st.one_of(st.just(""), st.integers(-330, 330).map(lambda e: f"{'eE'[e % 2]}{'+' if e % 3 == 0 and e > 0 else ''}{e}")),
)


class LiveServer:
    def __init__(self, app: Any, **config: Any) -> None:
        self.app = app
        # the configuration `kubetrt serve` runs (its HTTP protocol included)
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, graceful_timeout_s=5, **config))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.host = f"127.0.0.1:{port}"
        self.url = f"http://{self.host}"
        return self

    def wait_ready(self, timeout: float = 60.0) -> "LiveServer":
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url) as c:
            while time.monotonic() < deadline:
                if c.get("/v2/health/ready").status_code == 200:
                    return self
                time.sleep(0.02)
        raise RuntimeError(f"server not ready: {httpx.get(self.url + '/v2/health/ready').text}")

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def registry(self):
        return self.app.state.registry


def body_reader(reads: list[int], wait_s: float) -> Any:
    """An app that waits `wait_s` (the parsing and runs of other requests), then reads its request's
    body, counting the reads, and answers the body's length and a digest of it."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep(wait_s)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        reads.append(len(chunks))
        body = b"".join(chunks)
        answer = f"{len(body)} {hash(body)}".encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    return app


def cnn_input(rows: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((rows, 32, 32, 3), dtype=np.float32)


def two_inputs(rows: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "features": rng.normal(size=(rows, 8)).astype(np.float32),
        "ids": rng.integers(0, 16, size=(rows, 2, 3)).astype(np.int32),
    }


class ModelDouble:
    """A real model with a hook at the compute boundary: subclasses override `predict`."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.name, self.version = model.name, model.version
        self.inputs, self.outputs = model.inputs, model.outputs
        self.device, self.package_dir, self.manifest = model.device, model.package_dir, model.manifest
        self.engine_key = model.engine_key

    def validate_inputs(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._model.validate_inputs(feeds)

    def predict(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._model.predict(feeds)

    def predict_alone(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """As the runtime runs on the caller's thread alone, with this double's `predict` hook as the run."""
        with omp.Alone():
            return self.predict(feeds)

    def predict_async(self, feeds: Mapping[str, np.ndarray]) -> Future[dict[str, np.ndarray]]:
        """Started as the runtime starts a host run (on its run threads), with this double's
        `predict` hook as the run."""
        return run_threads().submit(self.predict, feeds)


class CountingModel(ModelDouble):
    """Records the batch size of every runtime call."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.calls: list[int] = []

    def predict(self, feeds):
        self.calls.append(next(iter(feeds.values())).shape[0])
        return super().predict(feeds)


class GatedModel(CountingModel):
    """Blocks every runtime call while the gate is closed (once armed): makes queues fill on cue."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.armed = False
        self.gate = threading.Event()
        self.entered = threading.Event()

    def predict(self, feeds):
        if self.armed:
            self.entered.set()
            assert self.gate.wait(30), "test never opened the gate"
        return super().predict(feeds)


class ServerProcess:
    """A server in a subprocess (real signal handling); its URL is read from uvicorn's start line."""

    def __init__(self, argv: list[str]) -> None:
        import re
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.stderr: list[str] = []
        found = threading.Event()
        self.url = ""

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.stderr.append(line)
                m = re.search(r"running on (http://[\d.]+:\d+)", line)
                if m and not found.is_set():
                    self.url = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=pump, daemon=True).start()
        if not found.wait(60) or not self.url:
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.stderr))

    def wait_ready(self, timeout: float = 60.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/v2/health/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise RuntimeError("server not ready:\n" + "".join(self.stderr))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
