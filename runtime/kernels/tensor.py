"""Host shape-manipulation kernels: views where NumPy allows, copies only where it must."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import jit
from .primitive_chain import Link, linkable
from .registry import TRANSPOSE_VIEW, ints, OutputShapes, KernelSpec, Run, norm_axis, register, unknown_outputs



def _reshape_target(shape: tuple[int, ...], target: list[int], allowzero: int) -> list[int]:
    out = list(target)
    if not allowzero:
        out = [shape[i] if d == 0 else d for i, d in enumerate(out)]
    return out


def _reshape_shape(spec: KernelSpec) -> OutputShapes:
    target = ints(spec.const(1))
    src = spec.shapes[0]
    if target is None:
        return [(None, spec.dtypes[0])]
    if src is not None and not spec.attr("allowzero", 0):
        target = [src[i] if d == 0 and i < len(src) else d for i, d in enumerate(target)]
    if -1 in target and src is not None and -1 not in src:
        known = int(np.prod([d for d in target if d != -1]))
        target = [int(np.prod(src)) // known if d == -1 else d for d in target]
    return [(tuple(target), spec.dtypes[0])]


@register("Reshape", _reshape_shape, params=frozenset({1}))
def reshape(spec: KernelSpec) -> Run:
    allowzero = spec.attr("allowzero", 0)
    static = ints(spec.const(1))
    fixed = static if static is not None and 0 not in static else None

    def run(x: np.ndarray, s: Any) -> tuple[np.ndarray, ...]:
        return (x.reshape(fixed if fixed is not None else _reshape_target(x.shape, ints(s) or [], allowzero)),)

    def link(x: np.ndarray, s: Any) -> Link | None:  # a view where x is contiguous (a chain checks it is)
        return Link(None, 0, run(x, s)[0].shape) if isinstance(x, np.ndarray) else None
    return linkable(run, link)


def _flatten_shape(spec: KernelSpec) -> OutputShapes:
    s = spec.shapes[0]
    if s is None:
        return [(None, spec.dtypes[0])]
    a = norm_axis(spec.attr("axis", 1), len(s))
    left, right = s[:a], s[a:]
    f = lambda d: -1 if -1 in d else int(np.prod(d))  # noqa: E731
    return [((f(left), f(right)), spec.dtypes[0])]


@register("Flatten", _flatten_shape)
def flatten(spec: KernelSpec) -> Run:
    axis = spec.attr("axis", 1)

    def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
        a = norm_axis(axis, x.ndim)
        return (x.reshape(int(np.prod(x.shape[:a])), -1),)

    return run


def _transpose_shape(spec: KernelSpec) -> OutputShapes:
    s = spec.shapes[0]
    if s is None:
        return [(None, spec.dtypes[0])]
    perm = spec.attr("perm") or list(range(len(s)))[::-1]
    return [(tuple(s[p] for p in perm), spec.dtypes[0])]


@register("Transpose", _transpose_shape)
def transpose(spec: KernelSpec) -> Run:
    perm = spec.attr("perm")
    if spec.attr(TRANSPOSE_VIEW, False):
        return lambda x: (np.transpose(x, perm),)
    # A contiguous result keeps later BLAS calls and reshapes cheap.
    return lambda x: (np.ascontiguousarray(np.transpose(x, perm)),)


def _axes(spec: KernelSpec, input_index: int = 1) -> list[int] | None:
    if spec.has(input_index):
        return ints(spec.const(input_index))
    return spec.attr("axes")


def _squeeze_shape(spec: KernelSpec) -> OutputShapes:
    s, axes = spec.shapes[0], _axes(spec)
    if s is None or (axes is None and spec.has(1)):
        return [(None, spec.dtypes[0])]
    if axes is None:
        return [(tuple(d for d in s if d != 1), spec.dtypes[0])]
    ax = {norm_axis(a, len(s)) for a in axes}
    return [(tuple(d for i, d in enumerate(s) if i not in ax), spec.dtypes[0])]


@register("Squeeze", _squeeze_shape, params=frozenset({1}))
def squeeze(spec: KernelSpec) -> Run:
    attr_axes = spec.attr("axes")
    const_axes = ints(spec.const(1)) if spec.has(1) else attr_axes
    if spec.shapes[0] is not None and const_axes is not None:
        rank = len(spec.shapes[0])
        drop = {norm_axis(a, rank) for a in const_axes}
        shape = [d for i, d in enumerate(spec.shapes[0]) if i not in drop]
        if shape.count(-1) <= 1 and all(spec.shapes[0][i] == 1 for i in drop):
            return lambda x, *_: (x.reshape(shape),)

    def run(x: np.ndarray, axes: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        ax = ints(axes) if axes is not None else attr_axes
        return (np.squeeze(x, axis=None if ax is None else tuple(ax)),)

    return run


def _unsqueeze_shape(spec: KernelSpec) -> OutputShapes:
    s, axes = spec.shapes[0], _axes(spec)
    if s is None or axes is None:
        return [(None, spec.dtypes[0])]
    out = list(s)
    rank = len(s) + len(axes)
    for a in sorted(norm_axis(a, rank) for a in axes):
        out.insert(a, 1)
    return [(tuple(out), spec.dtypes[0])]


@register("Unsqueeze", _unsqueeze_shape, params=frozenset({1}))
def unsqueeze(spec: KernelSpec) -> Run:
    attr_axes = spec.attr("axes")
    const_axes = ints(spec.const(1)) if spec.has(1) else attr_axes
    rank = None if spec.shapes[0] is None or const_axes is None else len(spec.shapes[0]) + len(const_axes)
    if rank is not None:
        shape = list(spec.shapes[0])  # type: ignore[arg-type]
        for a in sorted(norm_axis(a, rank) for a in const_axes):  # type: ignore[union-attr]
            shape.insert(a, 1)
        if shape.count(-1) <= 1:  # a view with the same data: one reshape, no axis work per call
            return lambda x, *_: (x.reshape(shape),)

    def run(x: np.ndarray, axes: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        ax = ints(axes) if axes is not None else attr_axes
        rank = x.ndim + len(ax)
        return (np.expand_dims(x, tuple(sorted(norm_axis(a, rank) for a in ax))),)

    return run


def _concat_shape(spec: KernelSpec) -> OutputShapes:
    shapes = spec.shapes
    if any(s is None for s in shapes):
        return [(None, spec.dtypes[0])]
    a = norm_axis(spec.attr("axis"), len(shapes[0]))  # type: ignore[arg-type]
    out = list(shapes[0])  # type: ignore[arg-type]
    sizes = [s[a] for s in shapes]  # type: ignore[index]
    out[a] = -1 if -1 in sizes else sum(sizes)
    for i in range(len(out)):
        if i != a and out[i] == -1:
            out[i] = next((s[i] for s in shapes if s[i] != -1), -1)  # type: ignore[index]
    return [(tuple(out), spec.dtypes[0])]


# A Concat along the last axis may hold `reserve` channels for the Concats after it and, with `grow`,
# write after its first operand when that is a view of such a buffer (passes/concat_chains.py).
CONCAT_RESERVE, CONCAT_GROW = "reserve", "grow"


def concat_grows_into_operand(op: str, attrs: dict[str, Any]) -> bool:
    """Whether a kernel's output may share memory with its first operand (a growing Concat's does)."""
    return op == "Concat" and bool(attrs.get(CONCAT_GROW))


def _buffer_of(x: np.ndarray, reserve: int) -> np.ndarray | None:
    """The buffer of `reserve` channels whose leading channels `x` is a view of, or None. The chain
    pass hands a growing Concat only the previous link's output: this kernel's `buf[..., :at]` or a
    fresh array, so a view with the buffer's strides starts at its first channel (asking both for
    their addresses would cost more than placing a small part)."""
    b = x.base
    if (type(b) is not np.ndarray or b.dtype != x.dtype or b.shape[:-1] != x.shape[:-1] or b.shape[-1] != reserve
            or x.strides != b.strides or not b.flags.c_contiguous):
        return None
    return b


@register("Concat", _concat_shape)
def concat(spec: KernelSpec) -> Run:
    axis = spec.attr("axis")
    reserve = int(spec.attr(CONCAT_RESERVE, 0))
    if not reserve:
        return lambda *xs: (np.concatenate(xs, axis=axis),)
    grow = bool(spec.attr(CONCAT_GROW, 0))

    def run(*xs: np.ndarray) -> tuple[np.ndarray, ...]:
        head = xs[0]
        rows, width = head.shape[:-1], sum(x.shape[-1] for x in xs)
        if width > reserve or any(x.shape[:-1] != rows or x.dtype != head.dtype for x in xs):
            return (np.concatenate(xs, axis=axis),)  # not the shapes the chain was planned for: a plain copy, or its error
        buf = _buffer_of(head, reserve) if grow else None
        at, parts = (head.shape[-1], xs[1:]) if buf is not None else (0, xs)
        if buf is None:
            buf = np.empty(rows + (reserve,), head.dtype)
        for x in parts:
            jit.place_columns(x, buf, at)
            at += x.shape[-1]
        return (buf[..., :at],)

    return run


SPLIT_SHAPES_KEPT = 64  # input shapes whose slices a Split keeps (dynamic dims bring new ones)


def _equal_parts(extent: int, n: int) -> list[int]:
    """ONNX Split without sizes: n parts of ceil(extent / n), the last one what remains."""
    size = -(-extent // n)
    return [min(size, extent - i * size) for i in range(n)]


def _split_shapes(spec: KernelSpec) -> OutputShapes:
    x = spec.shapes[0]
    if x is None:
        return unknown_outputs(spec)
    axis = norm_axis(spec.attr("axis", 0), len(x))
    sizes = spec.const(1) if spec.has(1) else spec.attr("split")
    if sizes is None:
        if x[axis] == -1 or spec.has(1):  # sizes computed at run time
            return unknown_outputs(spec)
        sizes = _equal_parts(x[axis], spec.n_outputs)
    return [(tuple(x[:axis]) + (int(d),) + tuple(x[axis + 1:]), spec.dtypes[0]) for d in sizes]


@register("Split", _split_shapes, params=frozenset({1}))
def split(spec: KernelSpec) -> Run:
    axis = spec.attr("axis", 0)
    attr_split = spec.attr("split")
    const_split = ints(spec.const(1)) if spec.has(1) and spec.const(1) is not None else None
    n = spec.n_outputs
    # views of the input, as np.split makes them, without its per-call bookkeeping
    cut: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[slice, ...]]] = {}

    def run(x: np.ndarray, sizes: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        parts = const_split if const_split is not None else ints(sizes) if sizes is not None else attr_split
        a = norm_axis(axis, x.ndim)
        if parts is None:
            parts = _equal_parts(x.shape[a], n)
        key = (x.shape, tuple(parts))
        index = cut.get(key)
        if index is None:
            if len(cut) >= SPLIT_SHAPES_KEPT:
                cut.clear()
            bounds = np.concatenate([[0], np.cumsum(parts)]).tolist()
            index = cut[key] = [(slice(None),) * a + (slice(lo, hi),) for lo, hi in zip(bounds[:-1], bounds[1:])]
        return tuple(x[i] for i in index)

    return run


def _slice_shape(spec: KernelSpec) -> OutputShapes:
    """Known where starts, ends, axes and steps are constants: a sliced dynamic dim stays dynamic."""
    x, consts = spec.shapes[0], spec.consts
    if x is None or len(consts) < 3 or consts[1] is None or consts[2] is None:
        return [(None, spec.dtypes[0])]
    st, en = ints(consts[1]), ints(consts[2])
    if len(consts) > 3 and spec.present[3] and consts[3] is None or len(consts) > 4 and spec.present[4] and consts[4] is None:
        return [(None, spec.dtypes[0])]
    ax = ints(consts[3]) if len(consts) > 3 and consts[3] is not None else list(range(len(st)))
    sp = ints(consts[4]) if len(consts) > 4 and consts[4] is not None else [1] * len(st)
    shape = list(x)
    for s, e, a, k in zip(st, en, ax, sp):
        a = norm_axis(a, len(shape))
        shape[a] = -1 if shape[a] < 0 else len(range(*slice(s, e, k).indices(shape[a])))
    return [(tuple(shape), spec.dtypes[0])]


@register("Slice", _slice_shape, params=frozenset({1, 2, 3, 4}))
def slice_(spec: KernelSpec) -> Run:
    def run(x: np.ndarray, starts: np.ndarray, ends: np.ndarray, axes: np.ndarray | None = None, steps: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        st, en = ints(starts), ints(ends)
        ax = ints(axes) if axes is not None else list(range(len(st)))
        sp = ints(steps) if steps is not None else [1] * len(st)
        index = [slice(None)] * x.ndim
        for s, e, a, k in zip(st, en, ax, sp):
            index[norm_axis(a, x.ndim)] = slice(s, e, k)
        return (x[tuple(index)],)

    return run


def _gather_shape(spec: KernelSpec) -> OutputShapes:
    s, i = spec.shapes
    if s is None or i is None:
        return [(None, spec.dtypes[0])]
    a = norm_axis(spec.attr("axis", 0), len(s))
    return [(tuple(s[:a]) + tuple(i) + tuple(s[a + 1 :]), spec.dtypes[0])]


@register("Gather", _gather_shape)
def gather(spec: KernelSpec) -> Run:
    axis = spec.attr("axis", 0)

    def run(x: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, ...]:
        a = norm_axis(axis, x.ndim)
        idx = np.asarray(idx)
        if idx.size and (idx.min() < -x.shape[a] or idx.max() >= x.shape[a]):
            raise IndexError(f"Gather indices out of range for axis {a} of size {x.shape[a]}")
        return (np.take(x, idx, axis=a),)

    return run


@register("GatherElements", lambda s: [(s.shapes[1], s.dtypes[0])])
def gather_elements(spec: KernelSpec) -> Run:
    axis = spec.attr("axis", 0)
    return lambda x, idx: (np.take_along_axis(x, idx.astype(np.int64), axis=axis),)


def _pad_shape(spec: KernelSpec) -> OutputShapes:
    s = spec.shapes[0]
    pads = ints(spec.const(1)) if spec.has(1) else spec.attr("pads")
    if s is None or pads is None or (spec.has(3) and spec.const(3) is None):
        return [(None, spec.dtypes[0])]
    axes = ints(spec.const(3)) if spec.has(3) else list(range(len(s)))
    out = list(s)
    for j, a in enumerate(axes):  # type: ignore[arg-type]
        a = norm_axis(a, len(s))
        if out[a] != -1:
            out[a] += pads[j] + pads[j + len(axes)]  # type: ignore[arg-type]
    return [(tuple(out), spec.dtypes[0])]


@register("Pad", _pad_shape, params=frozenset({1, 2, 3}))
def pad(spec: KernelSpec) -> Run:
    mode = spec.attr("mode", "constant")
    np_mode = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode]

    def run(x: np.ndarray, pads: np.ndarray | None = None, value: np.ndarray | None = None, axes: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        p = ints(pads) if pads is not None else spec.attr("pads")
        ax = ints(axes) if axes is not None else list(range(x.ndim))
        width = [(0, 0)] * x.ndim
        k = len(ax)
        for j, a in enumerate(ax):
            width[norm_axis(a, x.ndim)] = (p[j], p[j + k])
        if any(lo < 0 or hi < 0 for lo, hi in width):
            x = x[tuple(slice(max(0, -lo), x.shape[i] - max(0, -hi)) for i, (lo, hi) in enumerate(width))]
            width = [(max(0, lo), max(0, hi)) for lo, hi in width]
        if np_mode == "constant":
            cv = 0 if value is None or np.size(value) == 0 else np.asarray(value).item()
            return (np.pad(x, width, mode="constant", constant_values=cv),)
        return (np.pad(x, width, mode=np_mode),)  # type: ignore[call-overload]  # the stubs want a Literal mode

    return run


def _shape_shape(spec: KernelSpec) -> OutputShapes:
    s = spec.shapes[0]
    return [((len(s),) if s is not None else (-1,), np.dtype(np.int64))]


@register("Shape", _shape_shape, shape_only=True)
def shape(spec: KernelSpec) -> Run:
    start, end = spec.attr("start", 0), spec.attr("end")
    return lambda x: (np.array(x.shape[start:end], dtype=np.int64),)


@register("Size", lambda s: [((), np.dtype(np.int64))], shape_only=True)
def size(spec: KernelSpec) -> Run:
    return lambda x: (np.array(x.size, dtype=np.int64),)


@register("Expand", lambda s: [(None, s.dtypes[0])], params=frozenset({1}))
def expand(spec: KernelSpec) -> Run:
    return lambda x, s: (x * np.ones(ints(s), dtype=x.dtype),)


@register("Tile", lambda s: [(None, s.dtypes[0])], params=frozenset({1}))
def tile(spec: KernelSpec) -> Run:
    return lambda x, reps: (np.tile(x, ints(reps)),)


def _const_of_shape_dtype(spec: KernelSpec) -> np.ndarray:
    v = spec.attr("value")
    return np.zeros(1, np.float32) if v is None else np.asarray(v).reshape(-1)


@register("ConstantOfShape", lambda s: [(None if s.const(0) is None else tuple(ints(s.const(0)) or []), _const_of_shape_dtype(s).dtype)],
          params=frozenset({0}))
def constant_of_shape(spec: KernelSpec) -> Run:
    v = _const_of_shape_dtype(spec)
    return lambda s: (np.full(ints(s), v[0], dtype=v.dtype),)


def _constant_value(spec: KernelSpec) -> np.ndarray:
    for k in ("value", "value_float", "value_int", "value_floats", "value_ints"):
        if k in spec.attrs:
            v = spec.attrs[k]
            if k == "value_float" or k == "value_floats":
                return np.asarray(v, dtype=np.float32)
            if k == "value_int" or k == "value_ints":
                return np.asarray(v, dtype=np.int64)
            return np.asarray(v)
    raise ValueError(f"Constant node {spec.name}: no supported value attribute")


@register("Constant", lambda s: [(_constant_value(s).shape, _constant_value(s).dtype)])
def constant(spec: KernelSpec) -> Run:
    v = _constant_value(spec)
    return lambda: (v,)


@register("Range", lambda s: [((-1,), s.dtypes[0])], params=frozenset({0, 1, 2}))
def range_(spec: KernelSpec) -> Run:
    return lambda a, b, d: (np.arange(a.item(), b.item(), d.item(), dtype=a.dtype),)


@register("NonZero", lambda s: [(None, np.dtype(np.int64))])
def nonzero(spec: KernelSpec) -> Run:
    return lambda x: (np.array(np.nonzero(x), dtype=np.int64),)


@register("TopK", lambda s: [(None, s.dtypes[0]), (None, np.dtype(np.int64))], params=frozenset({1}))
def topk(spec: KernelSpec) -> Run:
    axis, largest = spec.attr("axis", -1), spec.attr("largest", 1)  # results are always sorted

    def run(x: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, ...]:
        kk = int(np.asarray(k).reshape(-1)[0])
        key = -x if largest else x
        idx = np.argsort(key, axis=axis, kind="stable")
        idx = np.take(idx, np.arange(kk), axis=axis)
        return (np.take_along_axis(x, idx, axis=axis), idx.astype(np.int64))

    return run
