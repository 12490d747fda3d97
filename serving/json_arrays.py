"""JSON number arrays straight into NumPy buffers, with no Python object per element.

Why: a JSON tensor of 150k floats made 150k Python floats before NumPy saw them, and that cost
many times the model. Here a compiled scan (numba, GIL released) finds the large arrays of
numbers in a body; the rest (names, shapes, parameters) is a small document for orjson; each
array is then parsed by a second compiled pass into the tensor's own dtype on demand.

Rounding is exact: an integer is taken digit by digit with overflow checks; a decimal becomes
the double nearest to it where that double is exact (Clinger's fast path) or within a few ulps
of it, and is rounded to float32/float16 only where that error cannot change the result (it is
not near a halfway point). Every other number (a 17-digit float64, an exponent past 1e±44, a
double-rounding tie) sends its array down the slow path: orjson and NumPy, as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import orjson

from kubetrt.runtime.kernels import jit

MIN_SPAN_BYTES = 256  # smaller arrays (shapes, short tensors) stay in the document: orjson is as fast there
MAX_SPANS = 64  # arrays past this many in one body stay in the document too (still correct, just slower)
MAX_DEPTH = 32  # as oip.MAX_RANK
MARKER_KEY = "\x00kubetrt-array"  # a JSON key no client writes; stands where a span was cut out

# parse modes and the targets' float formats: (significand bits, exponent of the smallest spacing, largest exponent)
FLOAT, INT64, UINT64, BOOL = 0, 1, 2, 3
FLOAT_FORMATS = {"float32": (24, -149, 127), "float16": (11, -24, 15), "float64": (53, -1074, 1023)}

# parse results
OK, HARD, MALFORMED, RAGGED, NOT_INTEGER, NOT_BOOL, BOOL_AS_NUMBER, OVERFLOW, TOO_DEEP = range(9)


class ArrayError(ValueError):
    """A number array that is not what its tensor needs; the message names what was wrong."""


@dataclass(frozen=True)
class NumberArray:
    """A JSON array of numbers left as bytes in the body, parsed only into its tensor's dtype."""

    body: np.ndarray  # uint8 view of the whole body
    start: int
    end: int

    def text(self) -> bytes:
        return self.body[self.start : self.end].tobytes()

    def to_numpy(self, dtype: np.dtype) -> np.ndarray:
        """-> flat-or-nested array of `dtype` (shape from the nesting); ArrayError when it does not fit."""
        return parse_array(self, dtype)


def loads(body: bytes | bytearray | memoryview) -> Any:
    """The JSON document, its large number arrays as NumberArray; ValueError when malformed."""
    buf = np.frombuffer(body, dtype=np.uint8)
    if not _COMPILED or len(buf) < MIN_SPAN_BYTES:
        return orjson.loads(bytes(body) if isinstance(body, memoryview) else body)
    spans = np.empty((MAX_SPANS, 2), dtype=np.int64)
    count = _find_spans(buf, MIN_SPAN_BYTES, spans)
    if count == 0:
        return orjson.loads(bytes(body) if isinstance(body, memoryview) else body)
    pieces, at = [], 0
    for k in range(count):
        s, e = int(spans[k, 0]), int(spans[k, 1])
        pieces.append(buf[at:s].tobytes())
        pieces.append(orjson.dumps({MARKER_KEY: k}))
        at = e
    pieces.append(buf[at:].tobytes())
    doc = orjson.loads(b"".join(pieces))
    arrays = [NumberArray(buf, int(spans[k, 0]), int(spans[k, 1])) for k in range(count)]
    return _put_back(doc, arrays)


def _put_back(v: Any, arrays: list[NumberArray]) -> Any:
    if type(v) is dict:
        if len(v) == 1 and MARKER_KEY in v:
            k = v[MARKER_KEY]
            return arrays[k] if type(k) is int and 0 <= k < len(arrays) else v
        for key, item in v.items():
            if type(item) is dict or type(item) is list:
                v[key] = _put_back(item, arrays)
    elif type(v) is list:
        for i, item in enumerate(v):
            if type(item) is dict or type(item) is list:
                v[i] = _put_back(item, arrays)
    return v


