"""Recurrent layers (RNN, GRU, LSTM) as whole-sequence kernels.

One GEMM projects every time step's input for both directions at once (X[T*B, I] @ W^T); only the
recurrence h @ R^T walks the time steps. That walk is one numba call per node: a per-step NumPy
loop pays a dozen ufunc dispatches per step, which at batch 1 cost more than the arithmetic. The
numba kernels walk four batch rows at a time, so each load of R feeds four rows (as fast as a
BLAS GEMM per step at batch 32), and evaluate sigmoid and tanh with a rational approximation that
LLVM vectorizes (math.tanh is a scalar libm call per element). With the default activations a
step's gate math is one fused loop; other activations run gate by gate. The kernels are float32
(float16 computes in float32); float64, hosts without numba and KUBETRT_DISABLE_JIT run the NumPy
loop.

Semantics follow onnxruntime where the ONNX text leaves room: `clip` bounds every gate's input
(biases and peepholes included) but not the cell state fed to h(); activation_alpha/beta are
consumed in order by the activations that take them; a sequence with sequence_lens[b] = 0 ends
with zero states; the reverse direction of a shorter sequence starts at its own last step; rows of
Y past a sequence's end are zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import activations, blas, jit, parallel
from .registry import KernelSpec, OutputShapes, Run, flag, refuse, register

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}  # rows of W and R per hidden unit
_DEFAULT_ACTS = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}
_N_OUTPUTS = {"RNN": 2, "GRU": 2, "LSTM": 3}
_DIRECTIONS = ("forward", "reverse", "bidirectional")

# Activation codes of the numba kernels.
SIGMOID, TANH, RELU, HARD_SIGMOID, LEAKY_RELU, THRESHOLDED_RELU, ELU, SOFTSIGN, SOFTPLUS, AFFINE, SCALED_TANH = range(11)


@dataclass(frozen=True)
class _ActKind:
    name: str  # as the ONNX text spells it
    code: int
    alpha: float | None = None  # default; None with takes_alpha: the model must give it
    beta: float | None = None
    takes_alpha: bool = False
    takes_beta: bool = False


_ACT_KINDS = {k.name.lower(): k for k in (
    _ActKind("Sigmoid", SIGMOID), _ActKind("Tanh", TANH), _ActKind("Relu", RELU),
    _ActKind("HardSigmoid", HARD_SIGMOID, 0.2, 0.5, True, True),
    _ActKind("LeakyRelu", LEAKY_RELU, 0.01, None, True),
    _ActKind("ThresholdedRelu", THRESHOLDED_RELU, 1.0, None, True),
    _ActKind("Elu", ELU, 1.0, None, True),
    _ActKind("Softsign", SOFTSIGN), _ActKind("Softplus", SOFTPLUS),
    _ActKind("Affine", AFFINE, None, None, True, True),  # no ONNX op to take defaults from: both must be given
    _ActKind("ScaledTanh", SCALED_TANH, None, None, True, True),
)}


# ---------------------------------------------------------------- attributes

@dataclass(frozen=True)
class Attrs:
    """A recurrent node's attributes, parsed and checked once."""

    op: str
    directions: int
    reverse: tuple[bool, ...]  # per direction: walks the sequence backwards
    hidden: int | None  # None: taken from R's shape
    layout: int
    clip: float  # 0.0: no clip
    acts: np.ndarray  # (directions, activations per direction) int64 codes
    alphas: np.ndarray  # (directions, activations per direction) float64
    betas: np.ndarray
    input_forget: bool
    linear_before_reset: bool

    @property
    def gates(self) -> int:
        return GATES[self.op]

    @property
    def standard(self) -> bool:
        """Every direction uses the default activations: the numba kernels' fused cells."""
        default = [_ACT_KINDS[n.lower()].code for n in _DEFAULT_ACTS[self.op]]
        return all(list(row) == default for row in self.acts)


