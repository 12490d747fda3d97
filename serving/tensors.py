"""Tensor plumbing shared by the protocol codecs: datatype names and JSON-array -> ndarray.

Why its own module: both OIP and TF Serving turn nested JSON lists into typed arrays, and both
must reject (not silently cast) what does not fit: floats for an integer tensor, out-of-range
integers, ragged lists, strings for numbers.
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Sequence, TypeGuard

import numpy as np

from .errors import BadRequest
from .json_arrays import DeferredArray

# OIP datatype name <-> numpy dtype (BYTES <-> object arrays of bytes).
OIP_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}
NUMPY_TO_OIP: dict[str, str] = {str(v): k for k, v in OIP_TO_NUMPY.items()}
NUMPY_TO_OIP.update({"bytes": "BYTES", "str": "BYTES", "string": "BYTES"})


_OIP_OF_DTYPE: dict[np.dtype, str] = {v: k for k, v in OIP_TO_NUMPY.items()}  # str(dtype) costs more than the rest


def oip_datatype(dtype: str | np.dtype) -> str:
    """OIP name of a numpy dtype (as a TensorSpec spells it); string kinds map to BYTES."""
    known = _OIP_OF_DTYPE.get(dtype) if isinstance(dtype, np.dtype) else NUMPY_TO_OIP.get(dtype)
    if known is not None:
        return known
    name = str(dtype)
    if name in NUMPY_TO_OIP:
        return NUMPY_TO_OIP[name]
    d = np.dtype(dtype)
    if d.kind in "OSU":
        return "BYTES"
    if str(d) not in NUMPY_TO_OIP:
        raise ValueError(f"numpy dtype {d} has no Open Inference Protocol datatype")
    return NUMPY_TO_OIP[str(d)]


def is_bytes_dtype(dtype: str | np.dtype) -> bool:
    try:
        return np.dtype(dtype).kind in "OSU"
    except TypeError:
        return str(dtype) in ("bytes", "str", "string")


def is_count(value: Any) -> TypeGuard[int]:
    """A JSON value that is a non-negative integer (a size, an offset, a dimension): not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def element_count(shape: Sequence[int]) -> int:
    return math.prod(shape)


def array_from_json(data: Any, dtype: np.dtype, what: str) -> np.ndarray:
    """Nested or flat JSON list (or an array left in the body's text or parsed document) -> array
    of `dtype`; `what` names the tensor in errors."""
    arr = data.to_numpy(dtype) if isinstance(data, DeferredArray) else None
    if arr is None:
        if isinstance(data, DeferredArray):
            data = data.to_list()
        if dtype.kind == "O":
            return bytes_array_from_json(data, what)
        try:
            arr = np.asarray(data)
        except (ValueError, TypeError) as e:
            raise BadRequest(f"{what}: data is not a regular (non-ragged) array of numbers ({e})") from None
    kind = arr.dtype.kind
    if arr.size == 0:
        return arr.astype(dtype)
    if dtype.kind == "b":
        if kind != "b":
            raise BadRequest(f"{what}: datatype BOOL needs true/false values, got {_describe(arr)}")
        return arr
    if dtype.kind in "iu":
        if kind in "fO" and dtype == np.uint64:
            arr = _uint64(data, arr)  # ints above int64's range are inferred as float/object
            kind = arr.dtype.kind
        if kind not in "iub":
            raise BadRequest(f"{what}: datatype {oip_datatype(dtype)} needs integers, got {_describe(arr)}")
        info = np.iinfo(dtype)
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise BadRequest(
                f"{what}: value out of range for {oip_datatype(dtype)} ({info.min}..{info.max}): got {lo}..{hi}"
            )
        return arr.astype(dtype, copy=False)
    if dtype.kind == "f":
        if kind not in "iuf":
            raise BadRequest(f"{what}: datatype {oip_datatype(dtype)} needs numbers, got {_describe(arr)}")
        return arr.astype(dtype, copy=False)
    raise BadRequest(f"{what}: datatype {dtype} is not supported")


def bytes_array_from_json(data: Any, what: str) -> np.ndarray:
    flat = list(_flatten(data, what))
    out = np.empty(len(flat), dtype=object)
    for i, v in enumerate(flat):
        if isinstance(v, str):
            out[i] = v.encode()
        elif isinstance(v, dict) and set(v) == {"b64"} and isinstance(v["b64"], str):
            try:
                out[i] = base64.b64decode(v["b64"], validate=True)
            except binascii.Error as e:
                raise BadRequest(f"{what}: element {i} is not valid base64 ({e})") from None
        else:
            raise BadRequest(f"{what}: datatype BYTES needs strings, got {type(v).__name__} at element {i}")
    return out


def _flatten(data: Any, what: str, depth: int = 0):
    if depth > 32:
        raise BadRequest(f"{what}: data is nested too deeply")
    if isinstance(data, list):
        for v in data:
            yield from _flatten(v, what, depth + 1)
    else:
        yield data


def _describe(arr: np.ndarray) -> str:
    kind = arr.dtype.kind
    return {
        "b": "booleans",
        "i": "integers",
        "u": "integers",
        "f": "floating-point numbers",
        "U": "strings",
        "S": "strings",
        "O": "mixed or nested values",
    }.get(kind, str(arr.dtype))


def json_value(arr: np.ndarray) -> Any:
    """Array -> JSON-ready nested lists (bytes decoded as UTF-8)."""
    if arr.dtype.kind in "OS":
        return _decode_bytes(arr.tolist())
    return arr.tolist()


def _decode_bytes(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode_bytes(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", errors="replace")
    return v


def _uint64(data: Any, inferred: np.ndarray) -> np.ndarray:
    """Exact UINT64 values for JSON ints numpy could not infer as one integer type (rare path)."""
    try:
        objs = np.array(data, dtype=object)
    except (ValueError, TypeError):
        return inferred
    flat = objs.ravel()
    if not all(type(v) is int for v in flat):
        return inferred
    if any(v < 0 or v >= 2**64 for v in flat):
        return inferred  # reported as out of range / not integers by the caller
    return np.array(flat.tolist(), dtype=np.uint64).reshape(objs.shape)
