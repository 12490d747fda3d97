"""Resizing (Resize, opsets 11 to 19) and depth/space rearrangement of images.

Resize is separable: every mode is a per-axis map from output to input positions, nearest an
integer index per output position, linear two weighted taps, cubic four. Each resized axis is one
gather pass (np.take: whole rows for all but the last axis) plus, for linear/cubic, a weighted sum
of the taps; the taps and weights of an axis depend only on its sizes, so they are computed once
per shape (in the factory when the output size is static). An integer nearest upscale (Keras
UpSampling2D, tf.image.resize nearest) needs no index at all: strided copies of the input.

Coordinates and rounding follow onnxruntime's CPU kernel in float32, so nearest picks the same
pixel at exact halves; linear and cubic agree with it to rounding. Unlike onnxruntime, linear and
cubic resize any set of axes (onnxruntime only the last two or three).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import blas
from ..errors import UnsupportedOpError
from .registry import KernelSpec, OutputShapes, Run, ints, norm_axis, register

MODES = ("nearest", "linear", "cubic")
TRANSFORMS = ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric",
              "tf_half_pixel_for_nn", "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")
POLICIES = ("stretch", "not_larger", "not_smaller")
_F = np.float32
CHUNK_BYTES = 1 << 20  # larger outputs resize a few batch items at a time
DENSE_TAP_SPAN = 32  # a last axis up to this many input positions per tap resizes as a GEMM


# ---------------------------------------------------------------- attributes

@dataclass(frozen=True)
class ResizeAttrs:
    mode: str
    transform: str
    nearest: str
    cubic_a: float
    exclude_outside: bool
    extrapolation: float
    axes: tuple[int, ...] | None  # opset 18: the axes scales/sizes/roi speak of
    policy: str


def _text(spec: KernelSpec, key: str, default: str) -> str:
    v = spec.attr(key, default)
    return v.decode() if isinstance(v, bytes) else str(v)


def _refuse(spec: KernelSpec, what: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"node {spec.name!r}: {spec.op} {what}")


def _choice(spec: KernelSpec, key: str, default: str, allowed: tuple[str, ...]) -> str:
    v = _text(spec, key, default)
    if v not in allowed:
        raise _refuse(spec, f"{key}={v!r} is not supported; supported: {', '.join(allowed)}")
    return v


def resize_attrs(spec: KernelSpec) -> ResizeAttrs:
    """The node's attributes, checked: what this kernel cannot compute is refused here, by name."""
    if int(spec.attr("antialias", 0)):
        raise _refuse(spec, "antialias=1 (opset 18) is not supported; supported: antialias=0")
    if len(spec.present) == 2:
        raise _refuse(spec, "with two inputs (the opset-10 form Resize(X, scales)) is not supported; "
                            "supported: the opset 11-19 forms Resize(X, roi, scales, sizes)")
    mode = _choice(spec, "mode", "nearest", MODES)
    transform = _choice(spec, "coordinate_transformation_mode", "half_pixel", TRANSFORMS)
    dt = spec.dtypes[0] if spec.dtypes else None
    if mode != "nearest" and dt is not None and np.dtype(dt).kind != "f":
        raise _refuse(spec, f"mode={mode!r} on {np.dtype(dt)} input is not supported; supported: floating point (nearest takes any type)")
    if transform == "tf_crop_and_resize" and not spec.has(1):
        raise _refuse(spec, "coordinate_transformation_mode='tf_crop_and_resize' needs the roi input, which is absent")
    axes = spec.attr("axes")
    if axes is not None and len(set(axes)) != len(axes):
        raise _refuse(spec, f"axes={list(axes)} repeats an axis")
    return ResizeAttrs(
        mode=mode,
        transform=transform,
        nearest=_choice(spec, "nearest_mode", "round_prefer_floor", NEAREST_MODES),
        cubic_a=float(spec.attr("cubic_coeff_a", -0.75)),
        exclude_outside=bool(spec.attr("exclude_outside", 0)),
        extrapolation=float(spec.attr("extrapolation_value", 0.0)),
        axes=None if axes is None else tuple(int(a) for a in axes),
        policy=_choice(spec, "keep_aspect_ratio_policy", "stretch", POLICIES),
    )


