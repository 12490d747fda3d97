"""JSON bodies with their long arrays left unparsed until a tensor's dtype is known, then read
straight into a NumPy buffer by simdjson, with no Python object per element.

Why: a JSON tensor of 150k floats made 150k Python floats before NumPy saw them, and that cost
many times the model. simdjson parses the body at C speed (SIMD), correctly rounded; the small
fields (names, shapes, parameters) become Python values, and every array of LONG_ARRAY or more
elements stays a LazyArray whose numbers `as_buffer` copies out as float64 / int64 / uint64 in
one pass (a compiled scanner of our own, which let go of the GIL, took 2-3x its CPU; on two cores
the CPU counts for more). Arrays simdjson cannot type that way (booleans, strings, mixed or
out-of-range values) take the old road, Python values and np.asarray, so their errors read as
before. Nested arrays come out flattened in order, as Triton reads them: the tensor's declared
shape, checked against the element count, gives them their shape. A request too short to hold
much (a binary tensor's header, a few values) is read by orjson as Python values instead: there
simdjson's parser costs more to set up than it saves.

A large body's long flat `data` arrays are not parsed with the rest: each is cut out of the text
(a marker string in its place), the small remainder parsed, and the array left as a TextArray,
which json_numbers reads into float32 on every core once the tensor's dtype says float32 (other
dtypes, and text the scanner refuses, go through simdjson as above, and a malformed array raises
MalformedJSON then). Where the markers do not all come back as some input's `data` (an array
under `parameters`, a key given twice), the body is parsed whole as before.
"""
from __future__ import annotations

import json
import secrets
from typing import Any

import numpy as np
import orjson
import simdjson

from . import json_numbers

LONG_ARRAY = 64  # shorter arrays (shapes, a few values) are as cheap as Python values
# bytes: a shorter request (a binary tensor's header, a few values) reads faster as Python values
# than through simdjson's parser, whose set-up costs more than its arrays save
SMALL_DOCUMENT = 2 << 10
TEXT_ARRAY_BYTES = 64 << 10  # an array's text from this long on is cut out of the body and read by json_numbers
# A cut array's place holder, a JSON string that starts with NUL (escaped): no client writes it by chance
_MARKER = "kubetrt-" + secrets.token_hex(8) + "-"

_BUFFER_TYPES = {"d": np.dtype(np.float64), "i": np.dtype(np.int64), "u": np.dtype(np.uint64)}


class MalformedJSON(ValueError):
    """A TextArray's text is not a JSON array (json's message)."""


class DeferredArray:
    """A JSON array whose values are read once the tensor's dtype is known."""

    __slots__ = ()

    def to_list(self) -> list[Any]:
        raise NotImplementedError

    def to_numpy(self, dtype: np.dtype) -> np.ndarray | None:
        raise NotImplementedError


class LazyArray(DeferredArray):
    """A JSON array still in simdjson's parsed document; valid while that document lives."""

    __slots__ = ("_array",)

    def __init__(self, array: Any) -> None:
        self._array = array

    def to_list(self) -> list[Any]:
        return list(self._array.as_list())

    def to_numpy(self, dtype: np.dtype) -> np.ndarray | None:
        """The values as a flat array: float64 for a float dtype, int64/uint64 for an integer one;
        None where simdjson cannot type them so (the caller reads to_list() instead)."""
        kind = "d" if dtype.kind == "f" else "u" if dtype == np.uint64 else "i" if dtype.kind in "iu" else None
        if kind is None:
            return None
        try:
            return np.frombuffer(self._array.as_buffer(of_type=kind), dtype=_BUFFER_TYPES[kind])
        except (TypeError, ValueError):  # a boolean, string, null or out-of-range number among them
            return None


