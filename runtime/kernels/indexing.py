"""Gather/scatter-style indexing, cumulative sums, one-hot, triangles, sequence reversal and non-max suppression.

Index arithmetic is done once per call on whole index arrays (linear offsets, broadcast grids), so
the data moves in one NumPy gather or scatter. No Python loop runs per element or per box pair:
Trilu loops over matrix rows (each a slice over the whole batch), non-max suppression over blocks
of candidates. Out-of-range indices are errors, as in onnxruntime, never wrapped or clipped silently.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from .registry import KernelSpec, OutputShapes, Run, check_attrs, flag, norm_axis, refuse, register, same_as_input


# ---------------------------------------------------------------- shared checks

def scalar_int(x: np.ndarray) -> int:
    """A scalar or one-element operand (converters emit both forms) as a Python int."""
    a = np.asarray(x).reshape(-1)
    if a.size != 1:
        raise ValueError(f"expected a scalar or one-element tensor, got shape {np.shape(x)}")
    return int(a[0])


def _rank(spec: KernelSpec, i: int) -> int | None:
    s = spec.shapes[i] if i < len(spec.shapes) else None
    return None if s is None else len(s)


def _dtype(spec: KernelSpec, i: int) -> np.dtype | None:
    return spec.dtypes[i] if i < len(spec.dtypes) else None


def _known(*dims: int) -> int:
    return next((d for d in dims if d != -1), -1)


def _size(dims: tuple[int, ...]) -> int:
    return int(np.prod(dims, dtype=np.int64))


def _index_array(idx: np.ndarray, what: str) -> np.ndarray:
    a = np.asarray(idx)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{what} must be an integer tensor, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def _wrap(idx: np.ndarray, size: np.ndarray | int, what: str) -> np.ndarray:
    """Negative indices counted from the end; anything outside [-size, size) is an error."""
    bad = (idx < -size) | (idx >= size)
    if bad.any():
        where = tuple(int(v) for v in np.argwhere(bad)[0])
        raise IndexError(f"{what} index {int(idx[where])} at {where} is out of range for size {np.broadcast_to(size, idx.shape)[where]}")
    return np.where(idx < 0, idx + size, idx)


def _row_offsets(idx: np.ndarray, dims: tuple[int, ...], what: str) -> np.ndarray:
    """(..., k) index tuples into `dims` as C-order linear offsets (...,)."""
    if not dims:
        return np.zeros(idx.shape[:-1], dtype=np.int64)
    d = np.asarray(dims, dtype=np.int64)
    idx = _wrap(idx, d, what)
    strides = np.ones(len(dims), dtype=np.int64)
    strides[:-1] = np.cumprod(d[::-1])[:-1][::-1]
    return idx @ strides


# ---------------------------------------------------------------- CumSum

@register("CumSum", same_as_input, params=frozenset({1}))
def cumsum(spec: KernelSpec) -> Run:
    """Accumulates in the input's dtype, sequentially along the axis, as onnxruntime does."""
    check_attrs(spec, {"exclusive", "reverse"})
    exclusive, reverse = flag(spec, "exclusive"), flag(spec, "reverse")
    dt = _dtype(spec, 0)
    if dt is not None and dt.kind not in "iuf":
        raise refuse(spec, f"input dtype {dt}", "integer and floating-point inputs")
    axis_const, rank = spec.const(1), _rank(spec, 0)
    if axis_const is not None and np.size(axis_const) == 1 and rank is not None and not -rank <= scalar_int(axis_const) < rank:
        raise refuse(spec, f"axis {scalar_int(axis_const)} for a rank-{rank} input", f"axis in [{-rank}, {rank - 1}]")

    def run(x: np.ndarray, axis: np.ndarray) -> tuple[np.ndarray, ...]:
        a = scalar_int(axis)
        if not -x.ndim <= a < x.ndim:
            raise ValueError(f"CumSum {spec.name}: axis {a} is out of range for rank {x.ndim}")
        a = norm_axis(a, x.ndim)
        out = np.empty_like(x)
        src, dst = (np.flip(x, a), np.flip(out, a)) if reverse else (x, out)
        if not exclusive:
            np.cumsum(src, axis=a, dtype=x.dtype, out=dst)
            return (out,)
        head = [slice(None)] * x.ndim
        head[a] = slice(0, 1)
        dst[tuple(head)] = 0
        if x.shape[a] > 1:
            head[a] = slice(1, None)
            tail = list(head)
            tail[a] = slice(0, -1)
            np.cumsum(src[tuple(tail)], axis=a, dtype=x.dtype, out=dst[tuple(head)])
        return (out,)

    return run


