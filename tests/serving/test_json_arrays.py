"""Long JSON arrays read by simdjson into NumPy against the exact slow path (json + NumPy), value for
value, and through the OIP codec with its errors."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubetrt.runtime.package import TensorSpec
from kubetrt.serving import json_arrays as ja
from kubetrt.serving import oip
from kubetrt.serving.errors import BadRequest
from kubetrt.serving.tensors import array_from_json
from serving_support import json_decimals


def lazy(text: str) -> ja.LazyArray | list:
    """The array as loads leaves it (a body simdjson refuses, e.g. a number that underflows to 0,
    is read by orjson whole: Python values, the same numbers)."""
    return ja.loads(('{"data": ' + text + "}").encode())["data"]


def padded(values: list[str]) -> str:
    reps = ja.LONG_ARRAY // len(values) + 1
    return "[" + ", ".join(values * reps) + "]"


def read(text: str, dtype: str) -> np.ndarray:
    return array_from_json(lazy(text), np.dtype(dtype), "input 'x'")


def reference(text: str, dtype: str) -> np.ndarray:
    return array_from_json(json.loads(text), np.dtype(dtype), "input 'x'").ravel()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


floats64 = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(floats64.map(repr), json_decimals), min_size=1, max_size=30),
       st.sampled_from(["float32", "float16", "float64"]))
def test_floats_round_as_the_exact_path_does(values, dtype):
    text = padded(values)
    with np.errstate(over="ignore"):
        try:
            want = reference(text, dtype)
        except BadRequest as e:  # integers past 64 bits: refused alike
            with pytest.raises(BadRequest, match="needs numbers"):
                read(text, dtype)
            assert "needs numbers" in e.message
            return
        assert same(read(text, dtype), want)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=30), st.sampled_from(["int64", "int32", "int8"]))
def test_integers_exact_or_refused_as_before(values, dtype):
    text = padded([str(v) for v in values])
    try:
        want = reference(text, dtype)
    except BadRequest as e:
        with pytest.raises(BadRequest, match="out of range"):
            read(text, dtype)
        assert "out of range" in e.message
        return
    assert same(read(text, dtype), want)


@pytest.mark.parametrize("values, dtype, message", [
    (["1", "2.5"], "int32", "needs integers"),
    (["1", "true"], "float32", None),  # mixed: Python's reading (NumPy casts True to 1.0)
    (["true", "false"], "float32", "needs numbers, got booleans"),
    (["1", "0"], "bool", "needs true/false"),
    (["1", '"a"'], "float32", "needs numbers"),
    (["1", "null"], "float32", "needs numbers"),
    (["0", str(2**64 - 1)], "uint64", None),
    (["1", str(2**64)], "uint64", "needs integers"),
    (["-1", "1"], "uint64", "out of range"),
])
def test_what_simdjson_cannot_type_reads_as_before(values, dtype, message):
    text = padded(values)
    if message is None:
        assert same(read(text, dtype), reference(text, dtype))
        return
    with pytest.raises(BadRequest, match=message):
        read(text, dtype)
    with pytest.raises(BadRequest, match=message):
        reference(text, dtype)


def test_booleans_strings_and_nested_arrays():
    assert read(padded(["true", "false"]), "bool").tolist() == [True, False] * (ja.LONG_ARRAY // 2 + 1)
    strings = read(padded(['"a"', '"\\u00e9"']), "object")
    assert strings[:2].tolist() == [b"a", "é".encode()]
    grid = np.arange(2 * 3 * 50, dtype=np.float32).reshape(2, 3, 50) / 7
    text = json.dumps([grid.tolist()] * ja.LONG_ARRAY)
    assert isinstance(lazy(text), ja.LazyArray)
    assert same(read(text, "float32")[: grid.size], grid.ravel())


def test_a_few_long_rows_read_as_one_tensor():
    specs = [TensorSpec("x", "float32", (-1, 1000))]
    rows = np.arange(2000, dtype=np.float32).reshape(2, 1000) / 3
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 1000], "data": rows.tolist()}]})
    assert len(body) >= ja.SMALL_DOCUMENT and isinstance(ja.loads(body.encode())["inputs"][0]["data"], ja.LazyArray)
    assert same(oip.decode_infer_request(body.encode(), None, specs, specs).feeds["x"], rows)
    ragged = body.replace("]]", ", 1.0]]")
    with pytest.raises(BadRequest, match=r"input 'x': shape \[2, 1000\] needs 2000 elements, data has 2001"):
        oip.decode_infer_request(ragged.encode(), None, specs, specs)  # flattened, as Triton reads rows


def test_long_arrays_stay_lazy_and_short_ones_python_values():
    assert isinstance(lazy(json.dumps(np.random.default_rng(0).random(100).tolist())), ja.LazyArray)

    doc = ja.loads(json.dumps({"shape": [1, 2, 3], "s": "[1,2,3]", "data": list(range(100))}).encode())
    assert doc["shape"] == [1, 2, 3] and doc["s"] == "[1,2,3]" and isinstance(doc["data"], ja.LazyArray)


def test_a_small_request_reads_as_python_values_a_large_one_keeps_its_long_arrays_lazy():
    small = json.dumps({"inputs": [{"name": "x", "data": list(range(100))}]}).encode()
    large = json.dumps({"inputs": [{"name": "x", "data": list(range(1000))}]}).encode()
    assert len(small) < ja.SMALL_DOCUMENT <= len(large)
    assert ja.loads_request(small) == json.loads(small)
    data = ja.loads_request(large)["inputs"][0]["data"]
    assert isinstance(data, ja.LazyArray) and data.to_list() == list(range(1000))


@pytest.mark.parametrize("loads", [ja.loads, ja.loads_request])
@pytest.mark.parametrize("body", [b'{"inputs": [1,2,]}', b'{"a": ', b'{"a": 01}'])
def test_malformed_bodies_raise_a_readable_error(loads, body):
    with pytest.raises(ValueError):
        loads(body)


def test_what_simdjson_refuses_python_reads_as_before():
    doc = ja.loads(b'{"a": [NaN, 1e400, 100000000000000000000000]}')
    assert np.isnan(doc["a"][0]) and doc["a"][1] == float("inf") and doc["a"][2] == 10**23
    assert ja.loads(b'{"id": {"\\u0000": null}}') == {"id": {"\x00": None}}  # found by the fuzz test
    values = ja.loads_values(b'{"a": [NaN, 1e400, 100000000000000000000000]}')  # TF Serving REST's reading
    assert np.isnan(values["a"][0]) and values["a"][1] == float("inf") and values["a"][2] == 10**23


def test_oip_request_names_the_tensor_in_errors():
    specs = [TensorSpec("image", "float32", (-1, 100))]
    data = np.linspace(-1, 1, 100, dtype=np.float32)
    good = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 100], "data": data.tolist()}]})
    req = oip.decode_infer_request(good.encode(), None, specs, specs)
    assert same(req.feeds["image"], data.reshape(1, 100))
    nested = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 100],
                                     "data": data.reshape(10, 10).tolist()}]})
    assert same(oip.decode_infer_request(nested.encode(), None, specs, specs).feeds["image"], data.reshape(1, 100))
    short = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 100], "data": data[:99].tolist()}]})
    with pytest.raises(BadRequest, match=r"input 'image': shape \[1, 100\] needs 100 elements, data has 99"):
        oip.decode_infer_request(short.encode(), None, specs, specs)
    words = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 100], "data": ["a"] * 100}]})
    with pytest.raises(BadRequest, match="input 'image': datatype FP32 needs numbers"):
        oip.decode_infer_request(words.encode(), None, specs, specs)
    with pytest.raises(BadRequest, match="malformed JSON"):
        oip.decode_infer_request(good.encode()[:-3], None, specs, specs)