def _given(v: np.ndarray | None) -> np.ndarray | None:
    """An optional operand as given; converters write absent scales/sizes as empty tensors."""
    return None if v is None or np.size(v) == 0 else np.asarray(v)


# ---------------------------------------------------------------- output size

def _axes(attrs: ResizeAttrs, rank: int) -> list[int]:
    return list(range(rank)) if attrs.axes is None else [norm_axis(a, rank) for a in attrs.axes]


def output_size(attrs: ResizeAttrs, in_shape: tuple[int, ...], scales: np.ndarray | None,
                sizes: np.ndarray | None) -> tuple[list[int], list[float]]:
    """(output dims, per-axis float32 scales) the way onnxruntime derives them: floor(scale*in)
    from scales; from sizes, scale = out/in, adjusted by keep_aspect_ratio_policy."""
    rank = len(in_shape)
    axes = _axes(attrs, rank)
    out, scale = list(in_shape), [1.0] * rank
    if scales is not None:
        vals = [float(v) for v in np.asarray(scales, dtype=_F).reshape(-1)]
        if len(vals) != len(axes):
            raise ValueError(f"scales has {len(vals)} values for {len(axes)} axes of a rank-{rank} input")
        for a, v in zip(axes, vals):
            if v <= 0:
                raise ValueError(f"scales must be positive, got {vals}")
            scale[a] = v
            out[a] = int(_F(v) * _F(in_shape[a]))
        return out, scale
    if sizes is None:
        raise ValueError("neither scales nor sizes is given")
    dims = ints(sizes)
    if len(dims) != len(axes):
        raise ValueError(f"sizes has {len(dims)} values for {len(axes)} axes of a rank-{rank} input")
    for a, d in zip(axes, dims):
        out[a] = d
        scale[a] = 1.0 if in_shape[a] == 0 else float(_F(d) / _F(in_shape[a]))
    if attrs.policy != "stretch":
        pick = min if attrs.policy == "not_larger" else max
        s = pick(scale[a] for a in axes)
        for a in axes:
            scale[a] = s
            out[a] = int(np.floor(np.float64(_F(s) * _F(in_shape[a])) + 0.5))  # round, halves up
    return out, scale


def _resize_shape(spec: KernelSpec) -> OutputShapes:
    xs = spec.shapes[0]
    dtype = spec.dtypes[0]
    if xs is None:
        return [(None, dtype)]
    try:
        attrs = resize_attrs(spec)
    except UnsupportedOpError:
        return [(None, dtype)]
    rank = len(xs)
    scales = _given(spec.const(2)) if spec.has(2) else None
    sizes = _given(spec.const(3)) if spec.has(3) else None
    axes = _axes(attrs, rank)
    if scales is None and sizes is None or (sizes is not None and attrs.policy != "stretch" and any(xs[a] < 0 for a in axes)):
        return [(tuple(-1 if a in axes else d for a, d in enumerate(xs)), dtype)]
    known = tuple(max(d, 1) for d in xs)
    try:
        out, _ = output_size(attrs, known, scales, sizes)
    except ValueError:
        return [(None, dtype)]
    return [(tuple(-1 if xs[a] < 0 and (scales is not None or a not in axes) else out[a] for a in range(rank)), dtype)]


# ---------------------------------------------------------------- per-axis taps