# ---------------------------------------------------------------- GatherND

def _gather_nd_shape(spec: KernelSpec) -> OutputShapes:
    ds, ix = spec.shapes[0], spec.shapes[1]
    b = spec.attr("batch_dims", 0)
    if ds is None or ix is None or not ix or ix[-1] < 0 or not isinstance(b, int) or b < 0:
        return [(None, spec.dtypes[0])]
    k = ix[-1]
    if b + k > len(ds) or b >= len(ix):
        return [(None, spec.dtypes[0])]
    batch = tuple(_known(d, i) for d, i in zip(ds[:b], ix[:b]))
    return [(batch + tuple(ix[b:-1]) + tuple(ds[b + k:]), spec.dtypes[0])]


@register("GatherND", _gather_nd_shape)
def gather_nd(spec: KernelSpec) -> Run:
    """All index tuples become linear row offsets into a (batches * indexed, rest) view: one take."""
    check_attrs(spec, {"batch_dims"})
    b = spec.attr("batch_dims", 0)
    if not isinstance(b, int) or b < 0:
        raise refuse(spec, f"batch_dims={b!r}", "batch_dims >= 0")
    r_data, r_idx = _rank(spec, 0), _rank(spec, 1)
    if r_idx is not None and b >= r_idx or r_data is not None and b >= r_data:
        raise refuse(spec, f"batch_dims={b} with data rank {r_data} and indices rank {r_idx}",
                     "batch_dims smaller than both ranks")

    def run(data: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, ...]:
        idx = _index_array(indices, f"GatherND {spec.name}: indices")
        k = idx.shape[-1]
        if b + k > data.ndim or data.shape[:b] != idx.shape[:b]:
            raise ValueError(f"GatherND {spec.name}: indices {idx.shape} (batch_dims={b}) do not fit data {data.shape}")
        batch, dims, rest = data.shape[:b], data.shape[b:b + k], data.shape[b + k:]
        nb, nd, m = _size(batch), _size(dims), _size(idx.shape[b:-1])
        rows = _row_offsets(idx.reshape(nb, m, k), dims, f"GatherND {spec.name}")
        rows += (np.arange(nb, dtype=np.int64) * nd)[:, None]
        src = data.reshape(nb * nd, _size(rest))
        return (np.take(src, rows, axis=0).reshape(batch + idx.shape[b:-1] + rest),)

    return run


# ---------------------------------------------------------------- ScatterND / ScatterElements

_REDUCTIONS: dict[str, np.ufunc | None] = {
    "none": None, "add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
}


def _reduction(spec: KernelSpec) -> np.ufunc | None:
    r = spec.attr("reduction", "none")
    if r not in _REDUCTIONS:
        raise refuse(spec, f"reduction={r!r}", ", ".join(_REDUCTIONS))
    dt = _dtype(spec, 0)
    if r != "none" and dt is not None and dt.kind not in "biuf":
        raise refuse(spec, f"reduction={r!r} on {dt} data", "reductions on bool, integer and floating-point data")
    return _REDUCTIONS[r]


def _scatter_target(spec: KernelSpec, data: np.ndarray) -> np.ndarray:
    """The output buffer: the data operand itself where it dies here, else a copy."""
    if 0 in spec.inplace and data.flags.writeable and data.flags.c_contiguous:
        return data
    return data.copy()


