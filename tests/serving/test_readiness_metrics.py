"""Readiness gated on the golden check, and the Prometheus metrics it and inference produce."""
from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kubetrt.serving.app import create_app
from kubetrt.pipeline.servable import ServableSource, resolve_servable
from kubetrt.runtime import load_model
from kubetrt.serving.metrics import ServingMetrics
from kubetrt.serving.registry import ModelRegistry, ServingConfig
from serving_support import LiveServer, ModelDouble, cnn_input


def settled(c: httpx.Client, name: str) -> dict:
    """The model's OIP metadata once it is no longer loading."""
    deadline = time.monotonic() + 30
    while (md := c.get(f"/v2/models/{name}").json())["state"] == "loading":
        assert time.monotonic() < deadline, "model never finished loading"
        time.sleep(0.01)
    return md


class DriftingModel(ModelDouble):
    """Outputs off by 1e-3: what a miscompiled engine looks like to the golden check."""

    def predict(self, feeds):
        return {k: v + np.float32(1e-3) for k, v in super().predict(feeds).items()}


def test_golden_mismatch_keeps_model_unready_and_says_why(cnn_model):
    with LiveServer(create_app(models=[DriftingModel(cnn_model)])) as live, \
            httpx.Client(base_url=live.url, timeout=30) as c:
        md = settled(c, "small_cnn")
        assert md["ready"] is False and md["state"] == "failed"
        assert "golden check failed" in md["reason"] and "output_0" in md["reason"] and "rtol=0.0001" in md["reason"]
        assert "(fp32, host)" in md["reason"], "a model with no verified engine is held to the table's tolerance"
        r = c.get("/v2/models/small_cnn/ready")
        assert r.status_code == 503 and "golden" in r.json()["error"]
        r = c.get("/v2/health/ready")
        assert r.status_code == 503 and "small_cnn" in r.json()["error"]
        assert c.get("/v2/health/live").status_code == 200
        x = cnn_input(1)
        r = c.post("/v2/models/small_cnn/infer",
                   json={"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 32, 32, 3], "data": x.ravel().tolist()}]})
        assert r.status_code == 503 and "not ready" in r.json()["error"]
        status = c.get("/v1/models/small_cnn").json()["model_version_status"][0]
        assert status["state"] == "END" and "golden" in status["status"]["error_message"]
        assert 'kubetrt_model_ready{model="small_cnn"} 0.0' in c.get("/metrics").text


def test_broken_package_is_unready_not_fatal(tmp_path, cnn_package):
    pkg = tmp_path / "pkg"
    shutil.copytree(cnn_package, pkg)
    (pkg / "model.onnx").write_bytes(b"not onnx")  # digest mismatch: the runtime refuses it
    with LiveServer(create_app([pkg])) as live, httpx.Client(base_url=live.url, timeout=30) as c:
        md = settled(c, "small_cnn")
        assert md["state"] == "failed" and "load failed" in md["reason"] and "model.onnx" in md["reason"]
        assert c.get("/v2/health/ready").status_code == 503


class OffsetModel(ModelDouble):
    """Every output shifted by `offset`: within one tolerance, beyond another."""

    def __init__(self, model, offset: float) -> None:
        super().__init__(model)
        self.offset = np.float32(offset)

    def predict(self, feeds):
        return {k: v + self.offset for k, v in super().predict(feeds).items()}


def verified_engine(published_cnn, tmp_path, atol: float):
    """The small CNN's host engine served from a store whose report recorded tolerance `atol`."""
    root, package_uri, key = published_cnn
    store = tmp_path / "store"
    shutil.copytree(root, store)
    report_path = next(store.glob(f"*/{key}/report.json"))
    report = json.loads(report_path.read_text())
    report["tolerance"].update(atol=atol, rtol=atol)
    report_path.write_text(json.dumps(report))
    servable = resolve_servable(ServableSource(package_uri, str(store), key), tmp_path / "cache")
    return load_model(servable.package_dir, "host", engine_key=key)


def golden_check(model) -> tuple[str, str]:
    registry = ModelRegistry(ServingConfig(device="host"), ServingMetrics())
    served = registry.add_model(model)
    served.load()
    served.close()
    return served.state.value, served.reason


def test_a_verified_engine_is_held_to_the_tolerance_its_report_recorded(published_cnn, cnn_model, tmp_path):
    """Outputs off by 5e-5 pass the table's fp32 host tolerance (1e-4 + 1e-4*|tf|) but not an
    engine recorded as verified at 1e-5; off by 1e-3 they fail the table but pass an engine
    recorded at 1e-2."""
    assert golden_check(OffsetModel(cnn_model, 5e-5))[0] == "ready"
    state, reason = golden_check(OffsetModel(verified_engine(published_cnn, tmp_path / "tight", 1e-5), 5e-5))
    assert state == "failed" and "atol=1e-05 rtol=1e-05 (fp32, host)" in reason and "output_0" in reason
    assert golden_check(OffsetModel(cnn_model, 1e-3))[0] == "failed"
    assert golden_check(OffsetModel(verified_engine(published_cnn, tmp_path / "loose", 1e-2), 1e-3))[0] == "ready"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_outcomes_durations_and_batches(server, client):
    before = samples(client.get("/metrics").text)
    x = cnn_input(2)
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [2, 32, 32, 3], "data": x.ravel().tolist()}]}
    assert client.post("/v2/models/small_cnn/infer", json=body).status_code == 200
    assert client.post("/v1/models/small_cnn:predict", json={"instances": x.tolist()}).status_code == 200
    assert client.post("/v2/models/small_cnn/infer", json={"inputs": "nope"}).status_code == 400
    assert client.post("/v2/models/missing/infer", json=body).status_code == 404
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = samples(r.text)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    m = "small_cnn"
    assert delta("kubetrt_inference_requests_total", model=m, outcome="success") == 2
    assert delta("kubetrt_inference_requests_total", model=m, outcome="bad_request") == 1
    assert delta("kubetrt_inference_requests_total", model="_unknown", outcome="not_found") == 1
    assert delta("kubetrt_request_duration_seconds_count", model=m) == 3
    assert delta("kubetrt_queue_duration_seconds_count", model=m) == 2
    assert delta("kubetrt_compute_duration_seconds_count", model=m) == 2
    assert delta("kubetrt_batch_size_sum", model=m) == 4  # two batches of 2 rows
    assert after[("kubetrt_inflight_requests", (("model", m),))] == 0
    assert after[("kubetrt_model_ready", (("model", "two_in_two_out"),))] == 1


