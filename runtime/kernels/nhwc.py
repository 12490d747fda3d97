"""NHWC twins of the convolution-family kernels, produced by the layout pass (passes/layout.py).

Attributes keep their ONNX (NCHW) meaning; only the tensor layout differs. Weights are
re-laid out once, in the factory: (kh*kw*C, O) for GEMM, (kh, kw, C) for depthwise.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from . import activations, conv_gemm, jit, onednn, parallel, sgemm, winograd
from .primitive_chain import KernelCall, Link, linkable
from .nn import conv_geometry, geometry_by_input_size, make_epilogue, out_size
from .registry import BLOCKED_RESULT, OutputShapes, KernelSpec, Run, register, same_as_input


TO_BLOCKED, FROM_BLOCKED = onednn.Reorder(to_blocked=True), onednn.Reorder(to_blocked=False)  # used only where oneDNN is


def pad_hw(x: np.ndarray, begin: list[int], end: list[int], value: float = 0.0) -> np.ndarray:
    if not any(begin) and not any(end):
        return x
    n, h, w, c = x.shape
    out = np.empty((n, h + begin[0] + end[0], w + begin[1] + end[1], c), dtype=x.dtype)
    out[:, : begin[0]] = value
    out[:, h + begin[0] :] = value
    out[:, :, : begin[1]] = value
    out[:, :, w + begin[1] :] = value
    out[:, begin[0] : begin[0] + h, begin[1] : begin[1] + w] = x
    return out


def windows_hw(xp: np.ndarray, k: tuple[int, int], strides: list[int], dil: list[int], oh: int, ow: int) -> np.ndarray:
    """Read-only view (N, OH, OW, kh, kw, C): im2col rows without a copy."""
    n, _, _, c = xp.shape
    sn, sh, sw, sc = xp.strides
    shape, view_strides = (n, oh, ow, k[0], k[1], c), (sn, sh * strides[0], sw * strides[1], sh * dil[0], sw * dil[1], sc)
    if not xp.flags.c_contiguous:
        return as_strided(xp, shape=shape, strides=view_strides, writeable=False)
    win = np.ndarray(shape, xp.dtype, xp, 0, view_strides)  # cheaper than as_strided, which matters at batch 1
    win.flags.writeable = False
    return win


# A FusedConvNHWC with this attribute set max-pools its results 2x2 with stride 2 (floor mode):
# the pooling that read them alone, taken in (passes/conv_pool.py).
MAX_POOL_2X2 = "max_pool_2x2"


def _nhwc_conv_shape(spec: KernelSpec) -> OutputShapes:
    xs, ws = spec.shapes[0], spec.shapes[1]
    if xs is None or ws is None or len(xs) != 4 or -1 in xs[1:3]:
        return [(None, spec.dtypes[0])]
    k = tuple(ws[2:])
    strides, dil, b, e = conv_geometry(spec, tuple(xs[1:3]), k)
    oh, ow = out_size(xs[1], k[0], strides[0], dil[0], b[0], e[0]), out_size(xs[2], k[1], strides[1], dil[1], b[1], e[1])
    if spec.attr(MAX_POOL_2X2, 0):
        oh, ow = oh // 2, ow // 2
    return [((xs[0], oh, ow, ws[0]), spec.dtypes[0])]


def max_pooled_2x2(y: np.ndarray) -> np.ndarray:
    """NHWC y max-pooled 2x2 with stride 2 (floor mode): a pooled convolution's pooling where its
    kernel cannot make it in its tiles."""
    n, h, w, c = y.shape
    oh, ow = h // 2, w // 2
    if jit.AVAILABLE and y.dtype in (np.float32, np.float64):
        return jit.max_pool_nhwc(y, (2, 2), [2, 2], [1, 1], [0, 0], oh, ow)
    return y[:, :2 * oh, :2 * ow].reshape(n, oh, 2, ow, 2, c).max(axis=(2, 4))


def _pooling_after(call: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    return lambda *args: max_pooled_2x2(call(*args))


def _pooling_results(run: Run) -> Run:
    return lambda *args: (max_pooled_2x2(run(*args)[0]),)


def _on_one_pixel(spec: KernelSpec, w: np.ndarray) -> bool:
    """A pointwise convolution of 1x1 maps (squeeze-and-excitation blocks) is a GEMV: NumPy's call
    costs a fraction of a oneDNN one until the batch makes it a real GEMM."""
    xs = spec.shapes[0]
    return spec.attr("group", 1) == 1 and w.shape[2:] == (1, 1) and xs is not None and len(xs) == 4 and tuple(xs[1:3]) == (1, 1)


BLOCKED_OPS = frozenset({"FusedConvNHWC", "MaxPoolNHWC", "AveragePoolNHWC", "SqueezeExciteNHWC"})  # blocked in, blocked out
BLOCKED_SINKS = frozenset({"GlobalAveragePoolNHWC", "GlobalMaxPoolNHWC"})  # blocked in, NHWC out


def takes_blocked(spec: KernelSpec) -> bool:
    """Whether this node's kernel reads (and, but for the global pools, writes) the blocked layout:
    float32 oneDNN convolutions (plain or depthwise) and pools whose channels fill whole blocks."""
    xs = spec.shapes[0]
    if not onednn.AVAILABLE or spec.dtypes[0] != np.float32 or xs is None or len(xs) != 4 or xs[3] < 0 or xs[3] % onednn.BLOCK:
        return False
    if spec.op != "FusedConvNHWC":
        return spec.op in BLOCKED_OPS or spec.op in BLOCKED_SINKS
    if spec.attr(MAX_POOL_2X2, 0):  # its pooling reads NHWC results
        return False
    w = spec.const(1)
    if w is None or not onednn.conv_applies(spec, w) or _on_one_pixel(spec, w) or (spec.has(3) and spec.dtypes[3] != np.float32):
        return False
    o, cg = w.shape[:2]
    group = spec.attr("group", 1)
    return o % onednn.BLOCK == 0 and (group == 1 or (group == o == xs[3] and cg == 1))


def writes_blocked(spec: KernelSpec) -> bool:
    """Whether a float32 oneDNN convolution outside a blocked region can write its result blocked
    for the region to read (BLOCKED_RESULT): fewer input channels than a block (an image's, read
    as NCHW by oneDNN's first-convolution kernels; more fall back to its reference code), output
    channels in whole blocks, no residual."""
    w = spec.const(1)
    return (spec.op == "FusedConvNHWC" and onednn.AVAILABLE and spec.dtypes[0] == np.float32 and w is not None
            and onednn.conv_applies(spec, w) and spec.attr("group", 1) == 1 and w.shape[0] % onednn.BLOCK == 0
            and w.shape[1] < onednn.BLOCK and not spec.has(3) and not _on_one_pixel(spec, w) and not spec.attr(MAX_POOL_2X2, 0))


def blocked_operand(spec: KernelSpec) -> int | None:
    """For a float32 Mul of NHWC activations by per-channel scales (N or 1, 1, 1, C), a squeeze-and-
    excitation gate: the position of the activations, which may then arrive blocked
    (elementwise.binary scales them in place); None for any other node."""
    if spec.op != "Mul" or not (onednn.AVAILABLE and jit.AVAILABLE) or any(d != np.float32 for d in spec.dtypes[:2]):
        return None
    for pos in (0, 1):
        xs, gs = spec.shapes[pos], spec.shapes[1 - pos]
        if xs is None or gs is None or len(xs) != 4 or len(gs) != 4 or xs[3] < 1 or xs[3] % onednn.BLOCK:
            continue
        if tuple(gs[1:]) == (1, 1, xs[3]) and gs[0] in (1, xs[0]) and tuple(xs[1:3]) != (1, 1):
            return pos
    return None


@register("FusedConvNHWC", _nhwc_conv_shape)
def conv_nhwc(spec: KernelSpec) -> Run:
    w = spec.const(1)
    assert w is not None, "the layout pass only rewrites convolutions with constant weights"
    o, cg, kh, kw = w.shape
    group = spec.attr("group", 1)
    epilogue = make_epilogue(spec)
    residual_inplace = 3 in spec.inplace
    depthwise = group > 1 and group == o and cg == 1
    jit_act = activations.scalar_form(spec.attrs.get("activation"))
    jit_epilogue = jit.AVAILABLE and jit_act is not None
    use_jit = depthwise and jit.AVAILABLE and w.dtype == np.float32 and jit_act is not None and not spec.has(3)
    dnnl = onednn.conv_for_node(spec, w, "nhwc")
    winograd_conv = winograd.for_conv(dnnl) if dnnl is not None else None

    geometry = geometry_by_input_size(spec, (kh, kw))

    on_one_pixel = _on_one_pixel(spec, w)
    blocked_result = bool(spec.attr(BLOCKED_RESULT))
    pool = bool(spec.attr(MAX_POOL_2X2, 0))
    if dnnl is not None:
        bound: dict[tuple[int, ...], Callable[..., np.ndarray]] = {}  # the convolution per input shape

        def bind(shape: tuple[int, ...]) -> Callable[..., np.ndarray]:
            blocked = len(shape) == 5
            _, _, b, e, oh, ow = geometry(*(shape[2:4] if blocked else shape[1:3]))
            # the region's reads take blocks from the batch where a ToBlocked would have made them
            blocked_out = blocked_result and not blocked and shape[0] >= onednn.BLOCKED_MIN_BATCH
            if winograd_conv is not None and not blocked_out and winograd.worth(shape, oh, ow) and (not pool or winograd.pools(oh, ow)):
                return bound.setdefault(shape, winograd_conv.site(shape, oh, ow, b[0], b[1], pool))
            call = dnnl.bind(shape, oh, ow, b, e, blocked_out)
            return bound.setdefault(shape, _pooling_after(call) if pool else call)

        def run_onednn(x: np.ndarray, _w: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
            call = bound.get(x.shape) or bind(x.shape)
            if residual is not None and residual.ndim != x.ndim:  # a shortcut from outside the blocked region
                residual = (TO_BLOCKED if x.ndim == 5 else FROM_BLOCKED)(residual)
            return (call(x, residual, residual_inplace),)

        def link(x: np.ndarray, _w: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> Link | None:
            if residual is not None and (residual.ndim != x.ndim or not residual_inplace):
                return None
            call = bound.get(x.shape) or bind(x.shape)
            if isinstance(call, winograd.WinogradSite):
                return Link(call.kernel, 0, call.shape)
            if not isinstance(call, onednn.Site):  # an image's channels transposed first
                return None
            return Link(call, 0, call.shape, into=None if residual is None else 3)
        if not on_one_pixel:  # float32 (ONNX: x has the weights' dtype), so the GEMM-path weights are never needed
            return linkable(run_onednn, link)

    w_gemm = np.ascontiguousarray(w.transpose(2, 3, 1, 0).reshape(kh * kw * cg, o)) if group == 1 else None
    w_dw = np.ascontiguousarray(w[:, 0].transpose(1, 2, 0)) if depthwise else None
    w_groups = [np.ascontiguousarray(w[g * (o // group):(g + 1) * (o // group)].transpose(2, 3, 1, 0).reshape(kh * kw * cg, -1))
                for g in range(group)] if not depthwise and group > 1 else []

    def fits_jit_epilogue(dtype: np.dtype, residual: np.ndarray | None) -> bool:
        return jit_epilogue and dtype == np.float32 and (residual is None or residual.flags.c_contiguous)

    def row_epilogue(dtype: np.dtype, bias: np.ndarray | None, residual: np.ndarray | None) -> conv_gemm.RowEpilogue:
        if fits_jit_epilogue(dtype, residual):
            kind, lo, hi = jit_act  # type: ignore[misc]
            return jit.epilogue_range(o, np.dtype(np.float32), bias, residual, kind, lo, hi)
        res2 = None if residual is None else residual.reshape(-1, o)

        def numpy_rows(y2: np.ndarray, r0: int, r1: int) -> None:
            t = y2[r0:r1]
            if bias is not None:
                t += bias
            if res2 is not None:
                t += res2[r0:r1]
            if epilogue is not None:
                epilogue(t)
        return numpy_rows

    def check_residual(residual: np.ndarray | None, shape: tuple[int, ...]) -> None:
        if residual is not None and residual.shape != shape:
            raise ValueError(f"Conv {spec.name}: residual shape {residual.shape} differs from output {shape}")

    def run(x: np.ndarray, _w: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        n, h, wd, c = x.shape
        if c != cg * group:
            raise ValueError(f"Conv {spec.name}: input has {c} channels, weights expect {cg * group}")
        strides, dil, b, e, oh, ow = geometry(h, wd)
        if use_jit:
            kind, lo, hi = jit_act  # type: ignore[misc]
            return (jit.depthwise_conv_nhwc(x, w_dw, bias, strides, dil, b, oh, ow, kind, lo, hi),)  # type: ignore[arg-type]
        if depthwise:
            y = _depthwise_numpy(pad_hw(x, b, e), w_dw, strides, dil, oh, ow)  # type: ignore[arg-type]
        elif group == 1 and kh == kw == 1 and strides == [1, 1] and not any(b) and not any(e):
            assert w_gemm is not None  # built by the factory for every non-depthwise convolution
            if x.dtype == w_gemm.dtype and conv_gemm.worth_row_tiling(n * h * wd):
                check_residual(residual, (n, oh, ow, o))
                return (conv_gemm.tiled_matmul(x.reshape(-1, c), w_gemm, row_epilogue(x.dtype, bias, residual)).reshape(n, oh, ow, o),)
            y = parallel.matmul(x.reshape(-1, c), w_gemm).reshape(n, oh, ow, o)
        else:
            win = windows_hw(pad_hw(x, b, e), (kh, kw), strides, dil, oh, ow)
            if group == 1 and x.dtype == w_gemm.dtype and conv_gemm.worth_tiling(win):  # type: ignore[union-attr]
                check_residual(residual, (n, oh, ow, o))
                return (conv_gemm.tiled_conv(win, w_gemm, row_epilogue(x.dtype, bias, residual)),)  # type: ignore[arg-type]
            if group == 1:
                y = parallel.matmul(win.reshape(n * oh * ow, kh * kw * c), w_gemm).reshape(n, oh, ow, o)  # type: ignore[arg-type]
            else:
                og = o // group
                y = np.empty((n, oh, ow, o), dtype=x.dtype)
                for g in range(group):
                    cols = win[..., g * cg:(g + 1) * cg].reshape(n * oh * ow, kh * kw * cg)
                    y[..., g * og:(g + 1) * og] = (cols @ w_groups[g]).reshape(n, oh, ow, og)
        check_residual(residual, y.shape)
        if fits_jit_epilogue(y.dtype, residual):
            kind, lo, hi = jit_act  # type: ignore[misc]
            return (jit.epilogue_rows(y, bias, residual, kind, lo, hi),)
        if bias is not None:
            y += bias
        if residual is not None:
            if residual_inplace and residual.flags.writeable:
                residual += y
                y = residual
            else:
                y += residual
        if epilogue is not None:
            epilogue(y)
        return (y,)

    if pool:
        run = _pooling_results(run)
    if dnnl is not None:
        def run_gemv_or_onednn(x: np.ndarray, _w: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
            if x.size * o < onednn.MIN_DENSE_MACS:
                return run(x, _w, bias, residual)
            return run_onednn(x, _w, bias, residual)

        def link_gemv_or_onednn(x: np.ndarray, _w: np.ndarray, bias: np.ndarray | None = None, residual: np.ndarray | None = None) -> Link | None:
            return None if x.size * o < onednn.MIN_DENSE_MACS else link(x, _w, bias, residual)
        return linkable(run_gemv_or_onednn, link_gemv_or_onednn)
    return run


def _depthwise_numpy(xp: np.ndarray, w: np.ndarray, strides: list[int], dil: list[int], oh: int, ow: int) -> np.ndarray:
    kh, kw, c = w.shape
    out = np.zeros((xp.shape[0], oh, ow, c), dtype=xp.dtype)
    for i in range(kh):
        for j in range(kw):
            r0, c0 = i * dil[0], j * dil[1]
            out += xp[:, r0:r0 + (oh - 1) * strides[0] + 1:strides[0], c0:c0 + (ow - 1) * strides[1] + 1:strides[1]] * w[i, j]
    return out


def _nhwc_pool_shape(spec: KernelSpec) -> OutputShapes:
    xs = spec.shapes[0]
    k = tuple(spec.attr("kernel_shape") or ())
    if xs is None or len(xs) != 4 or -1 in xs[1:3]:
        return [(None, spec.dtypes[0])]
    strides, dil, b, e = conv_geometry(spec, tuple(xs[1:3]), k)
    ceil = bool(spec.attr("ceil_mode", 0))
    return [((xs[0], out_size(xs[1], k[0], strides[0], dil[0], b[0], e[0], ceil), out_size(xs[2], k[1], strides[1], dil[1], b[1], e[1], ceil), xs[3]), spec.dtypes[0])]


@register(["MaxPoolNHWC", "AveragePoolNHWC"], _nhwc_pool_shape)
def pool_nhwc(spec: KernelSpec) -> Run:
    from .nn import pool, pool_attrs, pool_geometry

    nchw = pool(KernelSpec(spec.op.replace("NHWC", ""), spec.name, spec.attrs, spec.consts, spec.shapes, spec.dtypes, spec.n_outputs))
    k, is_max, ceil, include_pad = pool_attrs(spec)
    simple_max = is_max and not ceil
    algorithm = "pooling_max" if is_max else "pooling_avg_include_padding" if include_pad else "pooling_avg_exclude_padding"
    strides, dil = list(spec.attr("strides") or [1, 1]), list(spec.attr("dilations") or [1, 1])
    fused = onednn.Pool2D(algorithm, k, strides, dil, spec.name) if onednn.AVAILABLE else None
    geometry = functools.lru_cache(maxsize=16)(lambda h, wd: pool_geometry(spec, k, h, wd, ceil))

    bound: dict[tuple[int, ...], Callable[[np.ndarray], np.ndarray] | None] = {}  # oneDNN's pooling per input shape, or None

    def bind(shape: tuple[int, ...]) -> Callable[[np.ndarray], np.ndarray] | None:
        _, h, wd, _ = onednn.unblocked_shape(shape) if len(shape) == 5 else shape
        _, _, b, e, tail, oh, ow = geometry(h, wd)
        usable = fused is not None and not (include_pad and not is_max and tail != e)  # the ceil-mode overhang never counts, oneDNN's padding would
        return bound.setdefault(shape, fused.bind(shape, oh, ow, b, tail) if usable and fused is not None else None)

    def run_onednn(x: np.ndarray) -> tuple[np.ndarray, ...]:
        call = bound[x.shape] if x.shape in bound else bind(x.shape)
        if call is None or x.dtype != np.float32:
            return (TO_BLOCKED(run(FROM_BLOCKED(x))[0]),) if x.ndim == 5 else run(x)
        return (call(x),)

    def link(x: np.ndarray) -> Link | None:
        call = bound[x.shape] if x.shape in bound else bind(x.shape)
        return None if not isinstance(call, onednn.Site) or x.dtype != np.float32 else Link(call, 0, call.shape)

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if not simple_max:  # rare variants (ceil mode, averages with padding) reuse the NCHW code
            (y,) = nchw(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
            return (np.ascontiguousarray(y.transpose(0, 2, 3, 1)),)
        n, h, wd, c = x.shape
        strides, dil, b, e = conv_geometry(spec, (h, wd), k)
        oh = out_size(h, k[0], strides[0], dil[0], b[0], e[0])
        ow = out_size(wd, k[1], strides[1], dil[1], b[1], e[1])
        if jit.AVAILABLE and x.dtype in (np.float32, np.float64):
            return (jit.max_pool_nhwc(x, k, strides, dil, b, oh, ow),)
        xp = pad_hw(x, b, e, -np.inf)
        out: np.ndarray | None = None
        for i in range(k[0]):
            for j in range(k[1]):
                r0, c0 = i * dil[0], j * dil[1]
                v = xp[:, r0:r0 + (oh - 1) * strides[0] + 1:strides[0], c0:c0 + (ow - 1) * strides[1] + 1:strides[1]]
                out = v.copy() if out is None else np.maximum(out, v, out=out)
        return (out,)  # type: ignore[return-value]

    return linkable(run_onednn, link) if fused is not None else run


def _nhwc_global_shape(spec: KernelSpec) -> OutputShapes:
    xs = spec.shapes[0]
    return [(None if xs is None else (xs[0], 1, 1, xs[3]), spec.dtypes[0])]


# Up to this many elements (a classifier head's last feature map at batch 1) one thread's pass
# beats a oneDNN pooling call; from about four images of 7x7x1280 up they are even.
ONE_THREAD_GLOBAL_AVERAGE = 1 << 17


_GAP_X, _GAP_OUT, _GAP_N, _GAP_H, _GAP_W, _GAP_C, _GAP_FIELDS = range(7)  # the one-thread global average's parameter block

if sgemm.AVAILABLE:
    from numba import carray

    def _global_average_member(data):  # compiled into a C callable by jit.entry_address
        q = carray(jit.int64s_at(data), (_GAP_FIELDS,))
        n, h, w, c = q[_GAP_N], q[_GAP_H], q[_GAP_W], q[_GAP_C]
        jit.global_average_into(carray(jit.float32s_at(q[_GAP_X]), (n, h, w, c)), carray(jit.float32s_at(q[_GAP_OUT]), (n, 1, 1, c)))


def _global_average_call(shape: tuple[int, ...]) -> KernelCall:
    """jit.global_average_nhwc for float32 inputs of `shape`, as a primitive chain runs it."""
    n, h, w, c = shape

    def block() -> tuple[np.ndarray, None]:
        q = np.zeros(_GAP_FIELDS, np.int64)
        q[[_GAP_N, _GAP_H, _GAP_W, _GAP_C]] = shape
        return q, None
    return KernelCall(jit.entry_address(_global_average_member), block, _GAP_X, _GAP_OUT, (n, 1, 1, c), team=False)


@register(["GlobalAveragePoolNHWC", "GlobalMaxPoolNHWC"], _nhwc_global_shape)
def global_pool_nhwc(spec: KernelSpec) -> Run:
    average = spec.op == "GlobalAveragePoolNHWC"

    @functools.lru_cache(maxsize=16)
    def mean_weights(hw: int, dtype: np.dtype) -> np.ndarray:
        return np.full(hw, 1.0 / hw, dtype=dtype)

    fused = onednn.Pool2D("pooling_avg_exclude_padding" if average else "pooling_max", (), [1, 1], [1, 1], spec.name) \
        if onednn.AVAILABLE else None

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.ndim == 5:  # blocked: a (N, C, 1, 1) result in blocks is laid out as NHWC, so this leaves the region for free
            n, _, _, c = onednn.unblocked_shape(x.shape)
            return (fused(x, 1, 1, [0, 0], [0, 0]).reshape(n, 1, 1, c),)  # type: ignore[misc]
        n, h, w, c = x.shape
        if average and jit.AVAILABLE and x.dtype == np.float32 and x.size <= ONE_THREAD_GLOBAL_AVERAGE:
            return (jit.global_average_nhwc(x),)
        if fused is not None and x.dtype == np.float32:
            return (fused(x, 1, 1, [0, 0], [0, 0]),)
        rows = x.reshape(n, h * w, c)
        if average and x.dtype.kind == "f":  # a GEMV beats NumPy's strided add.reduce over the spatial axis
            y = np.matmul(mean_weights(h * w, x.dtype), rows)
        else:
            y = np.maximum.reduce(rows, axis=1)
        return (y.reshape(n, 1, 1, c),)

    def link(x: np.ndarray) -> Link | None:
        if fused is None or x.dtype != np.float32:
            return None
        if x.ndim == 5:
            n, _, _, c = onednn.unblocked_shape(x.shape)
            return Link(fused.bind(x.shape, 1, 1, [0, 0], [0, 0]), 0, (n, 1, 1, c))
        if average and jit.AVAILABLE and x.size <= ONE_THREAD_GLOBAL_AVERAGE:
            return Link(_global_average_call(x.shape), 0, (x.shape[0], 1, 1, x.shape[3])) if sgemm.AVAILABLE else None
        site = fused.bind(x.shape, 1, 1, [0, 0], [0, 0])
        return Link(site, 0, site.shape)

    return linkable(run, link)


@register("ToBlocked", same_as_input)
def to_blocked(spec: KernelSpec) -> Run:
    """Where a region of oneDNN kernels (passes/blocked.py) begins: from BLOCKED_MIN_BATCH images
    up the NHWC tensor is reordered into blocks, below it passes through and the region runs NHWC."""

    def hands_through(x: np.ndarray) -> bool:
        return not onednn.AVAILABLE or x.ndim != 4 or x.shape[0] < onednn.BLOCKED_MIN_BATCH

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        return (x,) if hands_through(x) else (TO_BLOCKED(x),)

    def link(x: np.ndarray) -> Link | None:
        return Link(None, 0, x.shape) if hands_through(x) else None

    return linkable(run, link)


@register("FromBlocked", same_as_input)
def from_blocked(spec: KernelSpec) -> Run:
    """Where a blocked region ends: NHWC again for kernels that read it."""

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        return (x,) if x.ndim == 4 else (FROM_BLOCKED(x),)

    def link(x: np.ndarray) -> Link | None:
        return Link(None, 0, x.shape) if x.ndim == 4 else None

    return linkable(run, link)