def _scatter_rows(out: np.ndarray, rows: np.ndarray, upd: np.ndarray, ufunc: np.ufunc | None) -> None:
    """Scatter (rows, width) updates onto rows of a (n, width) view. Reductions apply updates one
    element at a time in index order (onnxruntime's order, so float sums round the same); on
    flat element offsets, where NumPy's ufunc.at has its fast path."""
    if ufunc is None:
        out[rows] = upd  # duplicate indices: the last update wins, as in onnxruntime
    elif out.shape[1] == 1:
        ufunc.at(out.reshape(-1), rows, upd.reshape(-1))
    else:
        width = out.shape[1]
        flat = (rows[:, None] * width + np.arange(width, dtype=np.int64)).reshape(-1)
        ufunc.at(out.reshape(-1), flat, upd.reshape(-1))


@register("ScatterND", same_as_input)
def scatter_nd(spec: KernelSpec) -> Run:
    """Updates land on linear rows of a (indexed, rest) view of the output."""
    check_attrs(spec, {"reduction"})
    ufunc = _reduction(spec)

    def run(data: np.ndarray, indices: np.ndarray, updates: np.ndarray) -> tuple[np.ndarray, ...]:
        idx = _index_array(indices, f"ScatterND {spec.name}: indices")
        k = idx.shape[-1]
        dims, rest = data.shape[:k], data.shape[k:]
        if k > data.ndim or updates.shape != idx.shape[:-1] + rest:
            raise ValueError(f"ScatterND {spec.name}: updates {updates.shape} and indices {idx.shape} do not fit data {data.shape}")
        rows = _row_offsets(idx.reshape(-1, k), dims, f"ScatterND {spec.name}")
        out = _scatter_target(spec, data)
        _scatter_rows(out.reshape(_size(dims), _size(rest)), rows, updates.reshape(rows.size, _size(rest)), ufunc)
        return (out,)

    return run


@register("ScatterElements", same_as_input)
def scatter_elements(spec: KernelSpec) -> Run:
    """Each update's output position becomes one linear offset; the scatter runs on the flat output."""
    check_attrs(spec, {"axis", "reduction"})
    axis = spec.attr("axis", 0)
    ufunc = _reduction(spec)
    rank = _rank(spec, 0)
    if rank is not None and not -rank <= axis < rank:
        raise refuse(spec, f"axis {axis} for rank-{rank} data", f"axis in [{-rank}, {rank - 1}]")

    def run(data: np.ndarray, indices: np.ndarray, updates: np.ndarray) -> tuple[np.ndarray, ...]:
        idx = _index_array(indices, f"ScatterElements {spec.name}: indices")
        a = norm_axis(axis, data.ndim)
        if idx.shape != updates.shape or idx.ndim != data.ndim or any(
                i > d for j, (i, d) in enumerate(zip(idx.shape, data.shape)) if j != a):
            raise ValueError(f"ScatterElements {spec.name}: indices {idx.shape} and updates {updates.shape} do not fit data {data.shape}")
        strides = [_size(data.shape[j + 1:]) for j in range(data.ndim)]
        flat = _wrap(idx, data.shape[a], f"ScatterElements {spec.name}") * strides[a]
        for j, n in enumerate(idx.shape):
            if j != a:
                flat = flat + (np.arange(n, dtype=np.int64) * strides[j]).reshape((-1,) + (1,) * (idx.ndim - 1 - j))
        out = _scatter_target(spec, data)
        _scatter_rows(out.reshape(-1, 1), flat.reshape(-1), updates.reshape(-1, 1), ufunc)
        return (out,)

    return run


# ---------------------------------------------------------------- OneHot

def _one_hot_axis(spec: KernelSpec, rank_in: int) -> int:
    axis = spec.attr("axis", -1)
    if not -(rank_in + 1) <= axis <= rank_in:
        raise refuse(spec, f"axis {axis} for rank-{rank_in} indices", f"axis in [{-(rank_in + 1)}, {rank_in}]")
    return norm_axis(axis, rank_in + 1)


def _one_hot_shape(spec: KernelSpec) -> OutputShapes:
    s, dt = spec.shapes[0], _dtype(spec, 2)
    axis = spec.attr("axis", -1)
    if s is None or not isinstance(axis, int) or not -(len(s) + 1) <= axis <= len(s):
        return [(None, dt)]
    depth = spec.const(1)
    d = -1 if depth is None or np.size(depth) != 1 else int(np.asarray(depth).reshape(-1)[0])
    a = norm_axis(axis, len(s) + 1)
    return [(tuple(s[:a]) + (d,) + tuple(s[a:]), dt)]