def _activations(spec: KernelSpec, directions: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    per = len(_DEFAULT_ACTS[spec.op])
    names = list(spec.attr("activations") or _DEFAULT_ACTS[spec.op] * directions)
    if spec.op == "RNN" and directions == 1 and len(names) == 2:
        names = names[:1]  # the ONNX schema's own default lists two; onnxruntime takes the first
    if len(names) != per * directions:
        raise refuse(spec, f"activations={names} for {directions} direction(s)",
                      f"{per} per direction ({', '.join(_DEFAULT_ACTS[spec.op])} by default)")
    alphas = list(spec.attr("activation_alpha") or [])
    betas = list(spec.attr("activation_beta") or [])
    codes, al, be = [], [], []
    for name in names:
        kind = _ACT_KINDS.get(str(name).lower())
        if kind is None:
            raise refuse(spec, f"activation {name!r}", ", ".join(k.name for k in _ACT_KINDS.values()))
        a: float | None = 0.0
        b: float | None = 0.0
        if kind.takes_alpha:  # consumed in order, only by the activations that take one
            a = float(alphas.pop(0)) if alphas else kind.alpha
        if kind.takes_beta:
            b = float(betas.pop(0)) if betas else kind.beta
        if a is None or b is None:
            raise refuse(spec, f"activation {kind.name} without activation_alpha/activation_beta values for it",
                          f"{kind.name} with both given (it has no defaults)")
        codes.append(kind.code)
        al.append(a)
        be.append(b)
    shape = (directions, per)
    return np.array(codes, np.int64).reshape(shape), np.array(al).reshape(shape), np.array(be).reshape(shape)


def parse_attrs(spec: KernelSpec) -> Attrs:
    """The node's attributes, or UnsupportedOpError naming the node and what is supported."""
    direction = spec.attr("direction", "forward")
    if direction not in _DIRECTIONS:
        raise refuse(spec, f"direction={direction!r}", ", ".join(_DIRECTIONS))
    directions = 2 if direction == "bidirectional" else 1
    layout = spec.attr("layout", 0)
    if layout not in (0, 1):
        raise refuse(spec, f"layout={layout!r}", "0 (sequence first) or 1 (batch first)")
    hidden = spec.attr("hidden_size")
    if hidden is not None and (not isinstance(hidden, int) or hidden < 1):
        raise refuse(spec, f"hidden_size={hidden!r}", "a positive integer")
    clip = spec.attr("clip")
    if clip is not None and not (float(clip) > 0):
        raise refuse(spec, f"clip={clip!r}", "a positive threshold, or no clip attribute")
    input_forget = flag(spec, "input_forget") if spec.op == "LSTM" else False
    lbr = flag(spec, "linear_before_reset") if spec.op == "GRU" else False
    if spec.n_outputs > _N_OUTPUTS[spec.op]:
        raise refuse(spec, f"{spec.n_outputs} outputs", f"at most {_N_OUTPUTS[spec.op]}")
    acts, alphas, betas = _activations(spec, directions)
    reverse = (direction == "reverse",) if directions == 1 else (False, True)
    return Attrs(spec.op, directions, reverse, hidden, layout, float(clip or 0.0), acts, alphas, betas, input_forget, lbr)


# ---------------------------------------------------------------- shapes

def _hidden_of(spec: KernelSpec) -> int:
    h = spec.attr("hidden_size")
    if isinstance(h, int) and h > 0:
        return h
    rs = spec.shapes[2] if len(spec.shapes) > 2 else None
    return int(rs[2]) if rs is not None and len(rs) == 3 else -1


def _recurrent_shape(spec: KernelSpec) -> OutputShapes:
    d = 2 if spec.attr("direction", "forward") == "bidirectional" else 1
    h = _hidden_of(spec)
    xs = spec.shapes[0] if spec.shapes else None
    batch_first = spec.attr("layout", 0) == 1
    t, b = -1, -1
    if xs is not None and len(xs) == 3:
        t, b = (xs[1], xs[0]) if batch_first else (xs[0], xs[1])
    y = (b, t, d, h) if batch_first else (t, d, b, h)
    state = (b, d, h) if batch_first else (d, b, h)
    dtype = spec.dtypes[0] if spec.dtypes else None
    outs: OutputShapes = [(y, dtype), (state, dtype), (state, dtype)]
    return outs[: spec.n_outputs]


# ---------------------------------------------------------------- weights

@dataclass
class Weights:
    """A node's weights laid out for the kernels: one input GEMM for all directions, R transposed."""

    wt: np.ndarray  # (input, directions * gates * hidden): X @ wt projects every step at once
    bias: np.ndarray  # (directions * gates * hidden,): Wb + Rb, added to each step's projection
    rt: np.ndarray  # (directions, hidden, gates * hidden): h @ rt[d]
    rbh: np.ndarray  # (directions, hidden): GRU with linear_before_reset: Rb of the h gate, else zeros
    peep: np.ndarray  # (directions, 3 * hidden): LSTM peepholes, else zeros
    rt_zr: np.ndarray | None = None  # GRU: rt's z, r and h columns as contiguous arrays
    rt_h: np.ndarray | None = None

    @property
    def hidden(self) -> int:
        return int(self.rt.shape[1])


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """float16 computes in float32 (as the wide activations do)."""
    return np.dtype(np.float32) if dtype == np.float16 else np.dtype(dtype)


def prepare_weights(name: str, a: Attrs, w: np.ndarray, r: np.ndarray, b: np.ndarray | None,
                    p: np.ndarray | None, dtype: np.dtype) -> Weights:
    """Transpose and stack W and R, sum Wb + Rb: once in the factory for constant weights."""
    d, g = a.directions, a.gates
    if r.ndim != 3 or r.shape[0] != d or r.shape[1] != g * r.shape[2]:
        raise ValueError(f"{a.op} {name}: R has shape {list(r.shape)}, expected [{d}, {g}*hidden, hidden]")
    h = r.shape[2]
    if a.hidden is not None and a.hidden != h:
        raise ValueError(f"{a.op} {name}: hidden_size={a.hidden} but R has shape {list(r.shape)}")
    gw = g * h
    if w.ndim != 3 or w.shape[:2] != (d, gw):
        raise ValueError(f"{a.op} {name}: W has shape {list(w.shape)}, expected [{d}, {gw}, input_size]")
    if b is not None and b.shape != (d, 2 * gw):
        raise ValueError(f"{a.op} {name}: B has shape {list(b.shape)}, expected [{d}, {2 * gw}]")
    if p is not None and p.shape != (d, 3 * h):
        raise ValueError(f"{a.op} {name}: P has shape {list(p.shape)}, expected [{d}, {3 * h}]")
    wt = np.ascontiguousarray(np.concatenate(list(w), axis=0).T, dtype=dtype)
    rt = np.array(r.transpose(0, 2, 1), dtype=dtype, order="C")
    rbh = np.zeros((d, h), dtype)
    if b is None:
        bias = np.zeros(d * gw, dtype)
    else:
        wb, rb = b[:, :gw].astype(dtype), b[:, gw:].astype(dtype)
        if a.linear_before_reset:  # Rb of the h gate is added inside r * (h @ Rh + Rbh)
            rbh[:] = rb[:, 2 * h:]
            rb[:, 2 * h:] = 0
        bias = (wb + rb).reshape(-1)
    # Owned copies throughout: a graph constant may be read-only, which numba compiles for separately.
    peep = np.zeros((d, 3 * h), dtype) if p is None else np.array(p, dtype=dtype, order="C")
    wts = Weights(wt, bias, rt, rbh, peep)
    if a.op == "GRU":
        wts.rt_zr, wts.rt_h = np.ascontiguousarray(rt[:, :, :2 * h]), np.ascontiguousarray(rt[:, :, 2 * h:])
    return wts


# ---------------------------------------------------------------- numba kernels

# tanh(x) = x * P(x^2) / Q(x^2) on [-9, 9] (saturated beyond: tanh(9) rounds to 1 in float32),
# fitted by iteratively reweighted least squares for relative error; about 3e-7 absolute in
# float32 arithmetic. Plain arithmetic, so the loops over a gate vectorize.
_P = [np.float32(v) for v in (0.9999999966408781, 0.13087290604780805, 0.003107597917230096, 1.1191764394629777e-05,
                              -2.0373303745903742e-08, 5.3471103166731805e-11, -8.660789261313839e-14)]
_Q = [np.float32(v) for v in (1.0, 0.4642061919956754, 0.02450974306057837, 0.0002551411098012972)]
_P0, _P1, _P2, _P3, _P4, _P5, _P6 = _P
_Q0, _Q1, _Q2, _Q3 = _Q
_SATURATE, _ONE, _HALF, _ZERO = np.float32(9.0), np.float32(1.0), np.float32(0.5), np.float32(0.0)

if jit.numba is not None:
    # error_model "numpy": numba's default checks every division for zero (to raise), which stops
    # LLVM vectorizing the gate loops. nogil: the runtime's pool splits batch blocks across threads.
    _opts: dict[str, Any] = {"cache": True, "nogil": True, "fastmath": {"contract"}, "error_model": "numpy"}

    @jit.njit(**_opts)
    def _tanh32(x, lim):
        # lim <= _SATURATE: an input clip folds into the saturation clamp at no cost.
        x = min(max(x, -lim), lim)
        s = x * x
        p = (((((_P6 * s + _P5) * s + _P4) * s + _P3) * s + _P2) * s + _P1) * s + _P0
        q = ((_Q3 * s + _Q2) * s + _Q1) * s + _Q0
        return min(max(x * p / q, -_ONE), _ONE)

    @jit.njit(**_opts)
    def _sigmoid32(x, lim):
        # sigmoid(x) = (1 + tanh(x / 2)) / 2; lim bounds x / 2.
        return _HALF + _HALF * _tanh32(_HALF * x, lim)

    @jit.njit(**_opts)
    def _clamp(x, c):
        return min(max(x, -c), c)

    @jit.njit(**_opts)
    def _activate(v, code, a, b):
        # In place over one gate (a view: offsets passed as literal constants would make numba
        # compile one more specialization per call site). One loop per activation, the branch
        # outside it, so each loop vectorizes.
        if code == SIGMOID:
            for j in range(v.shape[0]):
                v[j] = _sigmoid32(v[j], _SATURATE)
        elif code == TANH:
            for j in range(v.shape[0]):
                v[j] = _tanh32(v[j], _SATURATE)
        elif code == RELU:
            for j in range(v.shape[0]):
                v[j] = max(v[j], _ZERO)
        elif code == HARD_SIGMOID:
            for j in range(v.shape[0]):
                v[j] = min(max(a * v[j] + b, _ZERO), _ONE)
        elif code == LEAKY_RELU:
            for j in range(v.shape[0]):
                x = v[j]
                v[j] = x if x >= _ZERO else a * x
        elif code == THRESHOLDED_RELU:
            for j in range(v.shape[0]):
                x = v[j]
                v[j] = x if x > a else _ZERO
        elif code == ELU:
            for j in range(v.shape[0]):
                x = v[j]
                v[j] = x if x >= _ZERO else a * (math.exp(x) - _ONE)
        elif code == SOFTSIGN:
            for j in range(v.shape[0]):
                x = v[j]
                v[j] = x / (_ONE + abs(x))
        elif code == SOFTPLUS:
            for j in range(v.shape[0]):
                x = v[j]
                v[j] = max(x, _ZERO) + math.log1p(math.exp(-abs(x)))
        elif code == AFFINE:
            for j in range(v.shape[0]):
                v[j] = a * v[j] + b
        elif code == SCALED_TANH:
            for j in range(v.shape[0]):
                v[j] = a * math.tanh(b * v[j])

    @jit.njit(**_opts)
    def _clip(v, c):
        for j in range(v.shape[0]):
            v[j] = _clamp(v[j], c)

    @jit.njit(**_opts)
    def _mv1(s, rt, g):
        # g += s @ rt for one row; four rows of rt per pass over g.
        k, hidden, n = 0, s.shape[0], rt.shape[1]
        while k + 4 <= hidden:
            r0, r1, r2, r3 = rt[k], rt[k + 1], rt[k + 2], rt[k + 3]
            a0, a1, a2, a3 = s[k], s[k + 1], s[k + 2], s[k + 3]
            for j in range(n):
                g[j] += a0 * r0[j] + a1 * r1[j] + a2 * r2[j] + a3 * r3[j]
            k += 4
        while k < hidden:
            r0, a0 = rt[k], s[k]
            for j in range(n):
                g[j] += a0 * r0[j]
            k += 1

    @jit.njit(**_opts)
    def _mv4(s, b, rt, g):
        # g[i] += s[b + i] @ rt for four rows i: each load of rt feeds all four.
        s0, s1, s2, s3 = s[b], s[b + 1], s[b + 2], s[b + 3]
        g0, g1, g2, g3 = g[0], g[1], g[2], g[3]
        k, hidden, n = 0, s.shape[1], rt.shape[1]
        while k + 4 <= hidden:
            r0, r1, r2, r3 = rt[k], rt[k + 1], rt[k + 2], rt[k + 3]
            a0, a1, a2, a3 = s0[k], s0[k + 1], s0[k + 2], s0[k + 3]
            b0, b1, b2, b3 = s1[k], s1[k + 1], s1[k + 2], s1[k + 3]
            c0, c1, c2, c3 = s2[k], s2[k + 1], s2[k + 2], s2[k + 3]
            d0, d1, d2, d3 = s3[k], s3[k + 1], s3[k + 2], s3[k + 3]
            for j in range(n):
                x0, x1, x2, x3 = r0[j], r1[j], r2[j], r3[j]
                g0[j] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
                g1[j] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
                g2[j] += c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
                g3[j] += d0 * x0 + d1 * x1 + d2 * x2 + d3 * x3
            k += 4
        while k < hidden:
            r0 = rt[k]
            a0, b0, c0, d0 = s0[k], s1[k], s2[k], s3[k]
            for j in range(n):
                x0 = r0[j]
                g0[j] += a0 * x0
                g1[j] += b0 * x0
                g2[j] += c0 * x0
                g3[j] += d0 * x0
            k += 1

    @jit.njit(**_opts)
    def _matvec(s, b0, nb, rt, g):
        # g[i] += s[b0 + i] @ rt for the block's rows (nb <= 4).
        if nb == 4:
            _mv4(s, b0, rt, g)
        else:
            for i in range(nb):
                _mv1(s[b0 + i], rt, g[i])

    @jit.njit(**_opts)
    def _step_time(lens, b, s, rev):
        # The time index of step s of sequence b: reversed within the sequence's own length.
        return lens[b] - 1 - s if rev else s

    @jit.njit(**_opts)
    def _load_inputs(proj, x_t, x_b, col, bias, lens, b0, nb, s, rev, g):
        # g[i] = input projection + bias (columns col: of its row) of each block row still running at step s.
        for i in range(nb):
            b = b0 + i
            if s < lens[b]:
                gi = g[i]
                w = gi.shape[0]
                src, bb = proj[_step_time(lens, b, s, rev) * x_t + b * x_b, col:col + w], bias[col:col + w]
                for j in range(w):
                    gi[j] = src[j] + bb[j]

    @jit.njit(**_opts)
    def _block_len(lens, b0, nb):
        m = 0
        for i in range(nb):
            m = max(m, lens[b0 + i])
        return m

    @jit.njit(**_opts)
    def _store(y, row, h):
        out = y[row]
        for j in range(h.shape[0]):
            out[j] = h[j]

    # Cells: `std` ones fuse a whole step into one vectorized pass for the default activations,
    # the clip folded into the saturation bounds (tl for tanh's input, sl for sigmoid's half
    # input); the others apply any activation gate by gate. No clip is clip = inf; no peephole is P = 0.
    # Loops index views with the bare loop index: an index like n + j might be negative as far
    # as LLVM knows, and numba's wraparound for negative indices then stops vectorization.

    @jit.njit(**_opts)
    def _lstm_cell_std(g, h, c, p, tl, sl, input_forget):
        n = h.shape[0]
        gi, go, gf, gc = g[:n], g[n:2 * n], g[2 * n:3 * n], g[3 * n:]  # ONNX gate order i, o, f, c
        pi, po, pf = p[:n], p[n:2 * n], p[2 * n:]
        for j in range(n):
            cj = c[j]
            i = _sigmoid32(gi[j] + pi[j] * cj, sl)
            f = _ONE - i if input_forget else _sigmoid32(gf[j] + pf[j] * cj, sl)
            cn = f * cj + i * _tanh32(gc[j], tl)
            o = _sigmoid32(go[j] + po[j] * cn, sl)
            c[j] = cn
            h[j] = o * _tanh32(cn, _SATURATE)

    @jit.njit(**_opts)
    def _lstm_cell_any(g, h, c, p, act, al, be, clip, input_forget):
        n = h.shape[0]
        gi, go, gf, gc = g[:n], g[n:2 * n], g[2 * n:3 * n], g[3 * n:]
        pi, po, pf = p[:n], p[n:2 * n], p[2 * n:]
        for j in range(n):
            gi[j] = _clamp(gi[j] + pi[j] * c[j], clip)
            gf[j] = _clamp(gf[j] + pf[j] * c[j], clip)
            gc[j] = _clamp(gc[j], clip)
        _activate(gi, act[0], al[0], be[0])
        if input_forget:
            for j in range(n):
                gf[j] = _ONE - gi[j]
        else:
            _activate(gf, act[0], al[0], be[0])
        _activate(gc, act[1], al[1], be[1])
        for j in range(n):
            c[j] = gf[j] * c[j] + gi[j] * gc[j]
            go[j] = _clamp(go[j] + po[j] * c[j], clip)
            gc[j] = c[j]
        _activate(go, act[0], al[0], be[0])
        _activate(gc, act[2], al[2], be[2])
        for j in range(n):
            h[j] = go[j] * gc[j]

    @jit.njit(**_opts)
    def _lstm_kernel(proj, x_t, x_b, bias, rt, peep, hs, cs, lens, y, y_t, y_b, y_d, reverse,
                     std, acts, alphas, betas, clip, input_forget, start, stop):
        n_dir, batch, n = hs.shape
        blocks = (batch + 3) // 4
        g = np.zeros((4, 4 * n), hs.dtype)
        tl, sl = min(clip, _SATURATE), min(_HALF * clip, _SATURATE)
        for item in range(start, stop):
            d, b0 = item // blocks, (item % blocks) * 4
            nb = min(4, batch - b0)
            h, c, rev = hs[d], cs[d], reverse[d]
            for s in range(_block_len(lens, b0, nb)):
                _load_inputs(proj, x_t, x_b, d * 4 * n, bias, lens, b0, nb, s, rev, g)
                _matvec(h, b0, nb, rt[d], g)
                for i in range(nb):
                    b = b0 + i
                    if s < lens[b]:
                        if std:
                            _lstm_cell_std(g[i], h[b], c[b], peep[d], tl, sl, input_forget)
                        else:
                            _lstm_cell_any(g[i], h[b], c[b], peep[d], acts[d], alphas[d], betas[d], clip, input_forget)
                        _store(y, _step_time(lens, b, s, rev) * y_t + b * y_b + d * y_d, h[b])

    @jit.njit(**_opts)
    def _gru_reset(zr, h, rh, std, act, al, be, clip, lbr):
        # Before (r * h) @ Rh (or, with linear_before_reset, the whole step) can run: z, r activated
        # (std: r only; z waits for _gru_update) and rh = r * h.
        n = h.shape[0]
        r = zr[n:]
        if std:
            if not lbr:
                sl = min(_HALF * clip, _SATURATE)
                for j in range(n):
                    rj = _sigmoid32(r[j], sl)
                    r[j] = rj
                    rh[j] = rj * h[j]
            return
        for j in range(2 * n):
            zr[j] = _clamp(zr[j], clip)
        _activate(zr, act[0], al[0], be[0])
        if not lbr:
            for j in range(n):
                rh[j] = r[j] * h[j]

    @jit.njit(**_opts)
    def _gru_update(zr, x, rec, h, std, act, al, be, clip, lbr):
        # x: the h gate's input part; rec: h @ Rh + Rbh (linear_before_reset) or (r * h) @ Rh.
        n = h.shape[0]
        z, r = zr[:n], zr[n:]
        if std:
            tl, sl = min(clip, _SATURATE), min(_HALF * clip, _SATURATE)
            for j in range(n):
                zj = _sigmoid32(z[j], sl)
                if lbr:
                    ht = _tanh32(x[j] + _sigmoid32(r[j], sl) * rec[j], tl)
                else:
                    ht = _tanh32(x[j] + rec[j], tl)
                h[j] = ht + zj * (h[j] - ht)  # (1 - z) * h~ + z * h
            return
        for j in range(n):
            x[j] = _clamp(x[j] + (r[j] * rec[j] if lbr else rec[j]), clip)
        _activate(x, act[1], al[1], be[1])
        for j in range(n):
            h[j] = x[j] + z[j] * (h[j] - x[j])

    @jit.njit(**_opts)
    def _gru_kernel(proj, x_t, x_b, bias, rt_zr, rt_h, rbh, hs, lens, y, y_t, y_b, y_d, reverse,
                    std, acts, alphas, betas, clip, lbr, start, stop):
        n_dir, batch, n = hs.shape
        blocks = (batch + 3) // 4
        zr, x, rec = np.zeros((4, 2 * n), hs.dtype), np.zeros((4, n), hs.dtype), np.zeros((4, n), hs.dtype)
        rh = np.zeros((batch, n), hs.dtype)
        for item in range(start, stop):
            d, b0 = item // blocks, (item % blocks) * 4
            nb = min(4, batch - b0)
            h, rev, act, al, be = hs[d], reverse[d], acts[d], alphas[d], betas[d]
            for s in range(_block_len(lens, b0, nb)):
                _load_inputs(proj, x_t, x_b, d * 3 * n, bias, lens, b0, nb, s, rev, zr)
                _load_inputs(proj, x_t, x_b, d * 3 * n + 2 * n, bias, lens, b0, nb, s, rev, x)
                for i in range(nb):
                    for j in range(n):
                        rec[i, j] = rbh[d, j]
                _matvec(h, b0, nb, rt_zr[d], zr)
                if lbr:
                    _matvec(h, b0, nb, rt_h[d], rec)
                for i in range(nb):
                    if s < lens[b0 + i]:
                        _gru_reset(zr[i], h[b0 + i], rh[b0 + i], std, act, al, be, clip, lbr)
                if not lbr:
                    _matvec(rh, b0, nb, rt_h[d], rec)
                for i in range(nb):
                    b = b0 + i
                    if s < lens[b]:
                        _gru_update(zr[i], x[i], rec[i], h[b], std, act, al, be, clip, lbr)
                        _store(y, _step_time(lens, b, s, rev) * y_t + b * y_b + d * y_d, h[b])

    @jit.njit(**_opts)
    def _rnn_kernel(proj, x_t, x_b, bias, rt, hs, lens, y, y_t, y_b, y_d, reverse,
                    std, acts, alphas, betas, clip, start, stop):
        n_dir, batch, n = hs.shape
        blocks = (batch + 3) // 4
        g = np.zeros((4, n), hs.dtype)
        for item in range(start, stop):
            d, b0 = item // blocks, (item % blocks) * 4
            nb = min(4, batch - b0)
            h, rev = hs[d], reverse[d]
            for s in range(_block_len(lens, b0, nb)):
                _load_inputs(proj, x_t, x_b, d * n, bias, lens, b0, nb, s, rev, g)
                _matvec(h, b0, nb, rt[d], g)
                for i in range(nb):
                    b = b0 + i
                    if s < lens[b]:
                        gi, hb = g[i], h[b]
                        if std:
                            tl = min(clip, _SATURATE)
                            for j in range(n):
                                hb[j] = _tanh32(gi[j], tl)
                        else:
                            for j in range(n):
                                gi[j] = _clamp(gi[j], clip)
                            _activate(gi, acts[d, 0], alphas[d, 0], betas[d, 0])
                            for j in range(n):
                                hb[j] = gi[j]
                        _store(y, _step_time(lens, b, s, rev) * y_t + b * y_b + d * y_d, hb)


# ---------------------------------------------------------------- NumPy recurrence

def _np_activation(code: int, a: float, b: float) -> Callable[[np.ndarray], np.ndarray]:
    """The NumPy form of an activation code: f(x) -> a new array."""
    table: dict[int, Callable[[np.ndarray], np.ndarray]] = {
        THRESHOLDED_RELU: lambda x: np.where(x > a, x, 0).astype(x.dtype),
        SOFTSIGN: lambda x: x / (1 + np.abs(x)),
        AFFINE: lambda x: (a * x + b).astype(x.dtype),
        SCALED_TANH: lambda x: (a * np.tanh(b * x)).astype(x.dtype),
    }
    if code in table:
        return table[code]
    op, params = {SIGMOID: ("Sigmoid", {}), TANH: ("Tanh", {}), RELU: ("Relu", {}),
                  HARD_SIGMOID: ("HardSigmoid", {"alpha": a, "beta": b}), LEAKY_RELU: ("LeakyRelu", {"alpha": a}),
                  ELU: ("Elu", {"alpha": a}), SOFTPLUS: ("Softplus", {})}[code]
    f = activations.bind(np, op, params, may_be_half=False)
    return lambda x: f(x, None)


@dataclass
class _Walk:
    """One direction of one call, as the NumPy loop sees it: [T, B, ...] views."""

    proj: np.ndarray  # (T, B, gates * hidden), biases included
    y: np.ndarray  # (T, B, hidden) view of Y
    h: np.ndarray  # (B, hidden), updated in place
    c: np.ndarray | None
    lens: np.ndarray
    reverse: bool


def _np_cell(a: Attrs, wts: Weights, d: int, fs: list[Callable[[np.ndarray], np.ndarray]],
             g: np.ndarray, h: np.ndarray, c: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """One step for every row: (new h, new c) from the gate inputs g = x-projection (+ h @ R)."""
    n, clip = wts.hidden, a.clip
    cl = (lambda v: np.clip(v, -clip, clip)) if clip > 0 else (lambda v: v)
    rt = wts.rt[d]
    if a.op == "RNN":
        return fs[0](cl(g + h @ rt)), None
    if a.op == "GRU":
        zr = fs[0](cl(g[:, :2 * n] + h @ rt[:, :2 * n]))
        z, r = zr[:, :n], zr[:, n:]
        rec = r * (h @ rt[:, 2 * n:] + wts.rbh[d]) if a.linear_before_reset else (r * h) @ rt[:, 2 * n:]
        ht = fs[1](cl(g[:, 2 * n:] + rec))
        return ht + z * (h - ht), None
    assert c is not None
    g = g + h @ rt
    p = wts.peep[d]
    i = fs[0](cl(g[:, :n] + p[:n] * c))
    f = 1 - i if a.input_forget else fs[0](cl(g[:, 2 * n:3 * n] + p[2 * n:] * c))
    c_new = f * c + i * fs[1](cl(g[:, 3 * n:]))
    o = fs[0](cl(g[:, n:2 * n] + p[n:2 * n] * c_new))
    return o * fs[2](c_new), c_new


def _np_direction(a: Attrs, wts: Weights, d: int, walk: _Walk) -> None:
    fs = [_np_activation(int(k), float(al), float(be)) for k, al, be in zip(a.acts[d], a.alphas[d], a.betas[d])]
    rows = np.arange(walk.h.shape[0])
    for s in range(int(walk.lens.max(initial=0))):
        live = s < walk.lens
        t = np.maximum(walk.lens - 1 - s, 0) if walk.reverse else np.full_like(walk.lens, s)
        h, c = _np_cell(a, wts, d, fs, walk.proj[t, rows], walk.h, walk.c)
        walk.h[live] = h[live]
        if walk.c is not None and c is not None:
            walk.c[live] = c[live]
        walk.y[t[live], rows[live]] = h[live]


# ---------------------------------------------------------------- the kernel

def _state(v: np.ndarray | None, a: Attrs, batch: int, hidden: int, dtype: np.dtype, what: str, name: str) -> np.ndarray:
    """An initial state as a fresh (directions, batch, hidden) array the kernels update in place."""
    if v is None:
        return np.zeros((a.directions, batch, hidden), dtype)
    want = (batch, a.directions, hidden) if a.layout else (a.directions, batch, hidden)
    if v.shape != want:
        raise ValueError(f"{a.op} {name}: {what} has shape {list(v.shape)}, expected {list(want)}")
    return np.array(v.transpose(1, 0, 2) if a.layout else v, dtype=dtype, order="C")


def _lengths(v: np.ndarray | None, batch: int, steps: int, op: str, name: str) -> np.ndarray:
    if v is None:
        return np.full(batch, steps, np.int32)
    lens = np.asarray(v).astype(np.int32).reshape(-1)
    if lens.shape != (batch,) or (lens.size and (lens.min() < 0 or lens.max() > steps)):
        raise ValueError(f"{op} {name}: sequence_lens {lens.tolist()} must be {batch} lengths in [0, {steps}]")
    return lens


def _project(x2: np.ndarray, wt: np.ndarray) -> np.ndarray:
    """Every step's input projection, one GEMM; small ones skip the thread split's dispatch layers."""
    if x2.shape[0] * x2.shape[1] * wt.shape[1] < blas.MIN_MKL_MACS:
        return np.matmul(x2, wt)
    return parallel.matmul(x2, wt)


class _Runner:
    """Runs one node: the input GEMM, then the recurrence (numba, else NumPy) per call.

    Holds nothing a call writes: the executors may run one node for two requests at once."""

    def __init__(self, spec: KernelSpec, a: Attrs, fixed: Weights | None) -> None:
        self.name, self.a, self.fixed = spec.name, a, fixed
        self.n_outputs = max(1, spec.n_outputs)
        self.is_lstm = a.op == "LSTM"
        f32 = np.float32
        # The numba kernels' parameters (float32 only), once.
        self.jit_params = (np.array(a.reverse), a.standard, a.acts, a.alphas.astype(f32), a.betas.astype(f32),
                           f32(a.clip if a.clip > 0 else np.inf))

    def weights(self, w: np.ndarray, r: np.ndarray, b: np.ndarray | None, p: np.ndarray | None, dtype: np.dtype) -> Weights:
        if self.fixed is not None and self.fixed.rt.dtype == dtype:
            return self.fixed
        return prepare_weights(self.name, self.a, w, r, b, p, dtype)

    def __call__(self, x: np.ndarray, w: np.ndarray, r: np.ndarray, b: np.ndarray | None = None,
                 seq_lens: np.ndarray | None = None, h0: np.ndarray | None = None, c0: np.ndarray | None = None,
                 p: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        a = self.a
        if x.ndim != 3 or x.dtype.kind != "f":
            raise ValueError(f"{a.op} {self.name}: X must be a 3-D float tensor, got {x.dtype} {list(x.shape)}")
        dtype = _compute_dtype(x.dtype)
        wts = self.weights(w, r, b, p if self.is_lstm else None, dtype)
        steps, batch = (x.shape[1], x.shape[0]) if a.layout else (x.shape[0], x.shape[1])
        if x.shape[2] != wts.wt.shape[0]:
            raise ValueError(f"{a.op} {self.name}: X has {x.shape[2]} features, W expects {wts.wt.shape[0]}")
        n, nd = wts.hidden, a.directions
        lens = _lengths(seq_lens, batch, steps, a.op, self.name)
        ragged = seq_lens is not None and bool((lens < steps).any())
        proj = _project(np.ascontiguousarray(x, dtype=dtype).reshape(-1, x.shape[2]), wts.wt)
        hs = _state(h0, a, batch, n, dtype, "initial_h", self.name)
        cs = _state(c0, a, batch, n, dtype, "initial_c", self.name) if self.is_lstm else hs[:, :0]  # GRU, RNN: unused
        y_shape = (batch, steps, nd, n) if a.layout else (steps, nd, batch, n)
        y = np.zeros(y_shape, dtype) if ragged else np.empty(y_shape, dtype)  # rows past a sequence's end stay 0
        if jit.AVAILABLE and dtype == np.float32:
            self._jit(wts, proj, hs, cs, lens, y, steps, batch)
        else:
            proj += wts.bias
            self._numpy(wts, proj, hs, cs if self.is_lstm else None, lens, y, steps, batch)
        states = [hs, cs] if self.is_lstm else [hs]
        if (ragged or steps == 0) and not lens.all():  # a sequence with no step ends with zero states
            for st in states:
                st[:, lens == 0] = 0
        if a.layout:
            states = [np.ascontiguousarray(st.transpose(1, 0, 2)) for st in states]
        return tuple(o.astype(x.dtype, copy=False) for o in [y, *states][: self.n_outputs])

    def _jit(self, wts: Weights, proj: np.ndarray, hs: np.ndarray, cs: np.ndarray, lens: np.ndarray,
             y: np.ndarray, steps: int, batch: int) -> None:
        a, nd = self.a, self.a.directions
        x_t, x_b = (1, steps) if a.layout else (batch, 1)  # rows of proj and of Y, by (time, batch, direction)
        y_t, y_b, y_d = (nd, steps * nd, 1) if a.layout else (nd * batch, 1, batch)
        tail = (lens, y.reshape(-1, wts.hidden), y_t, y_b, y_d, *self.jit_params)
        args: tuple[Any, ...]
        if a.op == "LSTM":
            kernel, args = _lstm_kernel, (proj, x_t, x_b, wts.bias, wts.rt, wts.peep, hs, cs, *tail, a.input_forget)
        elif a.op == "GRU":
            kernel, args = _gru_kernel, (proj, x_t, x_b, wts.bias, wts.rt_zr, wts.rt_h, wts.rbh, hs, *tail,
                                         a.linear_before_reset)
        else:
            kernel, args = _rnn_kernel, (proj, x_t, x_b, wts.bias, wts.rt, hs, *tail)
        jit.run_split(kernel, args, nd * ((batch + 3) // 4), y.size)

    def _numpy(self, wts: Weights, proj: np.ndarray, hs: np.ndarray, cs: np.ndarray | None, lens: np.ndarray,
               y: np.ndarray, steps: int, batch: int) -> None:
        a, gw = self.a, self.a.gates * wts.hidden
        p3 = proj.reshape(batch, steps, -1).transpose(1, 0, 2) if a.layout else proj.reshape(steps, batch, -1)
        for d in range(a.directions):
            yd = y[:, :, d].transpose(1, 0, 2) if a.layout else y[:, d]
            walk = _Walk(p3[:, :, d * gw:(d + 1) * gw], yd, hs[d], None if cs is None else cs[d], lens, a.reverse[d])
            _np_direction(a, wts, d, walk)


@register(["RNN", "GRU", "LSTM"], _recurrent_shape)
def recurrent(spec: KernelSpec) -> Run:
    """Inputs X, W, R, [B, sequence_lens, initial_h, (LSTM) initial_c, P]; outputs Y, Y_h, (LSTM) Y_c."""
    a = parse_attrs(spec)
    w, r = spec.const(1), spec.const(2)
    b = spec.const(3) if spec.has(3) else None
    has_p = spec.op == "LSTM" and spec.has(7)
    p = spec.const(7) if has_p else None
    fixed = None
    if w is not None and r is not None and (b is not None or not spec.has(3)) and (p is not None or not has_p):
        try:
            fixed = prepare_weights(spec.name, a, w, r, b, p, _compute_dtype(w.dtype))
        except ValueError as e:
            raise refuse(spec, str(e), "weights shaped as the ONNX operator defines them") from None
    return _Runner(spec, a, fixed)