class TextArray(DeferredArray):
    """A flat JSON array still text: body[start:end] is its inside, between the brackets."""

    __slots__ = ("_body", "_start", "_end", "_value")

    def __init__(self, body: bytes, start: int, end: int) -> None:
        self._body, self._start, self._end = body, start, end
        self._value: LazyArray | list[Any] | None = None

    def to_list(self) -> list[Any]:
        parsed = self._parsed()
        return parsed.to_list() if isinstance(parsed, LazyArray) else parsed

    def to_numpy(self, dtype: np.dtype) -> np.ndarray | None:
        if dtype == np.float32:
            arr = json_numbers.read_float32(self._body, self._start, self._end)
            if arr is not None:
                return arr
        parsed = self._parsed()
        return parsed.to_numpy(dtype) if isinstance(parsed, LazyArray) else None

    def _parsed(self) -> LazyArray | list[Any]:
        """The array read the usual way, once (a BYTES or BOOL tensor asks for values, then a list)."""
        if self._value is None:
            try:
                value = loads(self._body[self._start - 1 : self._end + 1])
            except ValueError as e:
                raise MalformedJSON(f"{e} (in a data array at byte {self._start - 1})") from None
            if not isinstance(value, (LazyArray, list)):
                raise MalformedJSON(f"not an array at byte {self._start - 1}")
            self._value = value
        return self._value


def loads_values(body: bytes | bytearray | memoryview) -> Any:
    """The whole JSON document as Python values: orjson, and Python's json where orjson refuses what
    json reads (NaN, 1e400, integers past 64 bits); ValueError (json's message) when malformed."""
    data = bytes(body) if not isinstance(body, bytes) else body
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def loads(body: bytes | bytearray | memoryview) -> Any:
    """The JSON document, long arrays as LazyArray; ValueError (json's message) when malformed."""
    data = bytes(body) if not isinstance(body, bytes) else body
    try:
        return _python(simdjson.Parser().parse(data))
    except (ValueError, RuntimeError, KeyError):
        # Malformed, or what simdjson will not read and Python's json does (NaN, 1e400, integers past
        # 64 bits, a key holding a NUL): json reads it as before, or says what is wrong.
        return json.loads(data)


def loads_request(body: bytes | bytearray | memoryview) -> Any:
    """An inference request's JSON (a whole body, or the header before binary tensors): Python
    values below SMALL_DOCUMENT (loads_values), else long arrays as LazyArray (loads), and long
    flat `data` arrays of inputs as TextArray where json_numbers can read them."""
    if len(body) < SMALL_DOCUMENT:
        return loads_values(body)
    data = bytes(body) if not isinstance(body, bytes) else body
    if len(data) >= TEXT_ARRAY_BYTES and json_numbers.available():
        doc = _loads_cut(data)
        if doc is not None:
            return doc
    return loads(data)


def _loads_cut(body: bytes) -> Any | None:
    """The document with its long flat `data` arrays as TextArray; None where there are none, or
    the cut document does not hold them where an input's data goes."""
    pieces: list[bytes] = []
    arrays: dict[str, TextArray] = {}
    done = 0
    at = body.find(b'"data"')
    while at >= 0:
        i = _skip_space(body, at + 6)
        if body[i : i + 1] == b":":
            i = _skip_space(body, i + 1)
            close = body.find(b"]", i) if body[i : i + 1] == b"[" else -1
            if close - i >= TEXT_ARRAY_BYTES and body.find(b"[", i + 1, close) < 0:
                marker = f"{_MARKER}{len(arrays)}"
                arrays["\0" + marker] = TextArray(body, i + 1, close)
                pieces += [body[done:i], b'"\\u0000', marker.encode(), b'"']
                done = close + 1
                at = close
        at = body.find(b'"data"', at + 1)
    if not arrays:
        return None
    pieces.append(body[done:])
    rest = b"".join(pieces)
    try:
        doc = loads_values(rest) if len(rest) < SMALL_DOCUMENT else loads(rest)
    except ValueError:
        return None  # say what is wrong from the whole body
    inputs = doc.get("inputs") if isinstance(doc, dict) else None
    placed = 0
    for t in inputs if isinstance(inputs, list) else ():
        if isinstance(t, dict) and isinstance(t.get("data"), str) and t["data"] in arrays:
            t["data"] = arrays[t["data"]]
            placed += 1
    return doc if placed == len(arrays) else None


def _skip_space(body: bytes, i: int) -> int:
    while i < len(body) and body[i] in b" \t\r\n":
        i += 1
    return i


def _python(v: Any) -> Any:
    if isinstance(v, simdjson.Object):
        return {k: _python(v[k]) for k in v.keys()}
    if isinstance(v, simdjson.Array):
        # len() of a simdjson array is its stored element count, not a walk; a few long rows are
        # one tensor too, read flattened like a long array
        n = len(v)
        if n >= LONG_ARRAY or (n and isinstance(v[0], simdjson.Array)):
            return LazyArray(v)
        return [_python(item) for item in v]
    return v
