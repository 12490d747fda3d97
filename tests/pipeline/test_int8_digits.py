"""INT8 on a real task, the whole path: a small CNN trained here on scikit-learn's digits images,
lowered with calibration data (an .npz of images and labels), `kubetrt build --target host:int8`
(quantized model, integer kernels, verified against TensorFlow on the held-out split),
published, and served by `kubetrt serve` as a pod runs it, queried over the Open Inference
Protocol. The held-out gate's numbers (TensorFlow fp32 accuracy against kubetrt int8's) come from
the build report."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from kubetrt.cli import main
from kubetrt.pipeline.demo import free_port
from kubetrt.pipeline.store import LocalStore
from kubetrt.runtime.accuracy import heldout_gate

TRAIN = 1000  # of 1797 images; the rest are calibration data, half of it held out


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A trained digits classifier as a SavedModel, its calibration .npz and the fp32 package's
    lowering, all under one module temp dir."""
    from sklearn.datasets import load_digits

    from kubetrt.pipeline.ingest import tensorflow

    tf = tensorflow()
    keras = tf.keras
    root = tmp_path_factory.mktemp("digits")
    data = load_digits()
    images = (data.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in 0..1
    labels = data.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], labels[order]
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 1), name="image")
    x = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(inp)
    x = keras.layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(x)
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    out = keras.layers.Dense(10, activation="softmax", name="probs")(x)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    model.fit(images[:TRAIN], labels[:TRAIN], epochs=40, batch_size=64, verbose=0)
    savedmodel = root / "digits"
    model.export(str(savedmodel), verbose=False)
    npz = root / "calibration.npz"
    np.savez(npz, image=images[TRAIN:], labels=labels[TRAIN:])
    return {"root": root, "savedmodel": savedmodel, "npz": npz, "images": images, "labels": labels}


@pytest.fixture(scope="module")
def int8_build(digits: dict[str, Any]) -> dict[str, Any]:
    """`kubetrt lower --calibration` then `kubetrt build --target host:int8` through the real CLI."""
    root = digits["root"]
    package, store = root / "package", root / "store"
    assert main(["lower", str(digits["savedmodel"]), "-o", str(package), "--name", "digits",
                 "--calibration", str(digits["npz"]), "--calibration-method", "entropy", "--holdout", "0.5"]) == 0
    log = root / "termination.json"
    assert main(["build", "--package", str(package), "--target", "host:int8:1/8/32", "--store", str(store),
                 "--termination-log", str(log)]) == 0
    result = json.loads(log.read_text())
    manifest = json.loads((package / "manifest.json").read_text())
    return {"package": package, "store": store, "result": result, "manifest": manifest}


def test_int8_engine_verifies_on_held_out_digits(int8_build: dict[str, Any]) -> None:
    result, manifest = int8_build["result"], int8_build["manifest"]
    assert result["verified"] and result["engineKey"].endswith("_int8_b1-8-32")
    store = LocalStore(int8_build["store"])
    (digest,) = [p.name for p in Path(int8_build["store"]).iterdir() if p.is_dir()]
    report = store.read_report(digest, result["engineKey"])
    heldout = report["heldout"]
    (probs,) = heldout["outputs"]
    assert heldout["passed"] and heldout["samples"] == manifest["heldout"]["samples"] > 300
    assert probs["tensorflow_accuracy"] > 90.0  # the model did learn the task
    assert probs["accuracy_drop_points"] <= heldout_gate("int8").max_accuracy_drop
    assert probs["top1_agreement"] >= heldout_gate("int8").min_top1_agreement
    # the engine ran the quantized model on integer kernels, not the float one
    build = report["build"]
    assert build["model"]["file"] == "model.int8.onnx"
    assert manifest["quantization"]["method"] == "entropy"
    print(f"digits held-out ({heldout['samples']} samples): TensorFlow fp32 {probs['tensorflow_accuracy']:.2f}%, "
          f"kubetrt int8 {probs['accuracy']:.2f}%, top-1 agreement {100 * probs['top1_agreement']:.1f}%")


def test_int8_engine_runs_integer_convolutions(int8_build: dict[str, Any]) -> None:
    from kubetrt.runtime.onnx_import import load_onnx
    from kubetrt.runtime.passes import optimize

    graph = optimize(load_onnx(int8_build["package"] / "model.int8.onnx"))
    ops = Counter(n.op for n in graph.nodes)
    assert ops["QConvNHWC"] == 3 and ops["QMatMul"] == 1, ops
    assert not {"FusedConvNHWC", "FusedConv", "Conv", "FusedMatMul"} & set(ops), ops


def test_served_int8_engine_answers_like_the_verified_one(int8_build: dict[str, Any], digits: dict[str, Any],
                                                          tmp_path: Path) -> None:
    """`kubetrt serve` as the operator's pod runs it: package and engine from the store by key."""
    key = int8_build["result"]["engineKey"]
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "kubetrt.cli", "serve", f"file://{int8_build['package']}",
           "--store", f"file://{int8_build['store']}", "--engine-key", key, "--cache-dir", str(tmp_path / "cache"),
           "--model-name", "digits", "--model-version", "1", "--host", "127.0.0.1", "--port", str(port),
           "--grpc-port", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        images, labels = digits["images"][-16:], digits["labels"][-16:]
        body = {"inputs": [{"name": "image", "shape": list(images.shape), "datatype": "FP32",
                            "data": images.reshape(-1).tolist()}]}
        r = httpx.post(url + "/v2/models/digits/infer", json=body, timeout=30)
        assert r.status_code == 200, r.text
        (out,) = r.json()["outputs"]
        probs = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
        assert probs.shape == (16, 10)
        assert np.mean(probs.argmax(axis=1) == labels) >= 0.8
        from kubetrt.runtime.devices.host import RUNTIME
        from kubetrt.runtime.onnx_import import load_onnx

        local = RUNTIME.prepare(load_onnx(int8_build["package"] / "model.int8.onnx"), {})
        (want,) = local.run([images])
        np.testing.assert_allclose(probs, want, atol=1e-6)  # the served engine is the int8 one
    finally:
        proc.terminate()
        proc.wait(20)
