"""The compiled JSON number scanner against the exact slow path (json + NumPy), value for value.

The reference for a float32/float16 tensor is Python's correctly rounded double cast by NumPy,
which is what the slow path computes: where the scanner cannot be sure to match it, it must fall
back, so every case here must be equal bit for bit, never merely close.
"""
from __future__ import annotations

import json

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubetrt.serving import json_arrays as ja
from kubetrt.serving import oip
from kubetrt.runtime.package import TensorSpec
from kubetrt.serving.errors import BadRequest

pytestmark = pytest.mark.skipif(not ja._COMPILED, reason="numba is a base dependency; only KUBETRT_DISABLE_JIT turns it off")


def scan(text: str, dtype: str) -> np.ndarray:
    """Parse a body holding one array big enough to be cut out, through the scanner."""
    body = ('{"pad": "' + " " * ja.MIN_SPAN_BYTES + '", "data": ' + text + "}").encode()
    doc = ja.loads(body)
    arr = doc["data"]
    assert isinstance(arr, ja.NumberArray), "the array was not cut out of the document"
    return arr.to_numpy(np.dtype(dtype))


def padded(values: list[str]) -> str:
    """A flat array of the given number texts, long enough to be cut out."""
    reps = ja.MIN_SPAN_BYTES // max(1, sum(len(v) + 1 for v in values)) + 1
    return "[" + ",".join(values * reps) + "]"


def reference(text: str, dtype: str) -> np.ndarray:
    return np.asarray(json.loads(text)).astype(dtype)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