def original_coords(transform: str, n_in: int, n_out: int, scale: float, roi: tuple[float, float]) -> np.ndarray:
    """Input coordinate of every output position along one axis, in float32 as onnxruntime computes it."""
    o = np.arange(n_out, dtype=_F)
    s, half = _F(scale), _F(0.5)
    if transform == "asymmetric":
        return o / s
    if transform == "tf_half_pixel_for_nn":
        return (o + half) / s
    if transform == "pytorch_half_pixel":
        return (o + half) / s - half if n_out > 1 else np.zeros(n_out, _F)
    if transform == "align_corners":
        return np.zeros(n_out, _F) if n_out == 1 else o * _F(n_in - 1) / _F(n_out - 1)
    if transform == "tf_crop_and_resize":
        start, end = _F(roi[0]), _F(roi[1])
        if n_out == 1:
            return np.full(1, 0.5 * (float(start) + float(end)) * (n_in - 1), dtype=_F)
        return start * _F(n_in - 1) + o * (end - start) * _F(n_in - 1) / _F(n_out - 1)
    if transform == "half_pixel_symmetric":
        adjustment = _F(n_out) / (s * _F(n_in))
        offset = np.float64(_F(n_in) / _F(2) * (_F(1) - adjustment))
        return (offset + (o.astype(np.float64) + 0.5) / np.float64(s) - 0.5).astype(_F)  # in double, as onnxruntime
    return (o + half) / s - half  # half_pixel


def _nearest_index(x: np.ndarray, how: str) -> np.ndarray:
    if how == "floor":
        r = np.floor(x)
    elif how == "ceil":
        r = np.ceil(x)
    else:  # exact halves go down (round_prefer_floor) or up; everything else to the nearest
        half = x == np.trunc(x) + _F(0.5)
        r = np.where(half, np.floor(x) if how == "round_prefer_floor" else np.ceil(x), np.round(x))
    return r.astype(np.int64)


