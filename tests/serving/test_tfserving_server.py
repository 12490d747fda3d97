"""TensorFlow Serving REST over a live server, requests shaped as TF Serving's REST API docs show."""
from __future__ import annotations

import numpy as np

from serving_support import cnn_input, two_inputs


def test_model_status_and_metadata(client):
    r = client.get("/v1/models/small_cnn")
    assert r.status_code == 200
    assert r.json() == {
        "model_version_status": [
            {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
        ]
    }
    assert client.get("/v1/models/small_cnn/versions/1").status_code == 200
    md = client.get("/v1/models/two_in_two_out/metadata").json()
    assert md["model_spec"] == {"name": "two_in_two_out", "signature_name": "", "version": "1"}
    sig = md["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sig["inputs"]["ids"]["dtype"] == "DT_INT32"
    assert [d["size"] for d in sig["inputs"]["ids"]["tensor_shape"]["dim"]] == ["-1", "2", "3"]
    assert sig["outputs"]["score"]["dtype"] == "DT_FLOAT"
    assert sig["method_name"] == "tensorflow/serving/predict"


def test_row_format_single_input(client, cnn_model):
    x = cnn_input(3, seed=5)
    r = client.post("/v1/models/small_cnn:predict", json={"instances": x.tolist()})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["predictions"], np.float32)
    np.testing.assert_allclose(got, cnn_model.predict({"image": x})["output_0"], rtol=1e-6, atol=1e-7)


def test_row_format_named_inputs_multiple_outputs(client, two_model):
    feeds = two_inputs(3, seed=6)
    instances = [{"features": feeds["features"][i].tolist(), "ids": feeds["ids"][i].tolist()} for i in range(3)]
    r = client.post("/v1/models/two_in_two_out:predict", json={"signature_name": "serving_default", "instances": instances})
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    want = two_model.predict(feeds)
    assert len(preds) == 3 and set(preds[0]) == {"logits", "score"}
    np.testing.assert_allclose(np.array([p["logits"] for p in preds], np.float32), want["logits"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.array([p["score"] for p in preds], np.float32), want["score"], rtol=1e-6, atol=1e-7)


def test_columnar_format(client, two_model, cnn_model):
    feeds = two_inputs(2, seed=7)
    r = client.post("/v1/models/two_in_two_out/versions/1:predict",
                    json={"inputs": {k: v.tolist() for k, v in feeds.items()}})
    assert r.status_code == 200, r.text
    outs = r.json()["outputs"]
    want = two_model.predict(feeds)
    for name in ("logits", "score"):
        np.testing.assert_allclose(np.asarray(outs[name], np.float32), want[name], rtol=1e-6, atol=1e-7)

    x = cnn_input(2, seed=8)
    r = client.post("/v1/models/small_cnn:predict", json={"inputs": x.tolist()})
    assert r.status_code == 200
    np.testing.assert_allclose(np.asarray(r.json()["outputs"], np.float32),
                               cnn_model.predict({"image": x})["output_0"], rtol=1e-6, atol=1e-7)


def test_predict_errors_name_the_problem(client):
    cases = [
        ({"instances": [[1.0]]}, 400, "image"),  # wrong shape
        ({"instances": [{"features": [0.0] * 8}]}, 400, "missing input(s) ['ids']"),
        ({"inputs": {"features": [[0.0] * 8], "ids": [[[0] * 3] * 2], "x": 1}}, 400, "unknown input(s) ['x']"),
        ({"instances": [1], "inputs": [1]}, 400, "exactly one of"),
        ({"signature_name": "other", "instances": [1]}, 400, "signature_name"),
    ]
    for body, status, fragment in cases:
        model = "small_cnn" if body.get("instances") == [[1.0]] else "two_in_two_out"
        r = client.post(f"/v1/models/{model}:predict", json=body)
        assert r.status_code == status, (body, r.text)
        assert fragment in r.json()["error"], (body, r.text)
    r = client.post("/v1/models/two_in_two_out:predict",
                    json={"instances": [{"features": [0.0] * 8, "ids": [[0.5] * 3] * 2}]})
    assert r.status_code == 400 and "input 'ids'" in r.json()["error"] and "integers" in r.json()["error"]
    r = client.post("/v1/models/nope:predict", json={"instances": [1]})
    assert r.status_code == 404 and "nope" in r.json()["error"]
