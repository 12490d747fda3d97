"""Protocol codecs as pure functions: every OIP datatype, JSON and binary, TF Serving shapes."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from kubetrt.runtime.package import TensorSpec
from kubetrt.serving import oip, tfserving
from kubetrt.serving.errors import BadRequest

SAMPLES = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 7, 255]], np.uint8),
    "UINT16": np.array([[0, 7, 65535]], np.uint16),
    "UINT32": np.array([[0, 7, 2**32 - 1]], np.uint32),
    "UINT64": np.array([[0, 7, 2**64 - 1]], np.uint64),
    "INT8": np.array([[-128, 0, 127]], np.int8),
    "INT16": np.array([[-(2**15), 0, 2**15 - 1]], np.int16),
    "INT32": np.array([[-(2**31), 0, 2**31 - 1]], np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1]], np.int64),
    "FP16": np.array([[0.5, -1.25, 65504.0]], np.float16),
    "FP32": np.array([[0.1, -2.5, 3e38]], np.float32),
    "FP64": np.array([[0.1, -2.5, 1e300]], np.float64),
    "BYTES": np.array([[b"a", b"", "é".encode()]], dtype=object),
}


def spec(datatype: str) -> list[TensorSpec]:
    dtype = "object" if datatype == "BYTES" else str(SAMPLES[datatype].dtype)
    return [TensorSpec("x", dtype, (-1, 3))]


def json_data(arr: np.ndarray) -> list:
    if arr.dtype == object:
        return [v.decode() for v in arr.ravel()]
    return arr.ravel().tolist()


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_json_round_trip_every_datatype(datatype):
    arr = SAMPLES[datatype]
    body = json.dumps({"id": "7", "inputs": [{"name": "x", "datatype": datatype, "shape": [1, 3], "data": json_data(arr)}]})
    req = oip.decode_infer_request(body.encode(), None, spec(datatype), spec(datatype))
    got = req.feeds["x"]
    assert got.dtype == arr.dtype and got.shape == (1, 3)
    assert got.tolist() == arr.tolist()
    payload, header_len = oip.encode_infer_response("m", "1", req, {"x": got})
    assert header_len is None
    doc = json.loads(payload)
    assert doc["id"] == "7" and doc["outputs"][0]["datatype"] == datatype
    data = doc["outputs"][0]["data"]
    if arr.dtype.kind == "f":  # written as the shortest decimal that reads back as the same value of its width
        np.testing.assert_array_equal(np.array(data, dtype=arr.dtype), arr.ravel())
    else:
        assert data == json_data(arr)


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_binary_round_trip_every_datatype(datatype):
    arr = SAMPLES[datatype]
    if datatype == "BYTES":
        blob = b"".join(struct.pack("<I", len(v)) + v for v in arr.ravel())
    else:
        blob = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
    header = json.dumps({
        "inputs": [{"name": "x", "datatype": datatype, "shape": [1, 3], "parameters": {"binary_data_size": len(blob)}}],
        "outputs": [{"name": "x", "parameters": {"binary_data": True}}],
    }).encode()
    req = oip.decode_infer_request(header + blob, len(header), spec(datatype), spec(datatype))
    assert req.feeds["x"].tolist() == arr.tolist()
    payload, header_len = oip.encode_infer_response("m", "1", req, {"x": req.feeds["x"]})
    out = json.loads(payload[:header_len])["outputs"][0]
    assert out["parameters"]["binary_data_size"] == len(blob) and "data" not in out
    assert payload[header_len:] == blob


@pytest.mark.parametrize(
    "datatype,data,fragment",
    [
        ("INT32", [1.5, 2, 3], "needs integers"),
        ("UINT8", [1, 2, 256], "out of range"),
        ("UINT8", [-1, 2, 3], "out of range"),
        ("BOOL", [1, 0, 1], "true/false"),
        ("FP32", [1, "2", 3], "needs numbers"),
        ("FP32", [[1, 2], [3]], "regular"),
        ("BYTES", [1, 2, 3], "needs strings"),
    ],
)
def test_json_values_that_do_not_fit_are_rejected(datatype, data, fragment):
    body = json.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": [1, 3], "data": data}]}).encode()
    with pytest.raises(BadRequest, match=fragment) as info:
        oip.decode_infer_request(body, None, spec(datatype), spec(datatype))
    assert "input 'x'" in info.value.message


@pytest.mark.parametrize(
    "doc,fragment",
    [
        ([], "JSON object"),
        ({"inputs": []}, "non-empty list"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, -3], "data": []}]}, "non-negative"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3]}]}, "neither 'data'"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}] * 2}, "given twice"),
        ({"id": 5, "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}, "'id'"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}],
          "outputs": [{"name": "y"}]}, "unknown output 'y'"),
    ],
)
def test_malformed_requests(doc, fragment):
    with pytest.raises(BadRequest, match=fragment):
        oip.decode_infer_request(json.dumps(doc).encode(), None, spec("FP32"), spec("FP32"))


def test_trailing_binary_data_is_rejected():
    header = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[1,3],"data":[1,2,3]}]}'
    with pytest.raises(BadRequest, match="4 bytes of binary data"):
        oip.decode_infer_request(header + b"\0" * 4, len(header), spec("FP32"), spec("FP32"))


TWO = [TensorSpec("a", "float32", (-1, 2)), TensorSpec("b", "int64", (-1,))]
OUTS = [TensorSpec("y", "float32", (-1, 2)), TensorSpec("z", "int64", (-1,))]


def test_tfserving_row_and_columnar_decode():
    feeds, columnar = tfserving.decode_predict(
        b'{"instances":[{"a":[1,2],"b":3},{"a":[4,5],"b":6}]}', TWO
    )
    assert not columnar
    assert feeds["a"].tolist() == [[1, 2], [4, 5]] and feeds["a"].dtype == np.float32
    assert feeds["b"].tolist() == [3, 6] and feeds["b"].dtype == np.int64
    feeds, columnar = tfserving.decode_predict(b'{"inputs":{"a":[[1,2]],"b":[3]}}', TWO)
    assert columnar and feeds["b"].tolist() == [3]
    with pytest.raises(BadRequest, match="single-input"):
        tfserving.decode_predict(b'{"instances":[[1,2]]}', TWO)


def test_tfserving_encode_follows_the_rest_docs():
    res = {"y": np.array([[1, 2], [3, 4]], np.float32), "z": np.array([5, 6])}
    assert json.loads(tfserving.encode_predict(res, OUTS, columnar=False)) == {
        "predictions": [{"y": [1.0, 2.0], "z": 5}, {"y": [3.0, 4.0], "z": 6}]
    }
    assert json.loads(tfserving.encode_predict(res, OUTS, columnar=True)) == {
        "outputs": {"y": [[1.0, 2.0], [3.0, 4.0]], "z": [5, 6]}
    }
    assert json.loads(tfserving.encode_predict(res, OUTS[:1], columnar=False)) == {"predictions": [[1.0, 2.0], [3.0, 4.0]]}
    assert json.loads(tfserving.encode_predict(res, OUTS[:1], columnar=True)) == {"outputs": [[1.0, 2.0], [3.0, 4.0]]}
