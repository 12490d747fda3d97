"""`kubetrt demo`: the whole flow on one machine, no cluster.

example SavedModel (small Keras CNN) -> pipeline (kfp.local, or in-process) -> engine store ->
`kubetrt serve` on a free loopback port -> real Open Inference Protocol requests -> predictions,
verification summary and latency. Falls back to in-process predictions (and says so) if the
server cannot be started.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kubetrt.telemetry import progress
from kubetrt.operators.names import ANN_VERIFIED_ENGINES

OIP_DATATYPES = {"float32": "FP32", "float64": "FP64", "int32": "INT32", "int64": "INT64", "uint8": "UINT8", "bool": "BOOL", "float16": "FP16", "int8": "INT8"}


def build_example_savedmodel(path: str | os.PathLike[str]) -> Path:
    """A small Keras CNN (Conv+BN+ReLU, pooling, Dense softmax over 10 classes) exported as a SavedModel."""
    from kubetrt.pipeline.ingest import tensorflow

    tensorflow()  # quiet TF import
    import keras

    keras.utils.set_random_seed(7)
    L = keras.layers
    inp = keras.Input((32, 32, 3), name="image")
    x = L.Conv2D(16, 3, padding="same", use_bias=False)(inp)
    x = L.ReLU()(L.BatchNormalization()(x))
    x = L.MaxPooling2D()(x)
    x = L.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = L.GlobalAveragePooling2D()(x)
    out = L.Dense(10, activation="softmax", name="probabilities")(x)
    model = keras.Model(inp, out, name="example_cnn")
    path = Path(path)
    model.export(str(path), verbose=False)
    keras.backend.clear_session()
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def oip_request(inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    return {"inputs": [
        {"name": k, "shape": list(v.shape), "datatype": OIP_DATATYPES[str(v.dtype)], "data": v.ravel().tolist()}
        for k, v in inputs.items()
    ]}


def oip_outputs(body: dict[str, Any]) -> dict[str, np.ndarray]:
    return {o["name"]: np.asarray(o["data"], dtype=np.float64).reshape(o["shape"]) for o in body["outputs"]}


def _http(method: str, url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, dict[str, Any]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read()
            return resp.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


@dataclass
class Server:
    """`kubetrt serve` in a subprocess on a loopback port."""

    proc: subprocess.Popen
    base: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(source: Any, cache_dir: Path, log: Path, timeout_s: float = 90.0) -> Server:
    """`kubetrt serve` on the same servable source (a ServableSource) as a pod; wait until the model
    is ready, or RuntimeError with its log tail."""
    port = free_port()
    cmd = [sys.executable, "-m", "kubetrt.cli", "serve", source.package_uri, "--cache-dir", str(cache_dir),
           "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0", "--device", "auto"]
    if source.store_uri:
        cmd += ["--store", source.store_uri, "--engine-key", str(source.engine_key)]
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    out.close()
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            status, _ = _http("GET", server.base + "/v2/health/ready", timeout=2)
            if status == 200:
                return server
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.3)
    server.stop()
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
    raise RuntimeError(f"kubetrt serve did not become ready (exit code {proc.returncode}): {tail.strip()}")


@dataclass
class DemoResult:
    served_by: str  # "http" or "in-process"
    predictions: list[dict[str, Any]]
    latencies_ms: list[float]
    max_abs_error: float
    verification: str
    engines: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)


def _predictions(outputs: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    name, probs = sorted(outputs.items())[0]
    rows = probs.reshape(probs.shape[0], -1)
    return [{"output": name, "class": int(r.argmax()), "score": float(r.max())} for r in rows]


def run_demo(
    workdir: str | os.PathLike[str],
    *,
    savedmodel: str | None = None,
    store: str | None = None,
    use_kfp: bool = True,
    requests: int = 20,
    serve: bool = True,
    say: Callable[[str], None] = print,
    kept: bool = True,
) -> DemoResult:
    """Run the demo in `workdir`; `say` receives the human-readable report lines. `kept=False`:
    the caller removes `workdir` afterwards, so the report points at --workdir, not at its files."""
    from kubetrt.pipeline.servable import ServableSource, resolve_servable
    from kubetrt.runtime.package import load_golden

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store_uri = store or str(workdir / "store")
    if savedmodel is None:
        with progress.step("building the example SavedModel (small Keras CNN)"):
            savedmodel = str(build_example_savedmodel(workdir / "models" / "example_cnn"))
    notes: list[str] = []
    if use_kfp:
        from kubetrt.pipeline.kfp_pipeline import run_local

        with progress.step("running the pipeline with kfp.local (ingest, lower, build, verify, deploy)"):
            import yaml

            deployment = yaml.safe_load(run_local(savedmodel, store_uri, ["host"], workdir / "kfp"))
    else:
        from kubetrt.pipeline.stages import run_pipeline

        with progress.step("running the pipeline stages in-process"):
            deployment = run_pipeline(savedmodel, store_uri, ["host"], workdir / "stages").deployment
    (workdir / "modeldeployment.yaml").write_text(_yaml(deployment))
    engines_by_target = json.loads(deployment["metadata"]["annotations"][ANN_VERIFIED_ENGINES])
    key = next(iter(engines_by_target.values()))
    source = ServableSource(deployment["spec"]["model"]["source"]["uri"], deployment["spec"]["store"]["uri"], key)
    cache = workdir / "cache"
    servable = resolve_servable(source, cache)
    manifest = servable.manifest
    golden = load_golden(servable.package_dir, manifest)
    inputs, want = golden[1 if 1 in golden else min(golden)]
    latencies: list[float] = []
    outputs: dict[str, np.ndarray] = {}
    served_by = "in-process"
    server: Server | None = None
    if serve:
        try:
            with progress.step("starting kubetrt serve on a loopback port"):
                server = start_server(source, cache, workdir / "serve.log")
            served_by = "http"
        except (RuntimeError, OSError) as e:
            notes.append(f"serving unavailable, predicting in-process instead: {e}")
    try:
        with progress.step(f"sending {requests} inference requests"):
            if server is not None:
                url = f"{server.base}/v2/models/{manifest.name}/infer"
                body = oip_request(inputs)
                for _ in range(requests):
                    t0 = time.perf_counter()
                    status, resp = _http("POST", url, body)
                    latencies.append((time.perf_counter() - t0) * 1e3)
                    if status != 200:
                        raise RuntimeError(f"POST {url} answered {status}: {resp}")
                    outputs = oip_outputs(resp)
            else:
                from kubetrt.runtime import load_model

                model = load_model(servable.package_dir, "auto", engine_key=key, verify=False)
                for _ in range(requests):
                    t0 = time.perf_counter()
                    outputs = model.predict(inputs)
                    latencies.append((time.perf_counter() - t0) * 1e3)
    finally:
        if server is not None:
            server.stop()
    err = max(float(np.max(np.abs(np.asarray(outputs[k], np.float64) - np.asarray(v, np.float64)))) for k, v in want.items())
    result = DemoResult(served_by, _predictions(outputs), latencies, err, str(servable.engine.get("summary", "")),
                        [{"target": t, "key": k} for t, k in engines_by_target.items()], notes)
    _report(result, workdir if kept else None, say)
    return result


def _yaml(obj: Any) -> str:
    import yaml

    return yaml.safe_dump(obj, sort_keys=False)


def _report(r: DemoResult, workdir: Path | None, say: Callable[[str], None]) -> None:
    lat = np.asarray(r.latencies_ms)
    engines = ", ".join(f"{e['target']} -> {e['key']}" for e in r.engines)
    say(f"engines:       {engines}")
    say(f"verification:  {r.verification}")
    say(f"served by:     {'kubetrt serve (HTTP, Open Inference Protocol)' if r.served_by == 'http' else 'in-process runtime'}")
    for i, p in enumerate(r.predictions):
        say(f"prediction[{i}]: class {p['class']} (p={p['score']:.4f}) from {p['output']}")
    say(f"vs TensorFlow: max abs error {r.max_abs_error:.3g}")
    say(f"latency:       p50 {np.percentile(lat, 50):.2f} ms, p95 {np.percentile(lat, 95):.2f} ms over {lat.size} requests")
    if workdir is not None:
        say(f"deployment:    {workdir / 'modeldeployment.yaml'} (the pipeline's ModelDeployment; its URIs are this "
            "machine's, so on a cluster the pipeline is run with the cluster's store, README 'On a cluster')")
    else:
        say("deployment:    written to a temporary directory, removed now; `kubetrt demo --workdir DIR` keeps the "
            "package, the engine store and the pipeline's modeldeployment.yaml in DIR")
    for n in r.notes:
        say(f"note:          {n}")
