"""Numba kernels for what NumPy cannot do in one pass: depthwise convolution with its epilogue.

A NumPy depthwise 3x3 is nine multiply-adds over the whole output (18 memory passes); this is one
pass, parallel over (batch, channel) planes. Measured on MobileNetV2 it is what makes the host
runtime faster than TensorFlow there (bench/runtime.py). Import-guarded: without numba the NumPy
path is used.
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
from typing import Any, Callable, Mapping

import numpy as np

from kubetrt.telemetry.logs import log

from .parallel import threads_from_env

try:  # pragma: no cover - exercised implicitly wherever numba is installed
    import numba

    AVAILABLE = os.environ.get("KUBETRT_DISABLE_JIT", "") in ("", "0")
except ImportError:  # pragma: no cover
    numba = None  # type: ignore[assignment]  # AVAILABLE is False: nothing reads it
    AVAILABLE = False

# How the numba kernels apply a fused activation in place: none, clamp(v, a, b) (Relu is
# clamp(v, 0, inf), Clip clamp(v, min, max)), or gelu_erf(v); activations.py maps its table onto these.
SCALAR_NONE, SCALAR_CLAMP, SCALAR_GELU = 0, 1, 2
CACHE_LOG_MSG = "numba cache fallback"  # the one line logged when the cache is not where numba looks first
logger = logging.getLogger("kubetrt.runtime")


def _writable_dir(path: str, private: bool = False) -> bool:
    """Whether `path` exists or can be made, and a file can be created in it (numba's own probe).
    `private`: a directory in a shared place (the temp dir) must be ours and closed to others,
    since numba loads pickled code from it."""
    try:
        os.makedirs(path, mode=0o700 if private else 0o777, exist_ok=True)
        if private:
            st = os.stat(path)
            if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & 0o022:
                return False
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def choose_cache_dir(env: Mapping[str, str], in_tree: str,
                     tempdir: Callable[[], str] = tempfile.gettempdir) -> tuple[str | None, str, list[str]]:
    """(directory, how, unwritable places passed over) for numba's on-disk cache, in this order:
    NUMBA_CACHE_DIR if set and writable ("env"); the in-tree __pycache__ if writable ("in-tree");
    a private directory under KUBETRT_CACHE_DIR if set, else under the temp dir ("fallback");
    else (None, "off"): compile without the on-disk cache."""
    tried: list[str] = []
    user = env.get("NUMBA_CACHE_DIR", "")
    if user:
        if _writable_dir(user):
            return user, "env", tried
        tried.append(user)
    if _writable_dir(in_tree):
        return in_tree, "in-tree", tried
    tried.append(in_tree)
    if env.get("KUBETRT_CACHE_DIR"):
        path = os.path.join(env["KUBETRT_CACHE_DIR"], "numba")
        if _writable_dir(path):
            return path, "fallback", tried
        tried.append(path)
    try:
        tmp = tempdir()
    except OSError:  # FileNotFoundError: no writable temp dir at all (read-only root, no emptyDir)
        tmp = None
    if tmp:
        uid = os.getuid() if hasattr(os, "getuid") else 0
        path = os.path.join(tmp, f"kubetrt-numba-{uid}")
        if _writable_dir(path, private=True):
            return path, "fallback", tried
        tried.append(path)
    return None, "off", tried


def _setup_cache() -> bool:
    """Point numba's cache at a writable place before any cached function is decorated (numba
    fixes a function's cache location when it is decorated, and raises "no locator available"
    when it finds none). Returns whether kernels use the on-disk cache."""
    if numba is None:
        return False
    in_tree = os.path.join(os.path.dirname(os.path.abspath(__file__)), "__pycache__")
    path, how, tried = choose_cache_dir(os.environ, in_tree)
    if how in ("env", "in-tree"):
        if tried:  # NUMBA_CACHE_DIR was set but unwritable: numba itself would skip it too
            setattr(numba.config, "CACHE_DIR", "")
            log(logger, logging.WARNING, CACHE_LOG_MSG, cache_dir=path, unwritable=",".join(tried))
        return True
    setattr(numba.config, "CACHE_DIR", path or "")
    log(logger, logging.WARNING, CACHE_LOG_MSG, cache_dir=path or "none (compiling without on-disk cache)",
        unwritable=",".join(tried))
    return path is not None


CACHE = _setup_cache()


def njit(**options: Any) -> Callable[..., Any]:
    """numba.njit, with cache=True honoured only where _setup_cache found a writable place."""
    options["cache"] = bool(options.get("cache")) and CACHE
    return numba.njit(**options)

THREADS = threads_from_env("KUBETRT_JIT_THREADS")
MIN_WORK_PER_THREAD = 32 * 1024  # output elements; below this a thread hop costs more than it saves

if numba is not None:

    @njit(cache=True, nogil=True)
    def clamp(v, a, b):
        # The scalar form SCALAR_CLAMP (Relu is clamp(v, 0, inf), Clip clamp(v, min, max): see
        # activations.py). max/min keep a NaN operand NaN, as the xp forms do, and vectorize
        # where selects do not.
        return min(max(v, a), b)

    # Not numba-parallel: its worker threads spin after each region and starve the BLAS threads
    # of the next GEMM. nogil lets our own pool split the planes instead (see depthwise_conv).
    @njit(cache=True, nogil=True, error_model="numpy")
    def _depthwise(xp, w, bias, out, sh, sw, dh, dw, act, lo, hi, start, stop):
        n, c, oh, ow = out.shape
        kh, kw = w.shape[2], w.shape[3]
        for nc in range(start, stop):
            o = out[nc // c, nc % c]
            x = xp[nc // c, nc % c]
            ch = nc % c
            for i in range(oh):
                orow = o[i]
                for j in range(ow):
                    orow[j] = bias[ch]
                for a in range(kh):
                    row = x[i * sh + a * dh]
                    for e in range(kw):
                        wv = w[ch, 0, a, e]
                        off = e * dw
                        if sw == 1:  # unit stride: a contiguous, vectorizable row update
                            for j in range(ow):
                                orow[j] += row[j + off] * wv
                        else:
                            for j in range(ow):
                                orow[j] += row[j * sw + off] * wv
                if act == SCALAR_CLAMP:
                    for j in range(ow):
                        orow[j] = clamp(orow[j], lo, hi)
                elif act == SCALAR_GELU:
                    for j in range(ow):
                        orow[j] = gelu_erf(orow[j])


def run_split(kernel: Callable[..., None], args: tuple[Any, ...], items: int, work: int) -> None:
    """kernel(*args, start, stop) over [0, items), split across the runtime's pool when `work`
    (output elements) is large enough to pay for a thread hop."""
    parts = min(THREADS, max(1, work // MIN_WORK_PER_THREAD))
    if parts <= 1:
        kernel(*args, 0, items)
        return
    from .parallel import split_range

    split_range(lambda lo, hi: kernel(*args, lo, hi), items, parts)


def depthwise_conv(xp: np.ndarray, w: np.ndarray, bias: np.ndarray | None, strides: list[int], dil: list[int], oh: int, ow: int, act: int = SCALAR_NONE, lo: float = 0.0, hi: float = 0.0) -> np.ndarray:
    """Depthwise (multiplier 1) convolution of a padded NCHW float32 tensor, bias and activation fused."""
    n, c = xp.shape[:2]
    out = np.empty((n, c, oh, ow), dtype=xp.dtype)
    b = np.zeros(c, dtype=xp.dtype) if bias is None else np.ascontiguousarray(bias, dtype=xp.dtype)
    args = (np.ascontiguousarray(xp), np.ascontiguousarray(w, dtype=xp.dtype), b, out, strides[0], strides[1],
            dil[0], dil[1], act, xp.dtype.type(lo), xp.dtype.type(hi))
    run_split(_depthwise, args, n * c, out.size)
    return out


if numba is not None:

    @njit(cache=True, nogil=True)
    def _taps(pos, stride, dil, pad, k, size):
        # [first, end) of the kernel taps whose input index pos*stride + tap*dil - pad lies in
        # [0, size): the windowed kernels walk only these and never test for padding per tap.
        base = pos * stride - pad
        return max(0, -(base // dil)), min(k, -((base - size) // dil))

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})  # fused multiply-add: one rounding per tap
    def _depthwise_nhwc(x, w, bias, out, sh, sw, dh, dw, pt, pl, act, lo, hi, start, stop):
        # Reads the unpadded input and skips taps that fall into the padding: no padded copy.
        # Rows are (n, oh) pairs; the channel loop is innermost and contiguous, so it vectorizes.
        _, h, wd, _ = x.shape
        _, oh, ow, c = out.shape
        kh, kw = w.shape[0], w.shape[1]
        for r in range(start, stop):
            b = r // oh
            i = r % oh
            a0, a1 = _taps(i, sh, dh, pt, kh, h)
            for j in range(ow):
                acc = out[b, i, j]
                for ch in range(c):
                    acc[ch] = bias[ch]
                e0, e1 = _taps(j, sw, dw, pl, kw, wd)
                for a in range(a0, a1):
                    for e in range(e0, e1):
                        src = x[b, i * sh + a * dh - pt, j * sw + e * dw - pl]
                        wt = w[a, e]
                        for ch in range(c):
                            acc[ch] += src[ch] * wt[ch]
                if act == SCALAR_CLAMP:
                    for ch in range(c):
                        acc[ch] = clamp(acc[ch], lo, hi)
                elif act == SCALAR_GELU:
                    for ch in range(c):
                        acc[ch] = gelu_erf(acc[ch])


def depthwise_conv_nhwc(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, strides: list[int], dil: list[int], pads_begin: list[int], oh: int, ow: int, act: int = SCALAR_NONE, lo: float = 0.0, hi: float = 0.0) -> np.ndarray:
    """NHWC depthwise convolution (w: kh, kw, C) of an unpadded float32 tensor, epilogue fused."""
    n, _, _, c = x.shape
    out = np.empty((n, oh, ow, c), dtype=x.dtype)
    b = np.zeros(c, dtype=x.dtype) if bias is None else np.ascontiguousarray(bias, dtype=x.dtype)
    args = (np.ascontiguousarray(x), w, b, out, strides[0], strides[1], dil[0], dil[1], pads_begin[0], pads_begin[1],
            act, x.dtype.type(lo), x.dtype.type(hi))
    run_split(_depthwise_nhwc, args, n * oh, out.size)
    return out


if numba is not None:

    @njit(cache=True, nogil=True, error_model="numpy")
    def _epilogue(y, bias, residual, has_bias, has_residual, act, lo, hi, start, stop):
        # 2-D indexing and bounds in y's dtype (float32 only: callers check) keep the channel loop
        # one vector op per 16 lanes; row views and a float64 0.0 defeat the vectorizer.
        c = y.shape[1]
        for r in range(start, stop):
            if has_residual:
                for ch in range(c):
                    y[r, ch] += residual[r, ch]
            if act == SCALAR_CLAMP:
                for ch in range(c):
                    y[r, ch] = clamp(y[r, ch] + bias[ch], lo, hi)
            elif act == SCALAR_GELU:
                for ch in range(c):
                    y[r, ch] = gelu_erf(y[r, ch] + bias[ch])
            elif has_bias:
                for ch in range(c):
                    y[r, ch] += bias[ch]


def _epilogue_args(c: int, dtype: np.dtype, bias: np.ndarray | None, residual: np.ndarray | None, act: int, lo: float, hi: float) -> tuple[Any, ...]:
    dummy = np.zeros((1, c), dtype=dtype)  # a zero bias: the activation loops always add one
    b = np.ascontiguousarray(bias, dtype=dtype) if bias is not None else dummy[0]
    r = residual.reshape(-1, c) if residual is not None else dummy
    return (b, r, bias is not None, residual is not None, act, dtype.type(lo), dtype.type(hi))


def epilogue_rows(y: np.ndarray, bias: np.ndarray | None, residual: np.ndarray | None, act: int, lo: float, hi: float) -> np.ndarray:
    """In place on a (rows, channels) float32 GEMM result: + residual + bias, activation; one pass
    instead of three while the rows are still in cache."""
    c = y.shape[-1]
    y2 = y.reshape(-1, c)
    run_split(_epilogue, (y2,) + _epilogue_args(c, y.dtype, bias, residual, act, lo, hi), y2.shape[0], y2.size)
    return y


def epilogue_range(c: int, dtype: np.dtype, bias: np.ndarray | None, residual: np.ndarray | None, act: int, lo: float, hi: float) -> Callable[[np.ndarray, int, int], None]:
    """The same epilogue as a (y2d, first row, end row) callable, for tiles of a larger result."""
    args = _epilogue_args(c, np.dtype(dtype), bias, residual, act, lo, hi)
    return lambda y2, r0, r1: _epilogue(y2, *args, r0, r1)


if numba is not None:

    @njit(cache=True, nogil=True)
    def _max_pool_nhwc(x, out, kh, kw, sh, sw, dh, dw, pt, pl, start, stop):
        # Taps in the padding are skipped (padding is -inf for a max); channels innermost, contiguous.
        _, h, wd, _ = x.shape
        _, oh, ow, c = out.shape
        for r in range(start, stop):
            b = r // oh
            i = r % oh
            a0, a1 = _taps(i, sh, dh, pt, kh, h)
            for j in range(ow):
                acc = out[b, i, j]
                e0, e1 = _taps(j, sw, dw, pl, kw, wd)
                if a0 >= a1 or e0 >= e1:  # a window entirely in the padding
                    for ch in range(c):
                        acc[ch] = -np.inf
                    continue
                first = x[b, i * sh + a0 * dh - pt, j * sw + e0 * dw - pl]
                for ch in range(c):
                    acc[ch] = first[ch]
                for a in range(a0, a1):
                    for e in range(e0, e1):
                        src = x[b, i * sh + a * dh - pt, j * sw + e * dw - pl]
                        for ch in range(c):
                            if src[ch] > acc[ch]:
                                acc[ch] = src[ch]


if numba is not None:

    @njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    def _global_average_nhwc(x, out):
        n, h, w, c = x.shape
        inv = x.dtype.type(1.0 / (h * w))
        for b in range(n):
            acc = out[b, 0, 0]
            acc[:] = 0
            for i in range(h):
                for j in range(w):
                    px = x[b, i, j]
                    for ch in range(c):
                        acc[ch] += px[ch]
            for ch in range(c):
                acc[ch] *= inv


if numba is not None:
    global_average_into = _global_average_nhwc  # what compiled callers run: x (N, H, W, C) -> out (N, 1, 1, C)


def global_average_nhwc(x: np.ndarray) -> np.ndarray:
    """The mean over H and W of a float32 NHWC tensor, in one pass on the calling thread: for a
    classifier's head at a few images, a fraction of a oneDNN pooling call or NumPy's GEMV."""
    n, _, _, c = x.shape
    out = np.empty((n, 1, 1, c), dtype=x.dtype)
    _global_average_nhwc(np.ascontiguousarray(x), out)
    return out


if numba is not None:

    @njit(cache=True, nogil=True)
    def _quantize(x, scale, zero_point, lo, hi, out, start, stop):
        # all operands float32, and a loop over slices from 0: written otherwise (a float64
        # promotion, a loop from `start`) it does not vectorize and runs several times slower
        src, dst = x[start:stop], out[start:stop]
        for i in range(src.size):
            v = np.rint(src[i] / scale) + zero_point
            if v < lo:
                v = lo
            if v > hi:
                v = hi
            dst[i] = v


QUANTIZE_ELEMENTS_PER_THREAD = 1 << 19  # a single pass this cheap pays for a thread hop only when large


def quantize(x: np.ndarray, scale: float, zero_point: int, dtype: np.dtype) -> np.ndarray:
    """QuantizeLinear of a float32 tensor with one scale, in one pass (NumPy takes four)."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(flat.size, dtype=dtype)
    info = np.iinfo(dtype)
    f32 = np.float32
    args = (flat, f32(scale), f32(zero_point), f32(info.min), f32(info.max), out)
    run_split(_quantize, args, flat.size, flat.size * MIN_WORK_PER_THREAD // QUANTIZE_ELEMENTS_PER_THREAD)
    return out.reshape(x.shape)


def max_pool_nhwc(x: np.ndarray, k: tuple[int, ...], strides: list[int], dil: list[int], pads_begin: list[int], oh: int, ow: int) -> np.ndarray:
    """NHWC max pooling of an unpadded tensor in one pass (NumPy needs a padded copy + kh*kw passes)."""
    n, _, _, c = x.shape
    out = np.empty((n, oh, ow, c), dtype=x.dtype)
    args = (np.ascontiguousarray(x), out, k[0], k[1], strides[0], strides[1], dil[0], dil[1], pads_begin[0], pads_begin[1])
    run_split(_max_pool_nhwc, args, n * oh, out.size)
    return out


# ---------------------------------------------------------------- C calls from jitted code

if numba is not None:
    from llvmlite import ir as _ir
    from numba.core import types as _types
    from numba.extending import intrinsic

    def _c_call_codegen(arity: int) -> Callable[..., Any]:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            word = _ir.IntType(64)
            fn = builder.inttoptr(args[0], _ir.FunctionType(_ir.IntType(32), [word] * arity).as_pointer())
            return builder.call(fn, list(args[1:]))
        return codegen

    def _words(*ts: Any) -> bool:
        return all(isinstance(t, _types.Integer) and getattr(t, "bitwidth", 0) == 64 for t in ts)

    # int fn(word, ...) called at address `fn`: pointers and handles as 64-bit integers, so the
    # jitted caller takes addresses as arguments and stays cacheable (a ctypes function object
    # in its globals would not be). x86-64 and aarch64 pass an int in a 64-bit register alike.
    @intrinsic
    def c_call0(typingctx: Any, fn: Any) -> Any:
        return (_types.int32(fn), _c_call_codegen(0)) if _words(fn) else None

    @intrinsic
    def c_call1(typingctx: Any, fn: Any, a: Any) -> Any:
        return (_types.int32(fn, a), _c_call_codegen(1)) if _words(fn, a) else None

    @intrinsic
    def c_call2(typingctx: Any, fn: Any, a: Any, b: Any) -> Any:
        return (_types.int32(fn, a, b), _c_call_codegen(2)) if _words(fn, a, b) else None

    @intrinsic
    def c_call4(typingctx: Any, fn: Any, a: Any, b: Any, c: Any, d: Any) -> Any:
        return (_types.int32(fn, a, b, c, d), _c_call_codegen(4)) if _words(fn, a, b, c, d) else None

    def _pointer_codegen(elem: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ptr = elem.as_pointer()
            return builder.bitcast(args[0], ptr) if isinstance(signature.args[0], _types.RawPointer) else builder.inttoptr(args[0], ptr)
        return codegen

    # An address (an int64, or a void pointer) as a typed pointer, for numba's carray: how jitted
    # code reads parameter blocks and buffers it is handed by address.
    @intrinsic
    def int64s_at(typingctx: Any, addr: Any) -> Any:
        return _types.CPointer(_types.int64)(addr), _pointer_codegen(_ir.IntType(64))

    @intrinsic
    def float32s_at(typingctx: Any, addr: Any) -> Any:
        return _types.CPointer(_types.float32)(addr), _pointer_codegen(_ir.FloatType())

    from numba import carray as _carray

    # A view made from an address at an offset, where an offset index would get numba's
    # wraparound select, which keeps a loop from vectorizing.
    @njit(cache=True, nogil=True, inline="always")
    def float32_view(base, index, n):
        """n float32 from `index` (in floats) of the memory at address `base`."""
        return _carray(float32s_at(base + index * 4), (n,))


@functools.lru_cache(maxsize=None)
def entry_address(member: Any) -> int:
    """A team members' entry point, fn(void *block), compiled on first use."""
    address = numba.cfunc(_types.void(_types.voidptr), cache=CACHE)(member).address
    if not address:
        raise RuntimeError(f"numba compiled the team entry point {member.__name__} without an address")
    return int(address)


_EXP_LO, _EXP_HI = np.float32(-87.33654), np.float32(88.72283)  # exp's float32 range: 0 below, inf above

if numba is not None:

    @intrinsic
    def _bits_as_float32(typingctx: Any, bits: Any) -> Any:
        if isinstance(bits, _types.Integer) and getattr(bits, "bitwidth", 0) == 32:
            return _types.float32(bits), lambda context, builder, signature, args: builder.bitcast(args[0], _ir.FloatType())
        return None

    # exp(x) = 2^n e^r with r = x - n ln2 in [-ln2/2, ln2/2] and e^r a degree-7 polynomial (Cephes'
    # expf coefficients, within 1 ulp): straight-line float32 code with no call, so a loop of it
    # vectorizes, where numba's exp is a scalar libm call per element.
    @njit(cache=True, inline="always", error_model="numpy")
    def expf(x):
        # the selects are ordered so that a NaN passes through them and the polynomial as NaN
        c = _EXP_LO if x < _EXP_LO else x
        c = _EXP_HI if c > _EXP_HI else c
        t = c * np.float32(1.442695)
        n = min(np.int32(t + (np.float32(0.5) if t >= 0 else np.float32(-0.5))), np.int32(127))
        fn = np.float32(n)
        r = c - fn * np.float32(0.693359375) + fn * np.float32(2.12194440e-4)
        p = np.float32(1.9875691500e-4)
        p = p * r + np.float32(1.3981999507e-3)
        p = p * r + np.float32(8.3334519073e-3)
        p = p * r + np.float32(4.1665795894e-2)
        p = p * r + np.float32(1.6666665459e-1)
        p = p * r + np.float32(5.0000001201e-1)
        y = (p * r * r + r + np.float32(1.0)) * _bits_as_float32(np.int32((n + np.int32(127)) << np.int32(23)))
        y = np.float32(np.inf) if x > _EXP_HI else y
        return np.float32(0.0) if x < _EXP_LO else y

    # Loops below run over a slice from 0, not over range(start, stop): an index that may be
    # negative gets numba's wraparound select, which stops the loop vectorizing.
    @njit(cache=True, nogil=True, error_model="numpy")
    def _exp_flat(x, start, stop):
        y = x[start:stop]
        for i in range(y.size):
            y[i] = expf(y[i])

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
    def softmax_row_range(flat, width, log, scale, start, stop):
        # in place over rows [start, stop) of a C-contiguous array seen flat: each row scaled and
        # shifted by its max, then exp as one flat loop over the block (it vectorizes however short
        # the rows are), then each row scaled by its sum (softmax) or shifted by its log (log-softmax)
        for r in range(start, stop):
            row = flat[r * width:(r + 1) * width]
            m = row[0] * scale
            for i in range(row.size):
                m = max(m, row[i] * scale)
            for i in range(row.size):
                row[i] = row[i] * scale - m
        if log:
            for r in range(start, stop):
                row = flat[r * width:(r + 1) * width]
                total = 0.0
                for i in range(row.size):
                    total += expf(row[i])
                shift = row.dtype.type(np.log(total))
                for i in range(row.size):
                    row[i] -= shift
            return
        _exp_flat(flat, start * width, stop * width)
        for r in range(start, stop):
            row = flat[r * width:(r + 1) * width]
            total = 0.0
            for i in range(row.size):
                total += row[i]
            inv = row.dtype.type(1.0 / total)
            for i in range(row.size):
                row[i] *= inv


SOFTMAX_PASSES = 4  # the row passes are cheap: a thread hop pays only on tensors MIN_WORK_PER_THREAD x this large


def softmax_rows(x: np.ndarray, log: bool, scale: float = 1.0) -> np.ndarray:
    """(Log)softmax of scale * x over the last axis of a C-contiguous float32 array, in place
    (NumPy's form allocates and sweeps four times: costly on small heads)."""
    width = x.shape[-1]
    run_split(softmax_row_range, (x.reshape(-1), width, log, x.dtype.type(scale)), x.size // width, x.size // SOFTMAX_PASSES)
    return x


if numba is not None:
    import math

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
    def _layer_norm_rows(x, scale, bias, eps, out, start, stop):
        # mean and variance in float64 over each row, then one scaled write
        for r in range(start, stop):
            row, dst = x[r], out[r]
            total = 0.0
            for i in range(row.size):
                total += row[i]
            mean = total / row.size
            sq = 0.0
            for i in range(row.size):
                d = row[i] - mean
                sq += d * d
            inv = 1.0 / math.sqrt(sq / row.size + eps)
            m, s = row.dtype.type(mean), row.dtype.type(inv)
            for i in range(row.size):
                dst[i] = (row[i] - m) * s * scale[i] + bias[i]

    @njit(cache=True, inline="always", error_model="numpy")
    def gelu_erf(v):
        # erf(|z|) = 1 - poly(t) exp(-z^2), t = 1 / (1 + p|z|) (Abramowitz & Stegun 7.1.26, within
        # 1.5e-7): with expf inlined, a loop of it vectorizes, in a kernel compiled with
        # error_model="numpy" (numba's default tests each element's divisor for zero, to raise,
        # which keeps the loop scalar)
        a = abs(v) * np.float32(0.70710677)
        t = np.float32(1.0) / (np.float32(1.0) + np.float32(0.3275911) * a)
        poly = t * (np.float32(0.254829592) + t * (np.float32(-0.284496736) + t * (np.float32(1.421413741)
               + t * (np.float32(-1.453152027) + t * np.float32(1.061405429)))))
        erf = np.float32(1.0) - poly * expf(-a * a)
        return np.float32(0.5) * v * (np.float32(1.0) + (erf if v >= 0 else -erf))

    @njit(cache=True, nogil=True, error_model="numpy")
    def _gelu(x, out, start, stop):
        src, dst = x[start:stop], out[start:stop]  # one vectorized pass
        for i in range(src.size):
            dst[i] = gelu_erf(src[i])


def layer_norm_rows(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, eps: float, out: np.ndarray) -> np.ndarray:
    """LayerNormalization over the last axis of a C-contiguous float32 array into `out`, one
    read for the moments and one for the result (NumPy's form takes eight passes)."""
    rows, dst = x.reshape(-1, x.shape[-1]), out.reshape(-1, x.shape[-1])
    run_split(_layer_norm_rows, (rows, scale, bias, eps, dst), rows.shape[0], rows.size)
    return out


def gelu(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """GELU (erf form) of a float32 array in one vectorized pass; `out` may be x itself."""
    flat = np.ascontiguousarray(x).reshape(-1)
    dst = np.empty_like(flat) if out is None else out.reshape(-1)
    run_split(_gelu, (flat, dst), flat.size, flat.size // GELU_PASSES)
    return dst.reshape(x.shape)


GELU_PASSES = 2  # a pass of polynomials: a thread hop pays only on tensors MIN_WORK_PER_THREAD x this large


ROW_VECTOR_MIN_WIDTH = 256  # narrower rows are widened (the vector tiled) so the inner loop vectorizes
ROW_VECTOR_PASSES = 16  # one cheap pass: a thread hop pays only on tensors MIN_WORK_PER_THREAD x this large

# Operation codes of the row kernels; the vector-first forms are the two that do not commute.
ROW_VECTOR_OPS = {("Add", False): 0, ("Add", True): 0, ("Mul", False): 1, ("Mul", True): 1,
                  ("Sub", False): 2, ("Sub", True): 3, ("Div", False): 4, ("Div", True): 5}

if numba is not None:

    # One loop per operation (a branch inside the row loop would stop it vectorizing), and an
    # in-place twin: where the output may alias the input, LLVM's runtime overlap check sends the
    # whole call down the scalar path.
    @njit(cache=True, nogil=True, error_model="numpy")
    def _rows_by_vector(a, v, out, op, start, stop):
        c = v.shape[0]
        for i in range(start, stop):
            x, y = a[i], out[i]
            if op == 0:
                for j in range(c):
                    y[j] = x[j] + v[j]
            elif op == 1:
                for j in range(c):
                    y[j] = x[j] * v[j]
            elif op == 2:
                for j in range(c):
                    y[j] = x[j] - v[j]
            elif op == 3:
                for j in range(c):
                    y[j] = v[j] - x[j]
            elif op == 4:
                for j in range(c):
                    y[j] = x[j] / v[j]
            else:
                for j in range(c):
                    y[j] = v[j] / x[j]

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
    def rows_affine_at(flat, stride, scale, shift, floor, out, start, stop):
        c = scale.shape[0]
        for i in range(start, stop):
            at = i * stride
            x, y = flat[at:at + c], out[i]
            for j in range(c):
                y[j] = max(x[j] * scale[j] + shift[j], floor)

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
    def _rows_affine_spaced(a, stride, scale, shift, floor, out, start, stop):
        # a's rows read where they lie, `stride` floats apart from its first element
        c = scale.shape[0]
        rows_affine_at(float32_view(a.ctypes.data, 0, (out.shape[0] - 1) * stride + c), stride,
                       scale, shift, floor, out, start, stop)

    @njit(cache=True, nogil=True)
    def _place_rows(rows, flat, first, stride, start, stop):
        c = rows.shape[1]
        for i in range(start, stop):
            at = first + i * stride
            y, x = flat[at:at + c], rows[i]
            for j in range(c):
                y[j] = x[j]

    @njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
    def _rows_affine(a, scale, shift, floor, out, start, stop):
        c = scale.shape[0]
        for i in range(start, stop):
            x, y = a[i], out[i]
            for j in range(c):
                y[j] = max(x[j] * scale[j] + shift[j], floor)  # NaN stays NaN, as np.maximum keeps it

    @njit(cache=True, nogil=True, error_model="numpy")
    def _rows_by_vector_in_place(a, v, op, start, stop):
        c = v.shape[0]
        for i in range(start, stop):
            x = a[i]
            if op == 0:
                for j in range(c):
                    x[j] += v[j]
            elif op == 1:
                for j in range(c):
                    x[j] *= v[j]
            elif op == 2:
                for j in range(c):
                    x[j] -= v[j]
            elif op == 3:
                for j in range(c):
                    x[j] = v[j] - x[j]
            elif op == 4:
                for j in range(c):
                    x[j] /= v[j]
            else:
                for j in range(c):
                    x[j] = v[j] / x[j]


def rows_joined(c: int, rows: int) -> int:
    """How many rows of width c one row of the kernels' loop spans: narrow rows are joined (their
    vectors tiled) until the inner loop is wide enough to vectorize."""
    k = 1
    while c * k < ROW_VECTOR_MIN_WIDTH and rows % (2 * k) == 0:
        k *= 2
    return k


def rows_affine(a: np.ndarray, scale: np.ndarray, shift: np.ndarray, relu: bool = False) -> np.ndarray:
    """a * scale + shift in one pass (then max(., 0) with `relu`), for a float32 array and vectors
    over its last axis (passes/affine.py composes a chain of per-channel Mul/Add/Sub/Div into them).
    Rows of `a` may lie apart (a view of a growing Concat's buffer): they are read where they are."""
    c = scale.size
    rows = a.size // c
    out = np.empty(a.shape, a.dtype)
    floor = np.float32(0.0 if relu else -np.inf)
    stride = None if a.flags.c_contiguous or a.dtype != np.float32 else row_stride(a)
    if stride is not None:
        run_split(_rows_affine_spaced, (a, stride, scale, shift, floor, out.reshape(rows, c)), rows,
                  a.size // ROW_VECTOR_PASSES)
        return out
    a = np.ascontiguousarray(a)
    k = rows_joined(c, rows)
    args = (a.reshape(rows // k, c * k), np.tile(scale, k), np.tile(shift, k), floor, out.reshape(rows // k, c * k))
    run_split(_rows_affine, args, rows // k, a.size // ROW_VECTOR_PASSES)
    return out


def row_stride(a: np.ndarray) -> int | None:
    """The elements from one row (last axis) of `a` to the next where its rows are contiguous and
    evenly spaced, as a view of a growing Concat's leading channels is; else None. Read from the
    shape and strides alone: asking a view for its base's address costs more than a small
    tensor's whole pass."""
    shape, strides, item = a.shape, a.strides, a.itemsize
    if a.ndim < 1 or a.size == 0 or (shape[-1] > 1 and strides[-1] != item):
        return None
    step = span = 0  # bytes from one row to the next; bytes the rows of the inner dims cover
    for n, s in zip(shape[-2::-1], strides[-2::-1]):
        if n == 1:
            continue
        if s <= 0:  # broadcast or reversed rows
            return None
        if not step:
            step, span = s, s * n
        elif s != span:
            return None
        else:
            span *= n
    if not step:
        return shape[-1]  # one row
    if step % item or step // item < shape[-1]:
        return None
    return step // item


def place_columns(src: np.ndarray, buf: np.ndarray, at: int) -> None:
    """buf[..., at:at + w] = src for a C-contiguous `buf` with src's leading shape and dtype, split
    across the pool when large: NumPy's strided copy runs one short inner loop per row and a view
    of the columns would have to be asked where it lies; here the place is known."""
    width = src.shape[-1]
    if not AVAILABLE or src.dtype != buf.dtype or src.size == 0:
        buf[..., at:at + width] = src
        return
    rows = np.ascontiguousarray(src).reshape(-1, width)
    run_split(_place_rows, (rows, buf.reshape(-1), at, buf.shape[-1]), rows.shape[0], src.size // ROW_VECTOR_PASSES)


def rows_by_vector(a: np.ndarray, v: np.ndarray, op: str, vector_first: bool, out: np.ndarray) -> np.ndarray:
    """out = a op v (v op a where vector_first) for a C-contiguous float array and a vector over its
    last axis: a per-channel scale or shift of NHWC activations. NumPy's broadcasting loop runs
    one short inner loop per row there, several times slower than this single pass. `out` may be a."""
    c = v.size
    rows = a.size // c
    k = rows_joined(c, rows)
    vec = np.ascontiguousarray(v, dtype=a.dtype).reshape(-1)
    if k > 1:
        vec = np.tile(vec, k)
    f = ROW_VECTOR_OPS[(op, vector_first)]
    a2 = a.reshape(rows // k, c * k)
    if out is a:
        run_split(_rows_by_vector_in_place, (a2, vec, f), rows // k, a.size // ROW_VECTOR_PASSES)
    else:
        run_split(_rows_by_vector, (a2, vec, out.reshape(rows // k, c * k), f), rows // k, a.size // ROW_VECTOR_PASSES)
    return out


if AVAILABLE:

    def _block_scaler(lanes: int) -> Any:
        @njit(cache=True, nogil=True, error_model="numpy")
        def scale(x, g, out, start, stop):
            # x, out (P, H*W, lanes); g (P, lanes): one channel block of one image per p. A literal
            # lane count lets LLVM keep the block in one vector register.
            for p in range(start, stop):
                s, xp, yp = g[p], x[p], out[p]
                for j in range(x.shape[1]):
                    for lane in range(lanes):
                        yp[j, lane] = xp[j, lane] * s[lane]
        return scale

    _SCALE_BLOCKS = {lanes: _block_scaler(lanes) for lanes in (8, 16)}


def scale_blocked(x: np.ndarray, g: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = x * g for blocked activations x (N, C/B, H, W, B), B 8 or 16, and per-image channel
    scales g (N or 1, 1, 1, C): a squeeze-and-excitation gate inside a blocked region (passes/blocked.py)."""
    n, cb, h, w, b = x.shape
    if b not in _SCALE_BLOCKS or g.size not in (cb * b, n * cb * b) or out.shape != x.shape or not out.flags.c_contiguous:
        raise ValueError(f"scale_blocked: expected (N, C/B, H, W, B) activations, B 8 or 16, and (N, 1, 1, C) scales, "
                         f"got {list(x.shape)} and {list(g.shape)}")
    scales = np.ascontiguousarray(np.broadcast_to(g.reshape(-1, cb * b), (n, cb * b)), dtype=x.dtype).reshape(n * cb, b)
    run_split(_SCALE_BLOCKS[b], (np.ascontiguousarray(x).reshape(n * cb, h * w, b), scales, out.reshape(n * cb, h * w, b)),
              n * cb, x.size // ROW_VECTOR_PASSES)
    return out
