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
"""
from __future__ import annotations

from typing import Any

import json

import numpy as np
import orjson
import simdjson

LONG_ARRAY = 64  # shorter arrays (shapes, a few values) are as cheap as Python values
# bytes: a shorter request (a binary tensor's header, a few values) reads faster as Python values
# than through simdjson's parser, whose set-up costs more than its arrays save
SMALL_DOCUMENT = 2 << 10

_BUFFER_TYPES = {"d": np.dtype(np.float64), "i": np.dtype(np.int64), "u": np.dtype(np.uint64)}


class LazyArray:
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
    values below SMALL_DOCUMENT (loads_values), else long arrays as LazyArray (loads)."""
    return loads_values(body) if len(body) < SMALL_DOCUMENT else loads(body)


def _python(v: Any) -> Any:
    if isinstance(v, simdjson.Object):
        return {k: _python(v[k]) for k in v.keys()}
    if isinstance(v, simdjson.Array):
        # len() of a simdjson array is its stored element count, not a walk
        return LazyArray(v) if len(v) >= LONG_ARRAY else [_python(item) for item in v]
    return v