def parse_array(arr: NumberArray, dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        mode, out_dtype = BOOL, np.dtype(np.bool_)
    elif dtype.kind == "u" and dtype.itemsize == 8:
        mode, out_dtype = UINT64, np.dtype(np.uint64)
    elif dtype.kind in "iu":
        mode, out_dtype = INT64, np.dtype(np.int64)
    elif dtype.kind == "f" and dtype.name in FLOAT_FORMATS:
        mode = FLOAT
        out_dtype = np.dtype(np.float32) if dtype == np.float32 else np.dtype(np.float64)
    else:
        raise ArrayError(f"datatype {dtype} has no JSON number form")
    if not _COMPILED:
        return _slow(arr, out_dtype, dtype)
    bits, min_exp, max_exp = FLOAT_FORMATS.get(dtype.name, (53, -1074, 1023))
    out = np.empty((arr.end - arr.start + 1) // 2, dtype=out_dtype)
    dims = np.zeros(MAX_DEPTH + 2, dtype=np.int64)
    status = np.zeros(3, dtype=np.int64)
    count = _parse(arr.body, arr.start, arr.end, out, mode, bits, min_exp, max_exp, dims, status)
    code, pos, ndim = int(status[0]), int(status[1]), int(status[2])
    if code == HARD:
        return _slow(arr, out_dtype, dtype)
    if code != OK:
        raise ArrayError(_message(code, pos - arr.start, dtype))
    shape = tuple(int(d) for d in dims[1 : ndim + 1])
    flat = out[:count]
    if dtype == np.float16:
        flat = flat.astype(np.float16)  # exact: the values are already on float16's grid
    elif count * 4 < len(out):  # most of the upper bound unused: do not pin it
        flat = flat.copy()
    return flat.reshape(shape)


def _slow(arr: NumberArray, out_dtype: np.dtype, dtype: np.dtype) -> np.ndarray:
    """orjson and NumPy: exact for every number, a Python object per element."""
    try:
        value = orjson.loads(arr.text())
    except orjson.JSONDecodeError as e:
        raise ArrayError(f"malformed number array: {e}") from None
    try:
        result = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ArrayError(f"data is not a regular (non-ragged) array of numbers ({e})") from None
    if out_dtype.kind == "f":
        if result.dtype.kind == "b":
            raise ArrayError(_message(BOOL_AS_NUMBER, 0, out_dtype))
        if result.dtype.kind not in "iuf":
            raise ArrayError(f"data holds values other than numbers ({result.dtype})")
        return result.astype(dtype)
    if out_dtype.kind == "b":
        if result.dtype.kind != "b":
            raise ArrayError(_message(NOT_BOOL, 0, out_dtype))
        return result
    if result.dtype.kind == "f":
        raise ArrayError(_message(NOT_INTEGER, 0, out_dtype))
    if result.dtype.kind not in "iub":
        raise ArrayError(_message(OVERFLOW, 0, out_dtype))
    return result.astype(out_dtype)


def _message(code: int, pos: int, dtype: np.dtype) -> str:
    at = f" (at byte {pos} of the array)"
    return {
        MALFORMED: "data is not a JSON array of numbers" + at,
        RAGGED: "data is not a regular (non-ragged) array of numbers" + at,
        NOT_INTEGER: f"datatype {dtype} needs integers, got floating-point numbers" + at,
        NOT_BOOL: "datatype BOOL needs true/false values, got numbers" + at,
        BOOL_AS_NUMBER: f"datatype {dtype} needs numbers, got booleans" + at,
        OVERFLOW: "an integer is out of the 64-bit range" + at,
        TOO_DEEP: f"data is nested more than {MAX_DEPTH} deep",
    }.get(code, f"unreadable number array (code {code})")


_COMPILED = jit.AVAILABLE
if _COMPILED:
    _POW10 = np.array([10.0 ** k for k in range(23)], dtype=np.float64)
    # bytes a number array may hold besides brackets: digits, signs, '.', ',', whitespace and the
    # letters of true, false, NaN and Infinity
    _NUMBERISH = np.zeros(256, dtype=np.bool_)
    for _c in b"0123456789,-+.eE \n\r\ttrufalsNIniy":
        _NUMBERISH[_c] = True

    @jit.njit(cache=True, nogil=True)
    def _numeric_extent(b, i, n):  # pragma: no cover - compiled
        # End of the array opening at b[i] if only number-ish bytes and brackets follow up to its
        # close; -1 at the first string, object or other byte. Loose: _parse is the strict one.
        depth = 0
        j = i
        while j < n:
            c = b[j]
            if c == 91:
                depth += 1
                if depth > MAX_DEPTH + 1:
                    return -1
            elif c == 93:
                depth -= 1
                if depth == 0:
                    return j + 1
            elif not _NUMBERISH[c]:
                return -1
            j += 1
        return -1

    @jit.njit(cache=True, nogil=True)
    def _find_spans(b, min_bytes, spans):  # pragma: no cover - compiled
        n = b.shape[0]
        i = 0
        k = 0
        in_string = False
        while i < n:
            c = b[i]
            if in_string:
                if c == 92:
                    i += 2
                    continue
                if c == 34:
                    in_string = False
                i += 1
                continue
            if c == 34:
                in_string = True
            elif c == 91 and k < spans.shape[0]:
                end = _numeric_extent(b, i, n)
                if end > 0:
                    if end - i >= min_bytes:
                        spans[k, 0] = i
                        spans[k, 1] = end
                        k += 1
                    i = end
                    continue
            i += 1
        return k

    @jit.njit(cache=True, nogil=True)
    def _word(b, j, end, w0, w1, w2, w3, w4, w5, w6, w7, length):  # pragma: no cover - compiled
        # Whether b[j:j+length] spells the word whose bytes are w0..w7 (unused ones ignored).
        if j + length > end:
            return False
        ws = (w0, w1, w2, w3, w4, w5, w6, w7)
        for t in range(length):
            if b[j + t] != ws[t]:
                return False
        return True

    @jit.njit(cache=True, nogil=True)
    def _round_float(d, exact, bits, min_exp, max_exp):  # pragma: no cover - compiled
        # d (> 0, within 1 ulp of the decimal if exact, else within 4) rounded to `bits`
        # significant bits; -1.0 where that error might have decided the rounding.
        if bits == 53:
            return d if exact else -1.0
        if bits == 24:  # float32: the hardware rounds; both ends of d's error bound must agree
            tol = d * 1.7763568394002505e-15  # 2**-49, over 4 ulps of d
            lo = np.float32(d - tol)
            if lo != np.float32(d + tol):
                return -1.0
            return float(lo)
        m, e = math.frexp(d)
        se = max(e - bits, min_exp)
        q = math.ldexp(d, -se)
        fl = math.floor(q)
        tol = math.ldexp(4.0, e - 53 - se)
        if abs((q - fl) - 0.5) <= tol:
            return -1.0
        r = math.ldexp(fl + 1.0 if q - fl > 0.5 else fl, se)
        if r >= math.ldexp(1.0, max_exp + 1):
            return math.inf
        return r

    @jit.njit(cache=True, nogil=True)
    def _significand(b, j, end):  # pragma: no cover - compiled
        # (first 18 significant digits, decimal exponent, whether a nonzero digit was dropped) of
        # the digits and '.' in b[j:end]
        mant = 0
        nd = 0
        exp10 = 0
        cut = False
        frac = False
        while j < end:
            c = b[j]
            j += 1
            if c == 46:
                frac = True
                continue
            dg = c - 48
            if nd < 18:
                mant = mant * 10 + dg
                if frac:
                    exp10 -= 1
                if mant != 0:
                    nd += 1
            else:
                if not frac:
                    exp10 += 1
                cut = cut or dg != 0
        return mant, exp10, cut

    @jit.njit(cache=True, nogil=True)
    def _parse(b, start, end, out, mode, bits, min_exp, max_exp, dims, status):  # pragma: no cover - compiled
        # One JSON array of numbers (nested regularly) into out; dims[1..] its shape, status
        # (code, byte position, rank). States: 0 after '[', 1 after ',', 2 after a value.
        counts = np.zeros(MAX_DEPTH + 2, dtype=np.int64)
        for d in range(dims.shape[0]):
            dims[d] = -1
        leaf = -1
        depth = 0
        deepest = 0
        state = 1
        k = 0
        j = start
        while j < end:
            c = b[j]
            if c == 32 or c == 10 or c == 13 or c == 9:
                j += 1
                continue
            if c == 91:  # [
                if state == 2:
                    status[0] = MALFORMED
                    status[1] = j
                    return k
                if depth > 0:
                    counts[depth] += 1
                depth += 1
                if depth > MAX_DEPTH:
                    status[0] = TOO_DEEP
                    status[1] = j
                    return k
                if leaf != -1 and depth > leaf:
                    status[0] = RAGGED
                    status[1] = j
                    return k
                if depth > deepest:
                    deepest = depth
                counts[depth] = 0
                state = 0
                j += 1
                continue
            if c == 93:  # ]
                if state == 1 or depth == 0:
                    status[0] = MALFORMED
                    status[1] = j
                    return k
                if dims[depth] == -1:
                    dims[depth] = counts[depth]
                elif dims[depth] != counts[depth]:
                    status[0] = RAGGED
                    status[1] = j
                    return k
                depth -= 1
                state = 2
                j += 1
                if depth == 0:
                    break
                continue
            if c == 44:  # ,
                if state != 2:
                    status[0] = MALFORMED
                    status[1] = j
                    return k
                state = 1
                j += 1
                continue
            # a value: a scalar at this depth
            if state == 2 or depth == 0:
                status[0] = MALFORMED
                status[1] = j
                return k
            if leaf == -1:
                if depth < deepest or dims[depth + 1] != -1:
                    status[0] = RAGGED
                    status[1] = j
                    return k
                leaf = depth
            elif leaf != depth:
                status[0] = RAGGED
                status[1] = j
                return k
            counts[depth] += 1
            state = 2
            at = j
            if c == 116 or c == 102:  # true / false
                if c == 116 and _word(b, j, end, 116, 114, 117, 101, 0, 0, 0, 0, 4):
                    v = 1
                    j += 4
                elif c == 102 and _word(b, j, end, 102, 97, 108, 115, 101, 0, 0, 0, 5):
                    v = 0
                    j += 5
                else:
                    status[0] = MALFORMED
                    status[1] = at
                    return k
                if mode == FLOAT:
                    status[0] = BOOL_AS_NUMBER
                    status[1] = at
                    return k
                out[k] = v
                k += 1
                continue
            if mode == BOOL:
                status[0] = NOT_BOOL if (c == 45 or 48 <= c <= 57) else MALFORMED
                status[1] = at
                return k
            neg = False
            if c == 45:
                neg = True
                j += 1
            if j < end and (b[j] == 78 or b[j] == 73):  # NaN / Infinity (Python's json writes them)
                if mode != FLOAT:
                    status[0] = NOT_INTEGER
                    status[1] = at
                    return k
                if not neg and _word(b, j, end, 78, 97, 78, 0, 0, 0, 0, 0, 3):
                    out[k] = math.nan
                    j += 3
                elif _word(b, j, end, 73, 110, 102, 105, 110, 105, 116, 121, 8):
                    out[k] = -math.inf if neg else math.inf
                    j += 8
                else:
                    status[0] = MALFORMED
                    status[1] = at
                    return k
                k += 1
                continue
            if j >= end or not (48 <= b[j] <= 57):
                status[0] = MALFORMED
                status[1] = at
                return k
            if b[j] == 48 and j + 1 < end and 48 <= b[j + 1] <= 57:  # JSON has no leading zeros
                status[0] = MALFORMED
                status[1] = at
                return k
            if mode != FLOAT:
                acc = np.uint64(0)
                over = False
                while j < end and 48 <= b[j] <= 57:
                    dg = np.uint64(b[j] - 48)
                    if acc > (np.uint64(18446744073709551615) - dg) // np.uint64(10):
                        over = True
                    else:
                        acc = acc * np.uint64(10) + dg
                    j += 1
                if j < end and (b[j] == 46 or b[j] == 101 or b[j] == 69):
                    status[0] = NOT_INTEGER
                    status[1] = at
                    return k
                if mode == UINT64:
                    if over or (neg and acc != 0):
                        status[0] = OVERFLOW
                        status[1] = at
                        return k
                    out[k] = acc
                else:
                    if over or (not neg and acc > np.uint64(9223372036854775807)) or (
                            neg and acc > np.uint64(9223372036854775808)):
                        status[0] = OVERFLOW
                        status[1] = at
                        return k
                    if neg:
                        out[k] = -np.int64(acc - np.uint64(1)) - 1
                    else:
                        out[k] = np.int64(acc)
                k += 1
                continue
            digits_at = j
            mant = 0
            while j < end and 48 <= b[j] <= 57:
                mant = mant * 10 + (b[j] - 48)
                j += 1
            n_digits = j - digits_at
            exp10 = 0
            if j < end and b[j] == 46:
                j += 1
                frac_at = j
                while j < end and 48 <= b[j] <= 57:
                    mant = mant * 10 + (b[j] - 48)
                    j += 1
                if j == frac_at:
                    status[0] = MALFORMED
                    status[1] = at
                    return k
                exp10 = frac_at - j
                n_digits += j - frac_at
            cut = False
            if n_digits > 18:  # the fast loop may have overflowed: again, keeping 18 significant digits
                mant, exp10, cut = _significand(b, digits_at, j)
            if j < end and (b[j] == 101 or b[j] == 69):
                j += 1
                eneg = False
                if j < end and (b[j] == 43 or b[j] == 45):
                    eneg = b[j] == 45
                    j += 1
                if j >= end or not (48 <= b[j] <= 57):
                    status[0] = MALFORMED
                    status[1] = at
                    return k
                ev = 0
                while j < end and 48 <= b[j] <= 57:
                    if ev < 100000:
                        ev = ev * 10 + (b[j] - 48)
                    j += 1
                exp10 += -ev if eneg else ev
            if mant == 0:
                r = 0.0
                if j == digits_at + n_digits:  # "-0" is the integer 0, as json reads it, not -0.0
                    neg = False
            else:
                exact = (not cut) and mant < 9007199254740992 and -22 <= exp10 <= 22
                m = float(mant)
                if 0 <= exp10 <= 22:
                    d = m * _POW10[exp10]
                elif -22 <= exp10 < 0:
                    d = m / _POW10[-exp10]
                elif 22 < exp10 <= 44:
                    d = m * _POW10[22] * _POW10[exp10 - 22]
                elif -44 <= exp10 < -22:
                    d = m / _POW10[22] / _POW10[-exp10 - 22]
                else:
                    d = -1.0
                if d < 2.2250738585072014e-308 or d > 1.7e308:  # out of the wide range, or subnormal
                    r = -1.0
                else:
                    r = _round_float(d, exact, bits, min_exp, max_exp)
                if r < 0.0:
                    status[0] = HARD
                    status[1] = at
                    return k
            out[k] = -r if neg else r
            k += 1
        if depth != 0:
            status[0] = MALFORMED
            status[1] = j
            return k
        while j < end:  # only whitespace may follow the close
            c = b[j]
            if not (c == 32 or c == 10 or c == 13 or c == 9):
                status[0] = MALFORMED
                status[1] = j
                return k
            j += 1
        status[0] = OK
        status[2] = leaf if leaf != -1 else deepest
        return k
