"""A long JSON array of numbers read straight into float32, split across the cores.

Why: simdjson reads a large JSON tensor at C speed but on one thread, holding the GIL, and
parsing decimal text is most of a large JSON request's cost. This scanner lets go of the GIL, so
the text is cut at commas into one part per core and the parts are read at once.

Exactness: a number whose digits fit 2^53 and whose power of ten is exact (|e| <= 22) becomes the
correctly rounded float64 (one rounding), then float32, as float(text) then a cast would do. Any
other number is computed with a few float64 roundings; it is kept only where it lies far from the
middle between two float32 values (and in float32's normal range), where those few roundings
cannot change the float32 it rounds to. The rest, and numbers of more than 19 significant digits,
are left to Python's float(): the same float32 the exact path makes, always.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kubetrt.runtime.kernels import jit
from kubetrt.runtime.kernels.parallel import THREADS, split_range
from kubetrt.telemetry.logs import log

logger = logging.getLogger("kubetrt.serving")

PART_BYTES = 128 << 10  # a part this large pays for handing it to another thread
MAX_EXACT_FIXES = 256  # numbers per part left to float(); past this the caller reads the slow way
_POW10 = np.array([float(10**k) for k in range(309)])  # each correctly rounded

if jit.AVAILABLE:
    from llvmlite import ir
    from numba.core import types
    from numba.cpython.unsafe.numbers import trailing_zeros
    from numba.extending import intrinsic

    _np = np
    _POW10_INT = np.array([10**k for k in range(9)], dtype=np.uint64)

    def _loader(bits: int, result: types.Type) -> Any:
        """An intrinsic reading `bits` at byte offset i of a byte array, with none of the negative
        index handling numba puts on buf[i] (which keeps a byte loop from running at memory speed);
        callers keep i in bounds."""
        @intrinsic
        def load(typingctx, buf, i):  # pragma: no cover - compiled
            def codegen(context, builder, signature, args):
                data = context.make_array(signature.args[0])(context, builder, args[0]).data
                at = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(bits).as_pointer())
                return builder.load(at, align=1)
            return result(buf, i), codegen
        return load

    _byte = _loader(8, types.uint8)
    _load8 = _loader(64, types.uint64)  # buf[i:i+8] as one little-endian uint64

    @jit.njit(cache=True, nogil=True, boundscheck=False, inline="always")
    def _digits(buf, i, end, w):  # pragma: no cover - compiled
        """(w with the digits from i appended, the offset after them): eight bytes at a time, the
        run's length from the first byte that is no digit, its value in three multiplications."""
        lanes = _np.uint64(0x0101010101010101)
        while i + 8 <= end:
            x = _load8(buf, i) ^ (lanes * _np.uint64(0x30))  # digits become 0-9
            other = (((x & (lanes * _np.uint64(0x7F))) + lanes * _np.uint64(0x76)) | x) & (lanes * _np.uint64(0x80))
            n = 8 if other == 0 else _np.int64(trailing_zeros(other)) >> 3
            if n == 0:
                return w, i
            d = x << _np.uint64(8 * (8 - n))  # the n digits last, zeros before them
            d = d * _np.uint64(10) + (d >> _np.uint64(8))
            m = _np.uint64(0x000000FF000000FF)
            d = ((d & m) * _np.uint64(100 + (1000000 << 32)) + ((d >> _np.uint64(16)) & m) * _np.uint64(1 + (10000 << 32))) >> _np.uint64(32)
            w = w * _POW10_INT[n] + d
            i += n
            if n < 8:
                return w, i
        while i < end:
            c = _np.uint64(_byte(buf, i)) - _np.uint64(48)
            if c > 9:
                break
            w = w * _np.uint64(10) + c
            i += 1
        return w, i

    _MORE, _DONE, _BAD = 0, 1, 2

    @jit.njit(cache=True, nogil=True, boundscheck=False, inline="always")
    def _skip_space(buf, i, end):  # pragma: no cover - compiled
        """The offset of the first byte from i that is not JSON whitespace (or end)."""
        while i < end and (_byte(buf, i) == 32 or _byte(buf, i) == 10 or _byte(buf, i) == 13 or _byte(buf, i) == 9):
            i += 1
        return i

    @jit.njit(cache=True, nogil=True, boundscheck=False, inline="always", _nrt=False)
    def _step(buf, i, end, out, n, fixes, nfix):  # pragma: no cover - compiled
        """Reads the number at i (whitespace around) into out[n] and the comma after it: (offset
        after, n + 1, fixes, _MORE, or _DONE at `end`), or (offset of the fault, n, nfix, _BAD)."""
        i = _skip_space(buf, i, end)
        if i >= end or n >= out.shape[0]:
            return i, n, nfix, _BAD
        first = i
        neg = _byte(buf, i) == 45
        if neg:
            i += 1
        d0 = i
        w, i = _digits(buf, i, end, _np.uint64(0))
        digits = i - d0
        if digits == 0 or (digits > 1 and _byte(buf, d0) == 48):
            return d0, n, nfix, _BAD
        if digits > 15 and (i >= end or (_byte(buf, i) != 46 and _byte(buf, i) != 101 and _byte(buf, i) != 69)):
            return first, n, nfix, _BAD  # an integer past float64's exact ones: NumPy reads it as int64, or refuses it
        e = 0
        if i < end and _byte(buf, i) == 46:
            i += 1
            f0 = i
            w, i = _digits(buf, i, end, w)
            if i == f0:
                return i, n, nfix, _BAD
            e = f0 - i
            digits += i - f0
        if i < end and (_byte(buf, i) == 101 or _byte(buf, i) == 69):
            i += 1
            eneg = False
            if i < end and (_byte(buf, i) == 43 or _byte(buf, i) == 45):
                eneg = _byte(buf, i) == 45
                i += 1
            e0 = i
            x = 0
            while i < end and 48 <= _byte(buf, i) <= 57:
                if x < 100000:
                    x = x * 10 + (_byte(buf, i) - 48)
                i += 1
            if i == e0:
                return i, n, nfix, _BAD
            e += -x if eneg else x
        exact = True
        if digits > 19:  # leading zeros leave w at 0: only the significant digits count
            significant = 0
            for k in range(d0, i):
                b = _byte(buf, k)
                if 48 <= b <= 57 and (significant > 0 or b != 48):
                    significant += 1
                elif b == 101 or b == 69:
                    break
            exact = significant <= 19
        v = 0.0
        if exact and w != 0:
            if -300 <= e <= 300:
                v = float(w) * _POW10[e] if e >= 0 else float(w) / _POW10[-e]
                if w > _np.uint64(9007199254740992) or not -22 <= e <= 22:  # more than one rounding
                    a = abs(v)
                    low = _np.int64(_np.float64(a).view(_np.uint64) & _np.uint64(0x1FFFFFFF)) - 0x10000000
                    near_a_tie = -4096 < low < 4096
                    exact = not (near_a_tie or a < 1.2e-38 or a > 3.4e38)
            else:
                exact = False
        if exact:
            out[n] = -v if neg else v
        else:
            out[n] = 0.0
            if nfix < fixes.shape[0]:
                fixes[nfix, 0] = n
                fixes[nfix, 1] = first
                fixes[nfix, 2] = i
            nfix += 1
        i = _skip_space(buf, i, end)
        if i >= end:
            return i, n + 1, nfix, _DONE
        if _byte(buf, i) != 44:
            return i, n, nfix, _BAD
        return i + 1, n + 1, nfix, _MORE

    @jit.njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
    def _scan(buf, start, end, out, fixes):  # pragma: no cover - compiled
        """Numbers separated by commas (whitespace around) in buf[start:end] into out. Returns
        (count, fixes needed): rows of fixes hold (index, first byte, end byte) of numbers left to
        the exact path; count < 0 is -1 - the offset of what is not a JSON number or comma, or of
        an integer of more than 15 digits (all-integer arrays are NumPy's int64 first)."""
        i, n, nfix, state = start, 0, 0, _MORE
        while state == _MORE:
            i, n, nfix, state = _step(buf, i, end, out, n, fixes, nfix)
        return (-1 - i if state == _BAD else n), nfix