floats32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
floats64 = st.floats(allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(st.lists(floats32, min_size=1, max_size=40))
def test_float32_values_as_python_writes_them(values):
    text = padded([repr(float(v)) for v in values])
    assert same_bits(scan(text, "float32"), reference(text, "float32"))


@settings(max_examples=300, deadline=None)
@given(st.lists(floats32, min_size=1, max_size=40))
def test_float32_values_as_their_shortest_form(values):
    text = orjson.dumps(np.array(values * (ja.MIN_SPAN_BYTES // len(values) + 1), dtype=np.float32),
                        option=orjson.OPT_SERIALIZE_NUMPY).decode()
    assert same_bits(scan(text, "float32"), reference(text, "float32"))


@settings(max_examples=300, deadline=None)
@given(st.lists(floats64, min_size=1, max_size=40), st.sampled_from(["float32", "float16", "float64"]))
def test_any_double_into_every_float_width(values, dtype):
    text = padded([repr(v) for v in values])
    with np.errstate(over="ignore"):
        assert same_bits(scan(text, dtype), reference(text, dtype))


decimals = st.builds(
    lambda sign, whole, frac, exp: f"{sign}{whole}{'.' + frac if frac else ''}{exp}",
    st.sampled_from(["", "-"]),
    st.from_regex(r"0|[1-9][0-9]{0,24}", fullmatch=True),
    st.from_regex(r"[0-9]{0,25}", fullmatch=True),
    st.one_of(st.just(""), st.integers(-60, 60).map(lambda e: f"e{e}"), st.integers(-60, 60).map(lambda e: f"E{e:+d}")),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(decimals, min_size=1, max_size=20), st.sampled_from(["float32", "float16", "float64"]))
def test_written_decimals_round_as_the_exact_path_does(values, dtype):
    text = padded(values)
    with np.errstate(over="ignore"):
        assert same_bits(scan(text, dtype), reference(text, dtype))


def test_halfway_cases_fall_back_to_the_exact_path():
    # float32 halfway points between neighbours, written exactly and a hair either side
    f = np.float32(1.5)
    mid = (float(f) + float(np.nextafter(f, np.float32(2)))) / 2
    texts = [repr(mid), f"{mid:.25f}", "16777217", "16777217.000000000000000001", "16777216.99999999999999999"]
    text = padded(texts)
    assert same_bits(scan(text, "float32"), reference(text, "float32"))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=30))
def test_int64_exact(values):
    text = padded([str(v) for v in values])
    assert same_bits(scan(text, "int64"), np.array(json.loads(text), dtype=np.int64))


def test_uint64_full_range_and_its_errors():
    text = padded(["0", str(2**64 - 1), "7"])
    assert same_bits(scan(text, "uint64"), np.array(json.loads(text), dtype=np.uint64))
    for bad, message in [(str(2**64), "out of the 64-bit range"), ("-1", "out of the 64-bit range"),
                         ("1.5", "needs integers")]:
        with pytest.raises(ja.ArrayError, match=message):
            scan(padded(["1", bad]), "uint64")
    with pytest.raises(ja.ArrayError, match="out of the 64-bit range"):
        scan(padded(["1", str(2**63)]), "int64")


def test_nested_shapes_booleans_and_specials():
    grid = np.arange(2 * 3 * 50, dtype=np.float32).reshape(2, 3, 50) / 7
    got = scan(json.dumps(grid.tolist()), "float32")
    assert same_bits(got, grid)
    assert scan("[" + ",".join(["true", "false"] * 100) + "]", "bool").tolist() == [True, False] * 100
    special = scan(padded(["NaN", "Infinity", "-Infinity", "-0.0"]), "float32")
    assert np.isnan(special[0]) and special[1] == np.inf and special[2] == -np.inf
    assert special[3] == 0 and np.signbit(special[3])
    empty = scan("[" + ",".join(["[]"] * 100) + "]", "float32")
    assert empty.shape == (100, 0)


@pytest.mark.parametrize("text, dtype, message", [
    ("[" + ",".join(["[1,2]"] * 60) + ",[1]]", "float32", "non-ragged"),
    ("[" + ",".join(["[1,2]"] * 60) + ",3]", "float32", "non-ragged"),
    ("[3," + ",".join(["[1,2]"] * 60) + "]", "float32", "non-ragged"),
    ("[" + "1," * 200 + "]", "float32", "not a JSON array of numbers"),
    ("[" + "1," * 200 + "01]", "float32", "not a JSON array of numbers"),
    ("[" + "1," * 200 + "1.]", "float32", "not a JSON array of numbers"),
    ("[" + "1," * 200 + "-]", "float32", "not a JSON array of numbers"),
    ("[" + "1 " * 200 + "]", "float32", "not a JSON array of numbers"),
    ("[" + "1," * 200 + "tru]", "int32", "not a JSON array of numbers"),
    ("[" + "1," * 200 + "2.5]", "int32", "needs integers"),
    ("[" + "1," * 200 + "true]", "float32", "needs numbers, got booleans"),
    ("[" + "true," * 200 + "1]", "bool", "BOOL needs true/false"),
])
def test_bad_arrays_say_what_is_wrong(text, dtype, message):
    with pytest.raises(ja.ArrayError, match=message):
        scan(text, dtype)


def test_arrays_inside_strings_stay_strings():
    inner = "[" + ",".join(["1"] * 200) + "]"
    body = json.dumps({"s": inner, "t": 'x"\\' + inner, "data": json.loads(inner)}).encode()
    doc = ja.loads(body)
    assert doc["s"] == inner and doc["t"] == 'x"\\' + inner
    assert doc["data"].to_numpy(np.dtype(np.int32)).tolist() == [1] * 200


def test_oip_request_through_the_scanner_names_the_tensor_in_errors():
    specs = [TensorSpec("image", "float32", (-1, 100))]
    data = np.linspace(-1, 1, 100, dtype=np.float32)
    good = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 100], "data": data.tolist()}]})
    req = oip.decode_infer_request(good.encode(), None, specs, specs)
    assert same_bits(req.feeds["image"], data.reshape(1, 100))
    bad = good.replace("]}]}", ",[1]]}]}")
    with pytest.raises(BadRequest, match="input 'image': data is not a regular"):
        oip.decode_infer_request(bad.encode(), None, specs, specs)
    short = json.dumps({"inputs": [{"name": "image", "datatype": "FP32", "shape": [1, 100], "data": data[:99].tolist()}]})
    with pytest.raises(BadRequest, match=r"input 'image': shape \[1, 100\] needs 100 elements, data has 99"):
        oip.decode_infer_request(short.encode(), None, specs, specs)
