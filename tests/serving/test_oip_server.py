"""Open Inference Protocol over a live server, spoken by tritonclient (a client we did not write)."""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from serving_support import cnn_input, two_inputs


@pytest.fixture
def tc(server):
    c = triton.InferenceServerClient(server.host, network_timeout=30)
    yield c
    c.close()


def test_health_and_server_metadata(tc):
    assert tc.is_server_live()
    assert tc.is_server_ready()
    assert tc.get_server_metadata()["extensions"] == ["binary_tensor_data"]


def test_model_ready_and_metadata(tc):
    assert tc.is_model_ready("small_cnn")
    assert tc.is_model_ready("small_cnn", model_version="1")
    assert not tc.is_model_ready("no_such_model")
    md = tc.get_model_metadata("small_cnn")
    assert md["name"] == "small_cnn" and md["versions"] == ["1"] and md["ready"] is True
    assert md["inputs"] == [{"name": "image", "datatype": "FP32", "shape": [-1, 32, 32, 3]}]
    assert md["outputs"] == [{"name": "output_0", "datatype": "FP32", "shape": [-1, 10]}]
    md2 = tc.get_model_metadata("two_in_two_out", model_version="1")
    assert [(t["name"], t["datatype"]) for t in md2["inputs"]] == [("features", "FP32"), ("ids", "INT32")]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_small_cnn_matches_runtime(tc, cnn_model, binary):
    x = cnn_input(3, seed=1)
    inp = triton.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    out = triton.InferRequestedOutput("output_0", binary_data=binary)
    result = tc.infer("small_cnn", [inp], outputs=[out], request_id="req-42")
    assert result.get_response()["id"] == "req-42"
    got = result.as_numpy("output_0")
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, cnn_model.predict({"image": x})["output_0"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("binary_in,binary_out", [(False, False), (True, True), (True, False), (False, True)])
def test_infer_two_inputs_two_outputs(tc, two_model, binary_in, binary_out):
    feeds = two_inputs(4, seed=2)
    inputs = []
    for name, dt in (("features", "FP32"), ("ids", "INT32")):
        i = triton.InferInput(name, list(feeds[name].shape), dt)
        i.set_data_from_numpy(feeds[name], binary_data=binary_in)
        inputs.append(i)
    outputs = [triton.InferRequestedOutput(n, binary_data=binary_out) for n in ("score", "logits")]
    result = tc.infer("two_in_two_out", inputs, outputs=outputs, model_version="1")
    want = two_model.predict(feeds)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["score", "logits"]
    for name in ("logits", "score"):
        np.testing.assert_allclose(result.as_numpy(name), want[name], rtol=1e-6, atol=1e-7)


def test_requested_output_subset(tc, two_model):
    feeds = two_inputs(2, seed=3)
    inputs = []
    for name, dt in (("features", "FP32"), ("ids", "INT32")):
        i = triton.InferInput(name, list(feeds[name].shape), dt)
        i.set_data_from_numpy(feeds[name])
        inputs.append(i)
    result = tc.infer("two_in_two_out", inputs, outputs=[triton.InferRequestedOutput("score")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["score"]
    assert result.as_numpy("logits") is None
    np.testing.assert_allclose(result.as_numpy("score"), two_model.predict(feeds)["score"], rtol=1e-6)


def test_nested_json_data_and_binary_data_output_parameter(client, cnn_model):
    x = cnn_input(1, seed=4)
    body = {
        "inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 32, 32, 3], "data": x.tolist()}],
        "parameters": {"binary_data_output": True},
    }
    r = client.post("/v2/models/small_cnn/versions/1/infer", json=body)
    assert r.status_code == 200
    n = int(r.headers["inference-header-content-length"])
    header = httpx.Response(200, content=r.content[:n]).json()
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 40
    got = np.frombuffer(r.content[n:], "<f4").reshape(1, 10)
    np.testing.assert_allclose(got, cnn_model.predict({"image": x})["output_0"], rtol=1e-6)


def test_unknown_version_is_404(client):
    r = client.get("/v2/models/small_cnn/versions/7")
    assert r.status_code == 404 and "no version '7'" in r.json()["error"]
    r = client.post("/v2/models/small_cnn/versions/7/infer", json={"inputs": []})
    assert r.status_code == 404


def test_large_json_is_decoded_off_the_loop_and_binary_on_it(tc, cnn_model, monkeypatch):
    """A large JSON body is parsed on a codec thread, its tensor by the parallel scanner, so the
    event loop goes on serving; a binary tensor of the same size is a view of the body, cheaper
    than the hand-off, so it stays."""
    from kubetrt.serving import infer_route, json_numbers, oip

    threads: list[str] = []
    scanned: list[int] = []
    decode, scan = oip.decode_infer_request, json_numbers.read_float32

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return decode(*args, **kwargs)

    def scan_spy(*args, **kwargs):
        out = scan(*args, **kwargs)
        scanned.append(-1 if out is None else out.size)
        return out

    monkeypatch.setattr(oip, "decode_infer_request", spy)
    monkeypatch.setattr(json_numbers, "read_float32", scan_spy)
    x = cnn_input(12, seed=4)
    assert x.nbytes > infer_route.OFFLOAD_BYTES
    for binary in (False, True):
        inp = triton.InferInput("image", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=binary)
        got = tc.infer("small_cnn", [inp]).as_numpy("output_0")
        np.testing.assert_allclose(got, cnn_model.predict({"image": x})["output_0"], rtol=1e-6, atol=1e-7)
    assert threads[0].startswith("kubetrt-codec"), threads
    assert not threads[1].startswith("kubetrt-codec"), threads
    assert scanned == [x.size] if json_numbers.available() else scanned == []


def test_the_server_polls_for_the_next_call_after_an_answer(tc, cnn_model):
    from kubetrt.serving import idle_polling

    def turns() -> int:
        return sum(p.turns for p in list(idle_polling._BY_LOOP.values()))

    x = cnn_input(1, seed=2)
    inp = triton.InferInput("image", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    for _ in range(20):  # the shared server may still hold another test's call, which defers the polling
        before = turns()
        tc.infer("small_cnn", [inp])
        time.sleep(0.01)  # past the window (--idle-poll-us, 500 by default)
        if turns() > before:
            return
    raise AssertionError("the loop never polled after an answer")