class _State:
    usable = jit.AVAILABLE  # False also once the scanner failed to compile or run: JSON reads as before


def available() -> bool:
    return _State.usable


def warm_up() -> None:
    """Compile (or load from numba's cache) before the first request needs it; a scanner that
    fails to is switched off, with a warning, and JSON tensors are read the usual way."""
    if not _State.usable:
        return
    try:
        got = read_float32(b"[1.5, -2e-3]", 1, 11)
        if got is None or got.tolist() != [1.5, np.float32(-2e-3)]:
            raise RuntimeError(f"read [1.5, -2e-3] as {got}")
    except Exception as e:  # noqa: BLE001 - an optimisation that cannot run must not keep the models from loading
        _State.usable = False
        log(logger, logging.WARNING, "JSON number scanner off", error=f"{type(e).__name__}: {e}")


def read_float32(text: bytes, start: int, end: int) -> np.ndarray | None:
    """The numbers in text[start:end] (an array's inside, no brackets) as float32; None where they
    are not all plain JSON numbers (NaN, strings, nested arrays, a syntax error) or too many need
    the exact path: the caller then reads the array its usual way, and says what is wrong."""
    if not _State.usable:
        return None
    buf = np.frombuffer(text, dtype=np.uint8)
    bounds = _cut(text, start, end, max(1, min(THREADS, (end - start) // PART_BYTES)))
    parts = len(bounds) - 1
    outs = [np.empty((bounds[p + 1] - bounds[p]) // 2 + 1, np.float32) for p in range(parts)]
    fixes = [np.empty((MAX_EXACT_FIXES, 3), np.int64) for _ in range(parts)]
    counts: list[tuple[int, int]] = [(0, 0)] * parts

    def read(lo: int, hi: int) -> None:
        for p in range(lo, hi):
            counts[p] = _scan(buf, bounds[p] + (p > 0), bounds[p + 1], outs[p], fixes[p])

    if parts == 1:
        read(0, 1)
    else:
        split_range(read, parts, parts)
    if any(n < 0 or nfix > MAX_EXACT_FIXES for n, nfix in counts):
        return None
    with np.errstate(over="ignore"):
        for (n, nfix), out, fix in zip(counts, outs, fixes):
            for index, first, stop in fix[:nfix]:
                out[index] = np.float32(float(text[first:stop]))
    return np.concatenate([out[:n] for (n, _), out in zip(counts, outs)])


def _cut(text: bytes, start: int, end: int, parts: int) -> list[int]:
    """Part bounds: start, then commas near each even share of the bytes, then end (a part after
    the first begins past its comma)."""
    bounds = [start]
    for p in range(1, parts):
        comma = text.find(b",", max(bounds[-1] + 1, start + (end - start) * p // parts), end)
        if comma < 0:
            break
        bounds.append(comma)
    bounds.append(end)
    return bounds

