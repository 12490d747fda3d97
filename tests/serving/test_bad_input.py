"""Bad input is answered 400/404/413 with an OIP {"error": ...} body naming what was wrong; a
hypothesis fuzz of the infer routes never gets a 5xx and leaves the server answering."""
from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving_support import MAX_BODY, cnn_input

INFER = "/v2/models/small_cnn/infer"


def good_body(rows: int = 1) -> dict:
    return {"inputs": [{"name": "image", "datatype": "FP32", "shape": [rows, 32, 32, 3],
                        "data": cnn_input(rows).ravel().tolist()}]}


def error_of(r, status: int) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


def test_malformed_json(client):
    msg = error_of(client.post(INFER, content=b'{"inputs": [', headers={"content-type": "application/json"}), 400)
    assert "malformed JSON" in msg


def test_unknown_model(client):
    assert "unknown model 'nope'" in error_of(client.post("/v2/models/nope/infer", json=good_body()), 404)
    assert "unknown model 'nope'" in error_of(client.get("/v2/models/nope"), 404)
    assert "nope" in error_of(client.get("/v2/models/nope/ready"), 404)


def test_unknown_input(client):
    body = good_body()
    body["inputs"][0]["name"] = "picture"
    msg = error_of(client.post(INFER, json=body), 400)
    assert "unknown input 'picture'" in msg and "image" in msg


def test_missing_input(client):
    body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 8], "data": [0.0] * 8}]}
    msg = error_of(client.post("/v2/models/two_in_two_out/infer", json=body), 400)
    assert "missing input 'ids'" in msg


def test_wrong_datatype(client):
    body = good_body()
    body["inputs"][0]["datatype"] = "INT32"
    msg = error_of(client.post(INFER, json=body), 400)
    assert "input 'image'" in msg and "INT32" in msg and "FP32" in msg
    body["inputs"][0]["datatype"] = "FLOAT"
    assert "unknown datatype 'FLOAT'" in error_of(client.post(INFER, json=body), 400)


def test_wrong_value_types(client):
    body = good_body()
    body["inputs"][0]["data"][5] = "x"
    assert "needs numbers" in error_of(client.post(INFER, json=body), 400)
    ids = {"name": "ids", "datatype": "INT32", "shape": [1, 2, 3], "data": [1, 2, 3, 4, 5, 2**40]}
    feats = {"name": "features", "datatype": "FP32", "shape": [1, 8], "data": [0.0] * 8}
    msg = error_of(client.post("/v2/models/two_in_two_out/infer", json={"inputs": [feats, ids]}), 400)
    assert "input 'ids'" in msg and "out of range" in msg


def test_shape_data_length_mismatch(client):
    body = good_body()
    body["inputs"][0]["data"] = body["inputs"][0]["data"][:-1]
    msg = error_of(client.post(INFER, json=body), 400)
    assert "input 'image'" in msg and "needs 3072 elements, data has 3071" in msg


def test_wrong_shape_for_model(client):
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 16, 16, 3], "data": [0.0] * 768}]}
    msg = error_of(client.post(INFER, json=body), 400)
    assert "input 'image'" in msg and "shape" in msg and "[1, 16, 16, 3]" in msg


def test_binary_size_mismatch(client):
    x = cnn_input(1)
    header = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 32, 32, 3],
                                     "parameters": {"binary_data_size": x.nbytes - 4}}]}).encode()
    r = client.post(INFER, content=header + x.tobytes()[:-4],
                    headers={"Inference-Header-Content-Length": str(len(header))})
    msg = error_of(r, 400)
    assert "input 'image'" in msg and "needs 12288 bytes" in msg
    r = client.post(INFER, content=header, headers={"Inference-Header-Content-Length": str(len(header) + 10)})
    assert "Inference-Header-Content-Length" in error_of(r, 400)


