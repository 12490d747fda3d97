"""Transposed convolution (ConvTranspose, 1-D to 3-D, NCHW): one GEMM per group, then col2im by phase.

The GEMM gives every kernel tap's contribution plane: cols[m, tap] = W[:, m, tap]^T @ x. Output
position o = i*s + k*d - pad takes the tap k of input i; scattering each tap plane into the strided
output (out[k*d::s] += plane) is a scalar strided loop in NumPy, far slower than a contiguous
add. Taps whose offsets k*d share a residue r = k*d mod s fill the same output phase
(every s-th position), where they are the same plane shifted by q = k*d div s. Padding the input's
trailing spatial dims by the largest shift turns that shift into one flat offset, so each tap is
one contiguous range add into its phase buffer; the phases are then interleaved into the output
once (s^n strided copies, the bias folded in). With kernel <= stride (k=2 s=2: the common U-Net
decoder) no two taps meet, and the interleave reads the GEMM output directly.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from . import blas, parallel
from ..errors import UnsupportedOpError
from .registry import KernelSpec, OutputShapes, Run, register

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
MIN_GEMM_COLUMNS = 1024  # narrower inputs share one GEMM across batch items: reads the weights once


# ---------------------------------------------------------------- geometry

def _per_dim(spec: KernelSpec, key: str, nd: int, default: int) -> list[int]:
    v = spec.attr(key)
    return [default] * nd if not v else [int(a) for a in v]


def transpose_geometry(spec: KernelSpec, in_dims: tuple[int, ...], kernel: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(pads_begin, output spatial dims) of a ConvTranspose for these input dims, per the ONNX spec:
    output_shape (or SAME_*: in*stride) fixes the output and implies the pads; else the pads give it.
    An output_shape up to stride-1 past the natural size gets the extra positions at the end, as
    output_padding would (onnxruntime does the same; TensorFlow's SAME with kernel < stride needs it)."""
    nd = len(kernel)
    s, d = _per_dim(spec, "strides", nd, 1), _per_dim(spec, "dilations", nd, 1)
    adj = _per_dim(spec, "output_padding", nd, 0)
    natural = [s[i] * (in_dims[i] - 1) + adj[i] + (kernel[i] - 1) * d[i] + 1 for i in range(nd)]
    auto = spec.attr("auto_pad", "NOTSET")
    target = spec.attr("output_shape")
    if target:
        out = [int(v) for v in target][-nd:]
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        out = [in_dims[i] * s[i] for i in range(nd)]
    else:
        pads = [0] * (2 * nd) if auto == "VALID" else _per_dim(spec, "pads", 2 * nd, 0)
        return pads[:nd], [natural[i] - pads[i] - pads[nd + i] for i in range(nd)]
    total = [natural[i] - out[i] for i in range(nd)]
    if any(t <= -s[i] for i, t in enumerate(total)):
        raise ValueError(f"ConvTranspose {spec.name}: output dims {out} do not fit input dims {list(in_dims)} "
                         f"(natural output {natural}, strides {s})")
    total = [max(0, t) for t in total]
    if auto == "SAME_UPPER":  # the odd pad goes to the end
        return [t // 2 for t in total], out
    return [t - t // 2 for t in total], out


def _shape(spec: KernelSpec) -> OutputShapes:
    xs, ws = spec.shapes[0], spec.shapes[1] if len(spec.shapes) > 1 else None
    dtype = spec.dtypes[0]
    if xs is None or len(xs) < 3:
        return [(None, dtype)]
    nd = len(xs) - 2
    group = int(spec.attr("group", 1))
    m = ws[1] * group if ws is not None and len(ws) == nd + 2 and ws[1] != -1 else -1
    kernel = tuple(spec.attr("kernel_shape") or (ws[2:] if ws is not None and len(ws) == nd + 2 else ()))
    target = spec.attr("output_shape")
    if target and len(target) in (nd, nd + 2):
        return [((xs[0], m) + tuple(int(v) for v in target[-nd:]), dtype)]
    if len(kernel) != nd or -1 in kernel or -1 in xs[2:]:
        return [((xs[0], m) + (-1,) * nd, dtype)]
    _, out = transpose_geometry(spec, tuple(xs[2:]), kernel)
    return [((xs[0], m) + tuple(out), dtype)]


# ---------------------------------------------------------------- the plan for one input size

Slices = tuple[slice, ...]


@dataclass(frozen=True)
class Plan:
    """Everything about one (input dims, kernel) that does not depend on the values."""

    out: tuple[int, ...]  # output spatial dims
    in_pad: tuple[int, ...]  # zeros appended to each input spatial dim (never the first)
    hq: tuple[int, ...]  # one phase buffer's dims
    length: int  # one phase buffer's flat length, with slack for the padded columns' wrap
    n_phases: int
    taps: tuple[tuple[int, int, int], ...]  # (tap, phase, flat offset), every tap once
    copies: tuple[tuple[int, int, Slices, Slices], ...]  # (phase, its tap or -1, output slices, buffer slices)
    direct: bool  # no two taps share a phase and none is shifted: interleave the GEMM output itself
    fill: bool  # some outputs take no tap: start from the bias (or zero)


def _axis_copies(o: int, s: int, pad: int, r: int, hq: int) -> tuple[slice, slice, int, bool]:
    """Along one axis, the output positions of phase r and where they sit in its buffer: (output
    slice, buffer slice, how many positions the phase has, whether the buffer covers them all)."""
    start = (r - pad) % s
    count = len(range(start, o, s))
    a0 = (start + pad - r) // s
    k0, k1 = max(0, -a0), min(count, hq - a0)
    if k1 <= k0:
        return slice(0, 0), slice(0, 0), count, count == 0
    return slice(start + k0 * s, start + (k1 - 1) * s + 1, s), slice(a0 + k0, a0 + k1), count, k0 == 0 and k1 == count


def make_plan(in_dims: tuple[int, ...], kernel: tuple[int, ...], strides: list[int], dils: list[int],
              pads: list[int], out: list[int]) -> Plan:
    nd = len(kernel)
    offsets = [[k * dils[i] for k in range(kernel[i])] for i in range(nd)]
    qmax = [max(v // strides[i] for v in offsets[i]) for i in range(nd)]
    in_pad = tuple(0 if i == 0 else qmax[i] for i in range(nd))
    hq = tuple(in_dims[i] + qmax[i] for i in range(nd))
    row = [math.prod(hq[i + 1:]) for i in range(nd)]  # flat stride of each buffer axis
    slack = sum(qmax[i] * row[i] for i in range(1, nd))
    taps: list[tuple[int, int, int]] = []
    per_phase: dict[int, list[tuple[int, int]]] = {}
    for t, ks in enumerate(itertools.product(*[range(k) for k in kernel])):
        phase = int(np.ravel_multi_index([offsets[i][ks[i]] % strides[i] for i in range(nd)], strides))
        off = sum((offsets[i][ks[i]] // strides[i]) * row[i] for i in range(nd))
        taps.append((t, phase, off))
        per_phase.setdefault(phase, []).append((t, off))
    direct = all(len(v) == 1 and v[0][1] == 0 for v in per_phase.values())
    copies: list[tuple[int, int, Slices, Slices]] = []
    covered = 0
    for res in itertools.product(*[range(s) for s in strides]):
        phase = int(np.ravel_multi_index(res, strides))
        axes = [_axis_copies(out[i], strides[i], pads[i], res[i], hq[i]) for i in range(nd)]
        if phase not in per_phase:
            continue
        if all(full for *_, full in axes):
            covered += math.prod([count for _, _, count, _ in axes])
        if all(src.stop > src.start for _, src, _, _ in axes):
            tap = per_phase[phase][0][0] if direct else -1
            copies.append((phase, tap, tuple(dst for dst, *_ in axes), tuple(src for _, src, *_ in axes)))
    return Plan(tuple(out), in_pad, hq, math.prod(hq) + slack, math.prod(strides), tuple(taps),
                tuple(copies), direct, covered != math.prod(out))


# ---------------------------------------------------------------- the kernel

def _refuse(spec: KernelSpec, what: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"node {spec.name!r}: ConvTranspose {what}")


def _check_attrs(spec: KernelSpec, w: np.ndarray | None) -> None:
    """Refuse, naming the node, what no kernel here computes (or what the spec forbids)."""
    auto = spec.attr("auto_pad", "NOTSET")
    if auto not in AUTO_PADS:
        raise _refuse(spec, f"auto_pad={auto!r} is not supported; supported: {', '.join(AUTO_PADS)}")
    group = spec.attr("group", 1)
    if not isinstance(group, (int, np.integer)) or group < 1:
        raise _refuse(spec, f"group={group!r}: expected a positive integer")
    xs = spec.shapes[0] if spec.shapes else None
    rank = w.ndim if w is not None else (len(xs) if xs is not None else None)
    if rank is not None and not 3 <= rank <= 5:
        raise _refuse(spec, f"on rank-{rank} operands is not supported; supported: 1-D, 2-D and 3-D (rank 3 to 5, NCHW)")
    dt = spec.dtypes[0] if spec.dtypes else None
    if dt is not None and np.dtype(dt).kind != "f":
        raise _refuse(spec, f"on {np.dtype(dt)} inputs is not supported; supported: floating point")
    if rank is None:
        return
    nd = rank - 2
    for key, n in (("strides", nd), ("dilations", nd), ("output_padding", nd), ("pads", 2 * nd), ("kernel_shape", nd)):
        v = spec.attr(key)
        if v and len(v) != n:
            raise _refuse(spec, f"{key}={list(v)} has {len(v)} values; a {nd}-D transposed convolution takes {n}")
    for key in ("strides", "dilations"):
        v = spec.attr(key)
        if v and min(v) < 1:
            raise _refuse(spec, f"{key}={list(v)}: expected positive values")
    pads = spec.attr("pads")
    if pads and any(pads) and auto != "NOTSET":
        raise _refuse(spec, f"pads={list(pads)} with auto_pad={auto}: the spec allows explicit pads only with auto_pad=NOTSET")
    target = spec.attr("output_shape")
    if target and len(target) not in (nd, nd + 2):
        raise _refuse(spec, f"output_shape={list(target)} has {len(target)} values; expected {nd} (spatial dims)")
    adj = spec.attr("output_padding")
    if adj and min(adj) < 0:
        raise _refuse(spec, f"output_padding={list(adj)}: expected non-negative values")
    if w is not None:
        ks = spec.attr("kernel_shape")
        if ks and tuple(ks) != w.shape[2:]:
            raise _refuse(spec, f"kernel_shape={list(ks)} differs from the weights' {list(w.shape[2:])}")
        if w.shape[0] % group:
            raise _refuse(spec, f"weights have {w.shape[0]} input channels, not a multiple of group={group}")


def gemm_weights(w: np.ndarray, group: int) -> np.ndarray:
    """(G, Mg*T, Cg): per group, rows (output channel, tap) of W^T, so a channel range is a row range."""
    cg = w.shape[0] // group
    return np.ascontiguousarray(w.reshape(group, cg, -1).transpose(0, 2, 1))


@register("ConvTranspose", _shape)
def conv_transpose(spec: KernelSpec) -> Run:
    """y = ConvTranspose(x, w, [bias]); the weights' re-layout happens here once when they are constant."""
    w_const = spec.const(1)
    _check_attrs(spec, w_const)
    group = int(spec.attr("group", 1))
    a_const = None if w_const is None or w_const.shape[0] // group == 1 else gemm_weights(w_const, group)

    @functools.lru_cache(maxsize=32)
    def plan_for(in_dims: tuple[int, ...], kernel: tuple[int, ...]) -> Plan:
        """Once per input size: the geometry and the col2im plan."""
        nd = len(kernel)
        pads, out = transpose_geometry(spec, in_dims, kernel)
        if min(out) < 1:
            raise ValueError(f"ConvTranspose {spec.name}: input dims {list(in_dims)} give output dims {out}")
        return make_plan(in_dims, kernel, _per_dim(spec, "strides", nd, 1), _per_dim(spec, "dilations", nd, 1), pads, out)

    xs = spec.shapes[0]
    if xs is not None and w_const is not None and -1 not in xs[2:] and len(xs) == w_const.ndim:
        try:  # a static input size: the plan is made now, once
            plan_for(tuple(xs[2:]), tuple(w_const.shape[2:]))
        except ValueError as e:
            raise _refuse(spec, f"does not fit its input: {e}") from None

    def run(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        if x.ndim != w.ndim or not 3 <= x.ndim <= 5:
            raise ValueError(f"ConvTranspose {spec.name}: input {x.shape} and weights {w.shape} must both be 3-D to 5-D (NCHW) of one rank")
        n, c = x.shape[:2]
        if c != w.shape[0] or c % group:
            raise ValueError(f"ConvTranspose {spec.name}: input has {c} channels, weights {w.shape} with group={group} expect {w.shape[0]}")
        kernel = tuple(w.shape[2:])
        plan = plan_for(tuple(x.shape[2:]), kernel)
        a = a_const if a_const is not None else (gemm_weights(w, group) if c // group > 1 else None)
        return (_compute(x, w, a, bias, group, plan),)

    return run


def _compute(x: np.ndarray, w: np.ndarray, a: np.ndarray | None, bias: np.ndarray | None, group: int, plan: Plan) -> np.ndarray:
    n, c = x.shape[:2]
    mg = w.shape[1]
    m, cg, taps = mg * group, c // group, math.prod(w.shape[2:])
    dtype = np.result_type(x.dtype, w.dtype)
    y = np.empty((n, m) + plan.out, dtype=dtype)
    if plan.fill:
        y[...] = 0 if bias is None else bias.reshape((1, m) + (1,) * len(plan.out))
    xp = _pad_input(x, plan.in_pad)
    pp = math.prod(xp.shape[2:])
    xf = xp.reshape(n, c, pp)
    nb = 1 if pp >= MIN_GEMM_COLUMNS or n == 1 else min(n, -(-MIN_GEMM_COLUMNS // pp))
    batches = [(b, min(n, b + nb)) for b in range(0, n, nb)]
    depthwise = cg == 1
    chunks = _channel_chunks(m if depthwise else mg, len(batches) * (1 if depthwise else group))
    units = [(b0, b1, g, c0, c1) for b0, b1 in batches for g in range(1 if depthwise else group) for c0, c1 in chunks]
    if depthwise:
        wd = w.reshape(m, taps)

        def contributions(b0: int, b1: int, ch0: int, ch1: int) -> np.ndarray:
            src = xf[b0:b1, ch0:ch1] if mg == 1 else xf[b0:b1, np.arange(ch0, ch1) // mg]
            return wd[ch0:ch1, :, None, None] * src.transpose(1, 0, 2)[:, None]
    else:
        if a is None:
            raise ValueError("grouped GEMM weights missing")
        wa = a

        def contributions(b0: int, b1: int, ch0: int, ch1: int) -> np.ndarray:
            g, c0, c1 = ch0 // mg, ch0 % mg, ch0 % mg + ch1 - ch0
            rhs = xf[b0, g * cg:(g + 1) * cg] if b1 - b0 == 1 else \
                np.ascontiguousarray(xf[b0:b1, g * cg:(g + 1) * cg].transpose(1, 0, 2)).reshape(cg, -1)
            return blas.gemm(wa[g, c0 * taps:c1 * taps], rhs).reshape(c1 - c0, taps, b1 - b0, pp)

    def unit(b0: int, b1: int, g: int, c0: int, c1: int) -> None:
        """Output channels g*mg + [c0, c1) of batch items [b0, b1): their GEMM, then their col2im."""
        ch0, ch1 = g * mg + c0, g * mg + c1
        _col2im(contributions(b0, b1, ch0, ch1), y[b0:b1, ch0:ch1], None if bias is None else bias[ch0:ch1], plan, pp)

    def units_in(lo: int, hi: int) -> None:
        for u in units[lo:hi]:
            unit(*u)

    parts = parallel.parts_for(2 * n * m * cg * taps * pp, len(units))
    if parts == 1:
        units_in(0, len(units))
    else:
        parallel.split_range(units_in, len(units), parts)
    return y


def _pad_input(x: np.ndarray, in_pad: tuple[int, ...]) -> np.ndarray:
    if not any(in_pad):
        return x
    xp = np.zeros(x.shape[:2] + tuple(d + p for d, p in zip(x.shape[2:], in_pad)), dtype=x.dtype)
    xp[(slice(None), slice(None)) + tuple(slice(0, d) for d in x.shape[2:])] = x
    return xp


def _channel_chunks(channels: int, units: int) -> list[tuple[int, int]]:
    """Channel ranges per unit: split only when the batch gives too few units to fill the pool."""
    parts = max(1, min(channels, parallel.THREADS // max(1, units)))
    return [(channels * i // parts, channels * (i + 1) // parts) for i in range(parts)]


def _col2im(cols: np.ndarray, y: np.ndarray, bias: np.ndarray | None, plan: Plan, pp: int) -> None:
    """Scatter-add tap planes cols (ch, T, nb, pp) into y (nb, ch, *out) by phase. The bias is added
    where the data is contiguous (a three-operand ufunc into a strided output is slow), then each
    phase is one strided copy."""
    nb, ch = y.shape[:2]
    lead = (slice(None), slice(None))
    if plan.direct:
        if bias is not None:
            cols += bias.reshape(ch, 1, 1, 1)
        for _, tap, dst_sl, src_sl in plan.copies:
            src = cols[:, tap].transpose(1, 0, 2).reshape((nb, ch) + plan.hq)
            np.copyto(y[lead + dst_sl], src[lead + src_sl])
        return
    buf = np.empty((nb, ch, plan.n_phases, plan.length), dtype=y.dtype)  # phases without taps are never read
    seen = set()
    for tap, phase, off in plan.taps:
        dst, src = buf[:, :, phase, off:off + pp], cols[:, tap].transpose(1, 0, 2)
        if phase in seen:
            np.add(dst, src, out=dst)
            continue
        seen.add(phase)  # the phase's first tap: a copy, zeros only where it does not reach
        buf[:, :, phase, :off] = 0
        buf[:, :, phase, off + pp:] = 0
        np.copyto(dst, src)
    if bias is not None:
        buf += bias.reshape(1, ch, 1, 1)
    size = math.prod(plan.hq)
    for phase, _, dst_sl, src_sl in plan.copies:
        src = buf[:, :, phase, :size].reshape((nb, ch) + plan.hq)
        np.copyto(y[lead + dst_sl], src[lead + src_sl])