def test_two_apps_have_separate_registries(cnn_model):
    a, b = create_app(config=ServingConfig(), models=[cnn_model]), create_app(models=[cnn_model])
    assert a.state.metrics.registry is not b.state.metrics.registry


def test_held_observations_count_at_the_next_scrape_and_never_pile_up():
    """Calls and batches are observed in bulk: a scrape counts every one reported before it, and a
    model that is never scraped folds them in as they reach the limit instead of holding them all."""
    from kubetrt.serving.metrics import FOLD_AT, HOLD_LIMIT

    metrics = ServingMetrics()
    m = metrics.for_model("m")
    m.on_request("success", 0.002)
    m.on_batch(3, 2, [0.001, 0.0005], 0.004)
    after = samples(metrics.render().decode())
    assert after[("kubetrt_inference_requests_total", (("model", "m"), ("outcome", "success")))] == 1
    assert after[("kubetrt_batch_size_sum", (("model", "m"),))] == 3
    assert after[("kubetrt_queue_duration_seconds_count", (("model", "m"),))] == 2
    for _ in range(3 * HOLD_LIMIT):
        m.on_batch(1, 1, [0.0], 0.001)
    counted = metrics.registry.get_sample_value("kubetrt_batch_size_count", {"model": "m"})
    assert counted >= 2 * HOLD_LIMIT, "batches with no call's end after them folded at the limit"
    assert len(m._held) < HOLD_LIMIT

    async def calls() -> list[int]:
        """Calls' ends on an event loop: folded a few at a time, after the step that ended them."""
        held = []
        for _ in range(3 * FOLD_AT):
            m.on_request("success", 0.001)
            await asyncio.sleep(0)  # the rest of the loop's step
            held.append(len(m._held))
        return held

    metrics.render()
    held = asyncio.run(calls())
    assert max(held) < FOLD_AT and held.count(0) >= 2, held
    assert metrics.registry.get_sample_value(
        "kubetrt_inference_requests_total", {"model": "m", "outcome": "success"}) >= 1 + 2 * FOLD_AT
