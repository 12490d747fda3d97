"""Large JSON tensors cut out of the body and read into float32 by the parallel scanner, against the
exact path (json + NumPy), value for value, split into parts or not, and every way the cut must
fall back to reading the body whole."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kubetrt.runtime.package import TensorSpec
from kubetrt.serving import json_arrays as ja
from kubetrt.serving import json_numbers as jn
from kubetrt.serving import oip
from kubetrt.serving.errors import BadRequest
from kubetrt.serving.tensors import array_from_json
from serving_support import json_decimals

pytestmark = pytest.mark.skipif(not jn.available(), reason="numba is off (KUBETRT_DISABLE_JIT): no scanner")


def long_text(values: list[str]) -> str:
    """The values repeated into an array whose text is long enough to be cut out."""
    one = ", ".join(values)
    return "[" + ", ".join([one] * (ja.TEXT_ARRAY_BYTES // (len(one) + 2) + 1)) + "]"


def body_of(text: str, **extra: object) -> bytes:
    shape = [text.count(",") + 1]
    head = json.dumps({"id": "r", **extra, "inputs": [{"name": "x", "datatype": "FP32", "shape": shape}]})
    return head[: -len("}]}")].encode() + b', "data": ' + text.encode() + b"}]}"


def data_of(body: bytes) -> object:
    return ja.loads_request(body)["inputs"][0]["data"]


def exact(text: str, dtype: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        return array_from_json(json.loads(text), np.dtype(dtype), "input 'x'").ravel()


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


numbers = st.one_of(st.floats(allow_nan=False, allow_infinity=False).map(repr),
                    st.floats(width=32, allow_nan=False, allow_infinity=False).map(repr), json_decimals)


@settings(max_examples=150, deadline=None)
@given(st.lists(numbers, min_size=1, max_size=40), st.sampled_from([1, 3]))
def test_float32_reads_as_the_exact_path_does(values, threads):
    """Every decimal form JSON allows: digits past 19, exponents past float32's range both ways,
    float32 subnormals, numbers next to a tie between two float32 values; in one part and in three."""
    text = long_text(values)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jn, "THREADS", threads)
        mp.setattr(jn, "PART_BYTES", 1024)
        mp.setattr(jn, "MAX_EXACT_FIXES", 1 << 20)
        data = data_of(body_of(text))
        assert isinstance(data, ja.TextArray)
        try:
            want = exact(text, "float32")
        except BadRequest as e:  # integers past 64 bits: refused alike
            assert "needs numbers" in e.message
            with pytest.raises(BadRequest, match="needs numbers"):
                array_from_json(data, np.dtype(np.float32), "input 'x'")
            return
        with np.errstate(over="ignore"):
            assert same(array_from_json(data, np.dtype(np.float32), "input 'x'"), want)


def test_ties_between_float32_values_go_to_the_exact_path():
    # 1 + 2**-24 lies halfway between two float32 values; the ones beside it are a float64 ulp off
    tie = 1 + 2.0**-24
    values = [repr(float(np.nextafter(tie, 0))), repr(tie), repr(float(np.nextafter(tie, 2))), "16777217",
              "3.4028234663852886e38",
              # 19 digits over an exact power of ten, within a float64 ulp of the tie: two roundings
              # (the digits, then the division) land on the other side of it
              "1.000000059604644890", "1.000000059604644904",
              # beside a tie between two float32 subnormals, where float32 keeps fewer bits
              "3503246160812042989e-63"]
    text = "[" + ", ".join(values) + "]"
    got = jn.read_float32(text.encode(), 1, len(text) - 1)
    assert got is not None and same(got, exact(text, "float32"))
    assert got[:3].tolist() == [1.0, 1.0, 1.0000001192092896] and got[3] == 16777216.0
    # so many numbers left to the exact path that the array is read the usual way, alike
    many = long_text(values)
    assert jn.read_float32(many.encode(), 1, len(many) - 1) is None
    assert same(array_from_json(data_of(body_of(many)), np.dtype(np.float32), "input 'x'"), exact(many, "float32"))


def test_parts_meet_at_commas_and_keep_their_order():
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    text = json.dumps(x.tolist())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jn, "THREADS", 4)
        assert len(jn._cut(text.encode(), 1, len(text) - 1, 4)) == 5
        got = jn.read_float32(text.encode(), 1, len(text) - 1)
    assert got is not None and same(got, x)


@pytest.mark.parametrize("dtype", ["float64", "float16", "int32", "int64"])
def test_other_dtypes_read_the_cut_array_through_simdjson(dtype):
    values = ["1", "-2", "300", "0"] if dtype.startswith("int") else ["0.1", "-2.5e-3", "1e4", "3.0000001"]
    text = long_text(values)
    data = data_of(body_of(text))
    assert isinstance(data, ja.TextArray)
    assert same(array_from_json(data, np.dtype(dtype), "input 'x'"), exact(text, dtype))


@pytest.mark.parametrize("values", [["NaN", "1"], ["1e400", "2"], ["true", "1"]])
def test_what_the_scanner_refuses_reads_as_before(values):
    text = long_text(values)
    data = data_of(body_of(text))
    assert isinstance(data, ja.TextArray) and jn.read_float32(text.encode(), 1, len(text) - 1) is None
    assert same(array_from_json(data, np.dtype(np.float32), "input 'x'"), exact(text, "float32"))


def test_a_malformed_cut_array_is_a_400_naming_the_json():
    specs = [TensorSpec("x", "float32", (-1,))]
    for bad in ("1.2.3", "1,", "--1", "1 2", "01", ".5"):
        text = long_text(["0.5", bad])
        with pytest.raises(BadRequest, match="malformed JSON in the request body"):
            oip.decode_infer_request(body_of(text), None, specs, specs)
    words = long_text(['"a"', '"b"'])
    with pytest.raises(BadRequest, match="input 'x': datatype FP32 needs numbers"):
        oip.decode_infer_request(body_of(words), None, specs, specs)


def test_the_cut_falls_back_to_the_whole_body_where_the_markers_do_not_land_on_inputs():
    text = long_text(["0.25", "-1.5"])
    want = exact(text, "float32")
    quoted = ja.loads_request(body_of(text, note='"data": [1, 2]', parameters={"name": "data"}))
    assert quoted["note"] == '"data": [1, 2]' and quoted["parameters"] == {"name": "data"}
    assert isinstance(quoted["inputs"][0]["data"], ja.TextArray)  # a quote inside a string is escaped: no match
    cases = {
        "an array under parameters": body_of(text, parameters={"data": [0.5] * (ja.TEXT_ARRAY_BYTES // 4)}),
        "nested rows": body_of("[" + text + "," + text + "]"),
    }
    for what, body in cases.items():
        doc = ja.loads_request(body)
        data = doc["inputs"][0]["data"]
        assert not isinstance(data, ja.TextArray), what
        assert same(array_from_json(data, np.dtype(np.float32), "input 'x'")[: want.size], want), what
    duplicate = body_of(text).replace(b', "data": ', b', "data": ' + text.encode() + b', "data": ', 1)
    assert not isinstance(ja.loads_request(duplicate)["inputs"][0]["data"], ja.TextArray)


def test_a_request_reads_alike_cut_or_whole():
    specs = [TensorSpec("a", "float32", (-1, 3)), TensorSpec("b", "float32", (-1, 3))]
    a = np.random.default_rng(1).standard_normal((20_000, 3)).astype(np.float32)
    doc = {"id": "7", "parameters": {"binary_data_output": False},
           "inputs": [{"name": n, "datatype": "FP32", "shape": list(a.shape), "data": (a * k).ravel().tolist()}
                      for k, n in enumerate("ab", 1)]}
    body = json.dumps(doc, indent=1).encode()  # a number a line
    assert all(isinstance(t["data"], ja.TextArray) for t in ja.loads_request(body)["inputs"])
    cut = oip.decode_infer_request(body, None, specs, specs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ja, "TEXT_ARRAY_BYTES", 1 << 40)
        assert isinstance(ja.loads_request(body)["inputs"][0]["data"], ja.LazyArray)
        whole = oip.decode_infer_request(body, None, specs, specs)
    assert cut.id == "7" and same(cut.feeds["a"], a) and same(cut.feeds["b"], (a * 2).astype(np.float32))
    assert all(same(cut.feeds[n], whole.feeds[n]) for n in "ab")


def test_strings_and_booleans_in_a_cut_array_read_as_before():
    for values, dtype in ((['"ab"', '"\\u00e9"'], "object"), (["true", "false"], "bool")):
        text = long_text(values)
        data = data_of(body_of(text))
        assert isinstance(data, ja.TextArray)
        got = array_from_json(data, np.dtype(dtype), "input 'x'")
        want = array_from_json(json.loads(text), np.dtype(dtype), "input 'x'")
        assert got.dtype == want.dtype and got.tolist() == want.tolist()


def test_a_scanner_that_fails_to_run_is_switched_off_and_json_reads_as_before(monkeypatch, caplog):
    jn.warm_up()
    assert jn.available()  # the working one stays on

    def broken(*args):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(jn, "_scan", broken)
    monkeypatch.setattr(jn._State, "usable", True)
    with caplog.at_level("WARNING", logger="kubetrt.serving"):
        jn.warm_up()
    assert not jn.available() and "JSON number scanner off" in caplog.text
    text = long_text(["0.25", "-1.5"])
    data = data_of(body_of(text))
    assert isinstance(data, ja.LazyArray)
    assert same(array_from_json(data, np.dtype(np.float32), "input 'x'"), exact(text, "float32"))