@register("OneHot", _one_hot_shape, params=frozenset({1}))
def one_hot(spec: KernelSpec) -> Run:
    """Built in its final layout by one broadcast comparison: no transpose of the result."""
    check_attrs(spec, {"axis"})
    rank = _rank(spec, 0)
    if rank is not None:
        _one_hot_axis(spec, rank)

    def run(indices: np.ndarray, depth: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, ...]:
        a = _one_hot_axis(spec, indices.ndim)
        d = int(np.asarray(depth).reshape(-1)[0]) if np.size(depth) == 1 else -1
        if d < 1 or np.size(values) != 2:
            raise ValueError(f"OneHot {spec.name}: depth {np.asarray(depth).tolist()} must be one positive number and values "
                             f"{np.shape(values)} two ([off, on])")
        idx = np.trunc(indices).astype(np.int64) if indices.dtype.kind == "f" else indices.astype(np.int64, copy=False)
        idx = np.where(idx < 0, idx + d, idx)  # still out of range after this: all "off", per the spec
        off, on = np.asarray(values).reshape(-1)
        hot = np.expand_dims(idx, a) == np.arange(d, dtype=np.int64).reshape((d,) + (1,) * (indices.ndim - a))
        return (np.where(hot, on, off),)

    return run


# ---------------------------------------------------------------- Trilu

def _zero_triangle(y: np.ndarray, upper: bool, k: int) -> None:
    """Zero what Trilu drops, one slice assignment per matrix row over the whole batch (a
    broadcast mask select reads a mask per element and is several times slower)."""
    rows, cols = y.shape[-2:]
    for i in range(rows):
        lo, hi = (0, min(cols, i + k)) if upper else (max(0, i + k + 1), cols)
        if lo < hi:
            y[..., i, lo:hi] = 0