def cubic_coeffs(s: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution weights (4, n) of the taps at -1, 0, 1, 2 for fractions s in [0, 1)."""
    a_ = _F(a)
    s = np.abs(s).astype(_F)
    s1, r1, r2 = s + _F(1), _F(1) - s, _F(2) - s
    return np.stack([
        ((a_ * s1 - 5 * a_) * s1 + 8 * a_) * s1 - 4 * a_,
        ((a_ + 2) * s - (a_ + 3)) * s * s + 1,
        ((a_ + 2) * r1 - (a_ + 3)) * r1 * r1 + 1,
        ((a_ * r2 - 5 * a_) * r2 + 8 * a_) * r2 - 4 * a_,
    ]).astype(_F)


@dataclass(frozen=True)
class AxisTaps:
    """How one axis resizes: out[o] = sum_t weight[t, o] * in[index[t, o]] (no weights: nearest)."""

    axis: int
    index: np.ndarray  # (taps, n_out) int64, in range
    weight: np.ndarray | None  # (taps, n_out) float32
    outside: np.ndarray | None  # (n_out,) bool: tf_crop_and_resize positions that take extrapolation_value
    repeat: int = 0  # nearest integer upscale: index = o // repeat over the whole axis
    dense: np.ndarray | None = None  # (n_in, n_out) float32: the last axis as one GEMM, where it is short

    def with_dense(self, n_in: int) -> AxisTaps:
        """The taps as a dense (n_in, n_out) matrix: on a short last axis one GEMM beats a gather
        per tap (np.take on the last axis moves single elements)."""
        if self.weight is None:
            return self
        m = np.zeros((n_in, self.index.shape[1]), dtype=_F)
        cols = np.arange(self.index.shape[1])
        for k in range(len(self.index)):
            np.add.at(m, (self.index[k], cols), self.weight[k])
        return AxisTaps(self.axis, self.index, self.weight, self.outside, self.repeat, m)


def axis_taps(attrs: ResizeAttrs, axis: int, n_in: int, n_out: int, scale: float, roi: tuple[float, float]) -> AxisTaps:
    x = original_coords(attrs.transform, n_in, n_out, scale, roi)
    outside = None
    if attrs.transform == "tf_crop_and_resize":
        mask = (x < 0) | (x > _F(n_in - 1))
        outside = mask if mask.any() else None
    if attrs.mode == "nearest":
        idx = np.clip(_nearest_index(x, attrs.nearest), 0, n_in - 1)
        f = n_out // n_in
        repeat = f if f >= 2 and n_out == f * n_in and outside is None and np.array_equal(idx, np.arange(n_out) // f) else 0
        return AxisTaps(axis, idx[None], None, outside, repeat)
    if attrs.mode == "linear":
        xc = np.clip(x, _F(0), _F(n_in - 1))
        i0 = np.minimum(xc.astype(np.int64), n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        w0, w1 = np.abs(xc - i1.astype(_F)), np.abs(xc - i0.astype(_F))
        same = i0 == i1
        w0[same], w1[same] = _F(0.5), _F(0.5)
        return AxisTaps(axis, np.stack([i0, i1]), np.stack([w0, w1]).astype(_F), outside)
    base = np.floor(x)
    coeffs = cubic_coeffs(x - base, attrs.cubic_a)
    raw = base.astype(np.int64)[None] + np.arange(-1, 3)[:, None]
    if attrs.exclude_outside:
        coeffs = np.where((raw < 0) | (raw >= n_in), _F(0), coeffs)
        coeffs = (coeffs / coeffs.sum(axis=0, keepdims=True)).astype(_F)
    return AxisTaps(axis, np.clip(raw, 0, n_in - 1), coeffs, outside)


# ---------------------------------------------------------------- applying the taps

def _along(v: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """A per-position vector of one axis, shaped to broadcast against a rank-`rank` tensor."""
    return v.reshape((-1,) + (1,) * (rank - 1 - axis))


def _repeat(x: np.ndarray, axis: int, f: int, out: np.ndarray | None) -> np.ndarray:
    """Nearest integer upscale of one axis: f strided copies of the input (whole rows when not last)."""
    shape = x.shape[:axis] + (x.shape[axis], f) + x.shape[axis + 1:]
    y = np.empty(shape, dtype=x.dtype) if out is None else out.reshape(shape)
    for j in range(f):
        y[(slice(None),) * (axis + 1) + (j,)] = x
    return y.reshape(x.shape[:axis] + (x.shape[axis] * f,) + x.shape[axis + 1:])


def apply_axis(x: np.ndarray, t: AxisTaps, out: np.ndarray | None = None) -> np.ndarray:
    """One axis resized; into `out` (C-contiguous, of the result's shape) when given."""
    if t.repeat:
        return _repeat(x, t.axis, t.repeat, out)
    if t.dense is not None and t.axis == x.ndim - 1 and x.dtype in (np.float32, np.float64):
        m = t.dense if x.dtype == np.float32 else t.dense.astype(x.dtype)
        flat = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        y2 = blas.gemm(flat, m, None if out is None else out.reshape(-1, m.shape[1]))
        return y2.reshape(x.shape[:-1] + (m.shape[1],))
    y = np.take(x, t.index[0], axis=t.axis, out=out, mode="clip")  # indices are in range; "raise" buffers `out`
    if t.weight is None:
        return y
    rank = x.ndim
    y *= _along(t.weight[0].astype(y.dtype), t.axis, rank)
    for k in range(1, len(t.index)):
        term = np.take(x, t.index[k], axis=t.axis, mode="clip")
        term *= _along(t.weight[k].astype(y.dtype), t.axis, rank)
        y += term
    return y


@dataclass(frozen=True)
class ResizePlan:
    out: tuple[int, ...]
    steps: tuple[AxisTaps, ...]  # in the order they run: the most shrinking axis first


def make_plan(attrs: ResizeAttrs, in_shape: tuple[int, ...], out: list[int], scale: list[float],
              roi: tuple[float, ...] | None) -> ResizePlan:
    rank = len(in_shape)
    crop = attrs.transform == "tf_crop_and_resize"
    steps = []
    for a in range(rank):
        r = (roi[a], roi[rank + a]) if roi is not None else (0.0, 1.0)
        if scale[a] == 1.0 and out[a] == in_shape[a] and (not crop or r == (0.0, 1.0)):
            continue  # nothing to do: every transform maps o to o here
        if in_shape[a] == 0 or out[a] == 0:
            continue
        taps = axis_taps(attrs, a, in_shape[a], out[a], scale[a], r)
        if a == rank - 1 and taps.weight is not None and in_shape[a] <= DENSE_TAP_SPAN * len(taps.index):
            taps = taps.with_dense(in_shape[a])
        steps.append(taps)
    # Shrinking axes first keeps the intermediates small; between equals the last axis first,
    # since its gather is per element while the others' copy whole rows.
    steps.sort(key=lambda t: (out[t.axis] / max(1, in_shape[t.axis]), -t.axis))
    return ResizePlan(tuple(out), tuple(steps))


def run_plan(x: np.ndarray, plan: ResizePlan, extrapolation: float) -> np.ndarray:
    if 0 in plan.out or 0 in x.shape:
        return np.zeros(plan.out, dtype=x.dtype)
    if not plan.steps:
        y = x.copy()
    elif x.ndim > 1 and all(t.axis > 0 for t in plan.steps) and x.shape[0] > 1 \
            and math.prod(plan.out) * x.itemsize > CHUNK_BYTES:
        # Batch items one by one: each one's intermediates stay in cache between the passes.
        y = np.empty(plan.out, dtype=x.dtype)
        step = max(1, CHUNK_BYTES // (math.prod(plan.out[1:]) * x.itemsize))
        for b in range(0, x.shape[0], step):
            _passes(x[b:b + step], plan, y[b:b + step])
    else:
        y = _passes(x, plan)
    for t in plan.steps:
        if t.outside is not None:
            y[(slice(None),) * t.axis + (t.outside,)] = extrapolation
    return y


def _passes(x: np.ndarray, plan: ResizePlan, out: np.ndarray | None = None) -> np.ndarray:
    """Every step in turn, the last one into `out` when given."""
    for i, t in enumerate(plan.steps):
        x = apply_axis(x, t, out if i == len(plan.steps) - 1 else None)
    return x


def _roi(attrs: ResizeAttrs, roi: np.ndarray | None, rank: int) -> tuple[float, ...] | None:
    """The full-rank roi (starts..., ends...) of tf_crop_and_resize; None for the other transforms."""
    if attrs.transform != "tf_crop_and_resize":
        return None
    vals = [float(v) for v in np.asarray(roi, dtype=_F).reshape(-1)] if roi is not None else []
    axes = _axes(attrs, rank)
    if len(vals) != 2 * len(axes):
        raise ValueError(f"roi has {len(vals)} values; tf_crop_and_resize over {len(axes)} axes needs {2 * len(axes)}")
    full = [0.0] * rank + [1.0] * rank
    for i, a in enumerate(axes):
        full[a], full[rank + a] = vals[i], vals[len(axes) + i]
    return tuple(full)


@register("Resize", _resize_shape, params=frozenset({1, 2, 3}))
def resize(spec: KernelSpec) -> Run:
    attrs = resize_attrs(spec)

    @functools.lru_cache(maxsize=32)
    def plan_for(in_shape: tuple[int, ...], scales: tuple[float, ...] | None, sizes: tuple[int, ...] | None,
                 roi: tuple[float, ...] | None) -> ResizePlan:
        out, scale = output_size(attrs, in_shape, None if scales is None else np.array(scales, _F),
                                 None if sizes is None else np.array(sizes, np.int64))
        if min(out, default=1) < 0:
            raise ValueError(f"output dims {out} are negative")
        return make_plan(attrs, in_shape, out, scale, _roi(attrs, None if roi is None else np.array(roi, _F), len(in_shape)))

    crop = attrs.transform == "tf_crop_and_resize"

    def key(x_shape: tuple[int, ...], roi: Any, scales: Any, sizes: Any) -> tuple[Any, ...]:
        """plan_for's arguments: hashable, and only what the plan depends on."""
        sc, sz = _given(scales), _given(sizes)
        if (sc is None) == (sz is None):
            raise ValueError(f"exactly one of scales and sizes must be given, got {'both' if sc is not None else 'neither'}")
        r = tuple(float(v) for v in np.asarray(roi, _F).reshape(-1)) if crop and roi is not None else None
        return (x_shape, None if sc is None else tuple(float(v) for v in sc.reshape(-1)),
                None if sz is None else tuple(ints(sz)), r)

    xs = spec.shapes[0]
    operands = [spec.const(i) if spec.has(i) else None for i in (1, 2, 3)]
    needed = (1, 2, 3) if crop else (2, 3)
    if xs is not None and -1 not in xs and all(not spec.has(i) or spec.const(i) is not None for i in needed):
        try:  # static output size: the taps and weights are built now, once
            plan_for(*key(tuple(xs), *operands))
        except ValueError as e:
            raise _refuse(spec, f"operands do not fit: {e}") from None

    def run(x: np.ndarray, roi: np.ndarray | None = None, scales: np.ndarray | None = None,
            sizes: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        try:
            plan = plan_for(*key(tuple(x.shape), roi, scales, sizes))
        except ValueError as e:
            raise ValueError(f"Resize {spec.name}: {e}") from None
        return (run_plan(x, plan, attrs.extrapolation),)

    return run


# ---------------------------------------------------------------- DepthToSpace / SpaceToDepth

def _blocksize(spec: KernelSpec) -> int:
    b = _block_or_none(spec)
    if b is None:
        raise _refuse(spec, f"blocksize={spec.attr('blocksize')!r}: expected a positive integer")
    xs = spec.shapes[0] if spec.shapes else None
    if xs is not None and len(xs) != 4:
        raise _refuse(spec, f"on a rank-{len(xs)} input is not supported; supported: 4-D NCHW")
    return b


def _block_or_none(spec: KernelSpec) -> int | None:
    b = spec.attr("blocksize")
    return int(b) if isinstance(b, (int, np.integer)) and b >= 1 else None


def _d2s_shape(spec: KernelSpec) -> OutputShapes:
    xs, b = spec.shapes[0], _block_or_none(spec)
    if xs is None or len(xs) != 4 or b is None:
        return [(None, spec.dtypes[0])]
    n, c, h, w = xs
    return [((n, -1 if c < 0 else c // (b * b), -1 if h < 0 else h * b, -1 if w < 0 else w * b), spec.dtypes[0])]


@register("DepthToSpace", _d2s_shape)
def depth_to_space(spec: KernelSpec) -> Run:
    """b*b strided copies of contiguous channel blocks: NumPy's own 6-D transpose copy walks an
    inner axis of length b and is several times slower."""
    b = _blocksize(spec)
    mode = _choice(spec, "mode", "DCR", ("DCR", "CRD"))

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.ndim != 4 or x.shape[1] % (b * b):
            raise ValueError(f"DepthToSpace {spec.name}: input {x.shape} must be NCHW with channels a multiple of {b * b}")
        n, c, h, w = x.shape
        co = c // (b * b)
        src = x.reshape(n, b, b, co, h, w) if mode == "DCR" else x.reshape(n, co, b, b, h, w)
        y = np.empty((n, co, h, b, w, b), dtype=x.dtype)
        for i in range(b):
            for j in range(b):
                y[:, :, :, i, :, j] = src[:, i, j] if mode == "DCR" else src[:, :, i, j]
        return (y.reshape(n, co, h * b, w * b),)

    return run


def _s2d_shape(spec: KernelSpec) -> OutputShapes:
    xs, b = spec.shapes[0], _block_or_none(spec)
    if xs is None or len(xs) != 4 or b is None:
        return [(None, spec.dtypes[0])]
    n, c, h, w = xs
    return [((n, -1 if c < 0 else c * b * b, -1 if h < 0 else h // b, -1 if w < 0 else w // b), spec.dtypes[0])]


@register("SpaceToDepth", _s2d_shape)
def space_to_depth(spec: KernelSpec) -> Run:
    b = _blocksize(spec)

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        if x.ndim != 4 or x.shape[2] % b or x.shape[3] % b:
            raise ValueError(f"SpaceToDepth {spec.name}: input {x.shape} must be NCHW with height and width multiples of {b}")
        n, c, h, w = x.shape
        src = x.reshape(n, c, h // b, b, w // b, b)
        y = np.empty((n, b, b, c, h // b, w // b), dtype=x.dtype)
        for i in range(b):
            for j in range(b):
                y[:, i, j] = src[:, :, :, i, :, j]
        return (y.reshape(n, c * b * b, h // b, w // b),)

    return run
