"""Per-request traces (`kubetrt serve --trace-file`): one JSON line per traced call, over every
transport, with its stamps in the order the call passed them and a batch's run shared by its requests."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from kubetrt.serving.app import create_app
from kubetrt.serving.batcher import BatcherConfig
from kubetrt.serving.registry import ServingConfig
from kubetrt.serving.request_trace import RequestTraces
from serving_support import GatedModel, LiveServer, cnn_input

CALL = ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"]


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def stamps(line: dict[str, Any]) -> list[tuple[str, int]]:
    return [(t["name"], t["ns"]) for t in line["timestamps"]]


def test_one_call_in_rate_is_traced(tmp_path):
    traces = RequestTraces(tmp_path / "t.jsonl", rate=3)
    picked = [traces.start("m", "1") for _ in range(7)]
    assert [t is not None for t in picked] == [False, False, True, False, False, True, False]
    for t in picked:
        if t is not None:
            traces.finish(t, "success")
    traces.close()
    assert [line["id"] for line in lines(tmp_path / "t.jsonl")] == [1, 2]


def test_a_rate_below_one_or_a_file_that_cannot_open_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="trace rate 0"):
        RequestTraces(tmp_path / "t.jsonl", rate=0)
    with pytest.raises(ValueError, match="no-such-dir/t.jsonl"):
        RequestTraces(tmp_path / "no-such-dir" / "t.jsonl", rate=1)


def test_every_transports_calls_are_traced_in_order_and_bad_ones_without_a_run(cnn_package, tmp_path):
    path = tmp_path / "trace.jsonl"
    config = ServingConfig(device="host", grpc_port=0, trace_file=str(path), trace_rate=1)
    x = cnn_input(1)
    with LiveServer(create_app([cnn_package], config)) as live:
        live.wait_ready()
        r = httpx.post(live.url + "/v2/models/small_cnn/infer", json={"inputs": [
            {"name": "image", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]})
        assert r.status_code == 200
        http = httpclient.InferenceServerClient(live.host)
        inp = httpclient.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        http.infer("small_cnn", [inp])
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{live.app.state.grpc_port}")
        ginp = grpcclient.InferInput("image", list(x.shape), "FP32")
        ginp.set_data_from_numpy(x)
        grpc.infer("small_cnn", [ginp])
        grpc.close()
        bad = httpx.post(live.url + "/v2/models/small_cnn/infer", json={"inputs": [
            {"name": "image", "datatype": "FP32", "shape": [1, 2], "data": [0.0, 1.0]}]})
        assert bad.status_code == 400
    traced = lines(path)
    assert [line["outcome"] for line in traced] == ["success"] * 3 + ["bad_request"]
    assert {line["model"] for line in traced} == {"small_cnn"}
    for line in traced[:3]:
        names, ns = zip(*stamps(line))
        assert list(names) == CALL and list(ns) == sorted(ns), line
    assert [name for name, _ in stamps(traced[3])] == ["REQUEST_START", "REQUEST_END"], "refused before the batcher"


def test_a_batchs_requests_share_its_run_and_queued_ones_wait_for_it(cnn_model, tmp_path):
    path = tmp_path / "trace.jsonl"
    gated = GatedModel(cnn_model)
    config = ServingConfig(batcher=BatcherConfig(max_batch_size=8), trace_file=str(path), trace_rate=1)
    with LiveServer(create_app(config=config, models=[gated])) as live:
        live.wait_ready()
        gated.armed = True
        x = cnn_input(1)

        def call() -> None:
            body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
            assert httpx.post(live.url + "/v2/models/small_cnn/infer", json=body, timeout=30).status_code == 200

        first = threading.Thread(target=call)
        first.start()
        try:
            assert gated.entered.wait(10)
            rest = [threading.Thread(target=call) for _ in range(3)]
            for t in rest:
                t.start()
            deadline = time.monotonic() + 10
            while live.registry.get("small_cnn").batcher.queued < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            gated.gate.set()
        for t in [first, *rest]:
            t.join(30)
    traced = [dict(stamps(line)) for line in lines(path)]
    assert len(traced) == 4
    alone = min(traced, key=lambda s: s["REQUEST_START"])
    batched = [s for s in traced if s is not alone]
    assert len({(s["COMPUTE_START"], s["COMPUTE_END"]) for s in batched}) == 1, "one run computed the three"
    assert all(s["QUEUE_START"] < alone["COMPUTE_END"] <= s["COMPUTE_START"] for s in batched), \
        "queued while the first ran, run after it"
    assert np.all([s["COMPUTE_END"] <= s["REQUEST_END"] for s in traced])