@register("Trilu", same_as_input, params=frozenset({1}))
def trilu(spec: KernelSpec) -> Run:
    check_attrs(spec, {"upper"})
    upper = flag(spec, "upper", 1)
    rank = _rank(spec, 0)
    if rank is not None and rank < 2:
        raise refuse(spec, f"a rank-{rank} input", "inputs of rank >= 2 (batched over leading dims)")
    inplace = 0 in spec.inplace

    def run(x: np.ndarray, k: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        if x.ndim < 2:
            raise ValueError(f"Trilu {spec.name}: input of rank {x.ndim}; needs rank >= 2")
        kk = 0 if k is None else scalar_int(k)
        y = x if inplace and x.flags.writeable else x.copy()
        _zero_triangle(y, upper, max(min(kk, x.shape[-1] + 1), -x.shape[-2] - 1))
        return (y,)

    return run


# ---------------------------------------------------------------- ReverseSequence

@register("ReverseSequence", same_as_input)
def reverse_sequence(spec: KernelSpec) -> Run:
    """One fancy-index gather with a (time, batch) source-step grid."""
    check_attrs(spec, {"batch_axis", "time_axis"})
    b_ax, t_ax = spec.attr("batch_axis", 1), spec.attr("time_axis", 0)
    if {b_ax, t_ax} != {0, 1}:
        raise refuse(spec, f"batch_axis={b_ax}, time_axis={t_ax}", "batch_axis and time_axis are 0 and 1 in either order")
    rank = _rank(spec, 0)
    if rank is not None and rank < 2:
        raise refuse(spec, f"a rank-{rank} input", "inputs of rank >= 2")

    def run(x: np.ndarray, sequence_lens: np.ndarray) -> tuple[np.ndarray, ...]:
        t, nb = x.shape[t_ax], x.shape[b_ax]
        lens = _index_array(sequence_lens, f"ReverseSequence {spec.name}: sequence_lens").reshape(-1)
        if lens.shape != (nb,) or lens.size and (lens.min() < 0 or lens.max() > t):
            raise ValueError(f"ReverseSequence {spec.name}: sequence_lens {lens.tolist()} must be {nb} lengths in [0, {t}]")
        steps = np.arange(t, dtype=np.int64)[:, None]
        src = np.where(steps < lens, lens - 1 - steps, steps)  # (time, batch)
        batches = np.arange(nb, dtype=np.int64)
        return (x[src, batches] if t_ax == 0 else x[batches[:, None], src.T],)

    return run


# ---------------------------------------------------------------- NonMaxSuppression

NMS_BLOCK = 64  # candidates resolved per vector step: their pairwise IoU is one small matrix
NMS_CELLS = 1 << 18  # IoU cells per vector step against the kept boxes: bounds the temporaries


def _nms_geometry(boxes: np.ndarray, center: bool) -> np.ndarray:
    """(5, boxes) float32 rows ymin, xmin, ymax, xmax, area, rounded as onnxruntime rounds them."""
    if center:
        xc, yc, w, h = boxes.T
        hw, hh = w / np.float32(2), h / np.float32(2)
        return np.stack([yc - hh, xc - hw, yc + hh, xc + hw, w * h])
    y1, x1, y2, x2 = boxes.T
    ymin, ymax, xmin, xmax = np.minimum(y1, y2), np.maximum(y1, y2), np.minimum(x1, x2), np.maximum(x1, x2)
    return np.stack([ymin, xmin, ymax, xmax, (ymax - ymin) * (xmax - xmin)])


def _overlaps(a: np.ndarray, b: np.ndarray, iou_threshold: np.float32) -> np.ndarray:
    """(len a, len b): whether each pair's float32 IoU exceeds the threshold (pairs that do not
    intersect never do, whatever their areas)."""
    ix = np.minimum(a[3][:, None], b[3]) - np.maximum(a[1][:, None], b[1])
    iy = np.minimum(a[2][:, None], b[2]) - np.maximum(a[0][:, None], b[0])
    inter = ix * iy
    iou = inter / (a[4][:, None] + b[4] - inter)
    return (ix > 0) & (iy > 0) & (inter > 0) & (iou > iou_threshold)


def _greedy(overlaps: np.ndarray, room: int) -> list[int]:
    """Greedy picks within a score-sorted block: a box is kept unless a kept box before it overlaps it.
    Rows become bit sets, so the sequential part is integer ops, not array calls."""
    rows = np.packbits(np.triu(overlaps, 1), axis=1, bitorder="little")
    width, data = rows.shape[1], rows.tobytes()
    removed, picked = 0, []
    for i in range(rows.shape[0]):
        if not removed >> i & 1:
            picked.append(i)
            if len(picked) == room:
                break
            removed |= int.from_bytes(data[i * width:(i + 1) * width], "little")
    return picked


def _overlapped_by(kept: np.ndarray, block: np.ndarray, iou_threshold: np.float32) -> np.ndarray:
    """Which boxes of `block` some kept box overlaps, in steps of at most NMS_CELLS pairs."""
    step = max(1, NMS_CELLS // max(1, block.shape[1]))
    gone = np.zeros(block.shape[1], dtype=bool)
    for j in range(0, kept.shape[1], step):
        gone |= _overlaps(kept[:, j:j + step], block, iou_threshold).any(axis=0)
    return gone


def _by_score(scores: np.ndarray, cand: np.ndarray, head: int) -> Iterator[np.ndarray]:
    """Candidates by descending score, ties by lower index (onnxruntime's order), in two runs:
    the top `head` or so first, the rest only if the selection gets that far; most never does."""
    s = scores[cand]
    if cand.size > 2 * head:
        cut = np.partition(s, cand.size - head)[cand.size - head]
        top = s >= cut  # every box tied with the cut is in the first run, so the runs never interleave
        yield cand[top][np.argsort(-s[top], kind="stable")]
        cand, s = cand[~top], s[~top]
    yield cand[np.argsort(-s, kind="stable")]


def _nms_class(scores: np.ndarray, geo: np.ndarray, limit: int, iou_threshold: np.float32,
               score_threshold: np.float32 | None) -> np.ndarray:
    """Box indices kept for one class, in selection order. Candidates are taken in score order, a
    block at a time: the boxes kept so far remove what they overlap, then a greedy pass over the
    block's own pairwise overlaps. The IoU work is about what the one-box-at-a-time loop does, in
    vector steps."""
    cand = np.arange(scores.size) if score_threshold is None else np.flatnonzero(scores > score_threshold)
    kept_ids: list[np.ndarray] = []
    kept = np.empty((5, 0), np.float32)
    for ids in _by_score(scores, cand, max(4 * NMS_BLOCK, 4 * limit)):
        g, pos = geo[:, ids], 0
        while pos < ids.size and kept.shape[1] < limit:
            n = min(NMS_BLOCK, max(16, 2 * (limit - kept.shape[1])))
            block, bids = g[:, pos:pos + n], ids[pos:pos + n]
            pos += n
            if kept.shape[1]:
                alive = ~_overlapped_by(kept, block, iou_threshold)
                block, bids = block[:, alive], bids[alive]
            picked = _greedy(_overlaps(block, block, iou_threshold), limit - kept.shape[1])
            kept_ids.append(bids[picked])
            kept = np.concatenate([kept, block[:, picked]], axis=1)
        if kept.shape[1] >= limit:
            break
    return np.concatenate(kept_ids) if kept_ids else np.empty(0, np.int64)


def _opt_scalar(x: np.ndarray | None, dtype: type) -> Any:
    return None if x is None or np.size(x) == 0 else np.asarray(x, dtype=dtype).reshape(-1)[0]


@register("NonMaxSuppression", lambda s: [((-1, 3), np.dtype(np.int64))], params=frozenset({2, 3, 4}))
def non_max_suppression(spec: KernelSpec) -> Run:
    """Selected (batch, class, box) rows in onnxruntime's order: batch, then class, then selection."""
    check_attrs(spec, {"center_point_box"})
    cpb = spec.attr("center_point_box", 0)
    if cpb not in (0, 1):
        raise refuse(spec, f"center_point_box={cpb!r}", "0 (corners [y1, x1, y2, x2]) or 1 ([x_center, y_center, width, height])")
    for i in (0, 1):
        dt = _dtype(spec, i)
        if dt is not None and dt != np.float32:
            raise refuse(spec, f"{('boxes', 'scores')[i]} of dtype {dt}", "float32 boxes and scores")
    iou_const = _opt_scalar(spec.const(3), np.float32) if spec.has(3) else None
    if iou_const is not None and not 0 <= iou_const <= 1:
        raise refuse(spec, f"iou_threshold {iou_const}", "iou_threshold in [0, 1]")

    def run(boxes: np.ndarray, scores: np.ndarray, max_output: np.ndarray | None = None,
            iou_threshold: np.ndarray | None = None, score_threshold: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        if boxes.ndim != 3 or scores.ndim != 3 or boxes.shape[2] != 4 or boxes.shape[0] != scores.shape[0] or boxes.shape[1] != scores.shape[2]:
            raise ValueError(f"NonMaxSuppression {spec.name}: boxes {boxes.shape} and scores {scores.shape} do not fit "
                             "[batches, boxes, 4] and [batches, classes, boxes]")
        if boxes.dtype != np.float32 or scores.dtype != np.float32:
            raise TypeError(f"NonMaxSuppression {spec.name}: boxes and scores must be float32, got {boxes.dtype} and {scores.dtype}")
        limit = max(int(_opt_scalar(max_output, np.int64) or 0), 0)
        iou = _opt_scalar(iou_threshold, np.float32)
        iou = np.float32(0) if iou is None else iou
        if not 0 <= iou <= 1:
            raise ValueError(f"NonMaxSuppression {spec.name}: iou_threshold {iou} is outside [0, 1]")
        st = _opt_scalar(score_threshold, np.float32)
        rows = [np.empty((0, 3), np.int64)]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):  # a zero union divides as in onnxruntime
            for bi in range(boxes.shape[0] if limit else 0):
                geo = _nms_geometry(boxes[bi], bool(cpb))
                for ci in range(scores.shape[1]):
                    kept = _nms_class(scores[bi, ci], geo, limit, iou, st)
                    rows.append(np.stack([np.full_like(kept, bi), np.full_like(kept, ci), kept], axis=1))
        return (np.concatenate(rows).astype(np.int64, copy=False),)

    return run