def test_oversize_body(client):
    big = b" " * (MAX_BODY + 1)
    msg = error_of(client.post(INFER, content=big, headers={"content-type": "application/json"}), 413)
    assert f"exceeds the limit of {MAX_BODY} bytes" in msg

    def chunks():  # no Content-Length: the stream is counted as it arrives
        for _ in range(MAX_BODY // 65536 + 2):
            yield b" " * 65536

    assert "exceeds the limit" in error_of(client.post(INFER, content=chunks()), 413)
    assert client.post(INFER, json=good_body()).status_code == 200


def test_unknown_route_and_method(client):
    assert "no route" in error_of(client.get("/v2/nothing/here"), 404)
    assert "not allowed" in error_of(client.get(INFER), 405)


def test_empty_batch_is_rejected(client):
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [0, 32, 32, 3], "data": []}]}
    assert "input 'image'" in error_of(client.post(INFER, json=body), 400)


# --------------------------------------------------------------------------- fuzz

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.text(max_size=8)
)
json_value = st.recursive(
    json_leaf,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)
datatypes = st.one_of(
    st.sampled_from(["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16", "x"]), json_value
)
shapes = st.one_of(
    st.lists(st.integers(-2, 40), max_size=5),
    st.just([1, 32, 32, 3]),
    st.just([2, 8]),
    st.just([1, 2, 3]),
    json_value,
)
tensor = st.fixed_dictionaries(
    {"name": st.sampled_from(["image", "features", "ids", "nope", ""]), "datatype": datatypes, "shape": shapes},
    optional={
        "data": st.one_of(json_value, st.lists(st.floats(width=32), min_size=0, max_size=64)),
        "parameters": st.one_of(
            json_value, st.fixed_dictionaries({"binary_data_size": st.integers(-4, 64)})
        ),
    },
)
infer_doc = st.fixed_dictionaries(
    {"inputs": st.one_of(st.lists(tensor, max_size=3), json_value)},
    optional={
        "id": json_value,
        "outputs": st.one_of(
            st.lists(st.fixed_dictionaries({"name": st.text(max_size=8)}, optional={"parameters": json_value}), max_size=2),
            json_value,
        ),
        "parameters": st.one_of(json_value, st.fixed_dictionaries({"binary_data_output": json_value})),
    },
)


@st.composite
def requests(draw):
    model = draw(st.sampled_from(["small_cnn", "two_in_two_out"]))
    route = draw(st.sampled_from([
        f"/v2/models/{model}/infer", f"/v2/models/{model}/versions/1/infer", f"/v1/models/{model}:predict",
    ]))
    kind = draw(st.sampled_from(["doc", "doc", "any", "bytes"]))
    headers = {"content-type": "application/json"}
    if kind == "doc":
        doc = draw(infer_doc)
        if route.endswith(":predict"):
            doc = {draw(st.sampled_from(["instances", "inputs"])): doc["inputs"]}
        body = json.dumps(doc).encode()
    elif kind == "any":
        body = json.dumps(draw(json_value)).encode()
    else:
        body = draw(st.binary(max_size=64))
    if draw(st.booleans()):
        blob = draw(st.binary(max_size=64))
        headers["Inference-Header-Content-Length"] = str(draw(st.integers(-2, len(body) + len(blob) + 2)))
        body += blob
    return route, body, headers


def test_fuzz_infer_routes_never_5xx_and_server_survives(client, cnn_model):
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(req=requests())
    def fuzz(req):
        route, body, headers = req
        r = client.post(route, content=body, headers=headers)
        assert r.status_code < 500, (route, body[:200], r.status_code, r.text)
        if r.status_code >= 400:
            assert isinstance(r.json()["error"], str)

    fuzz()
    # Still live, ready and computing correct results: nothing above wedged the batcher.
    assert client.get("/v2/health/ready").status_code == 200
    x = cnn_input(1, seed=9)
    body = {"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 32, 32, 3], "data": x.ravel().tolist()}]}
    r = client.post(INFER, json=body)
    assert r.status_code == 200
    np.testing.assert_allclose(np.asarray(r.json()["outputs"][0]["data"], np.float32).reshape(1, 10),
                               cnn_model.predict({"image": x})["output_0"], rtol=1e-6)
