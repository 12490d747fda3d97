"""Squeeze-and-excitation in one kernel: the channel means of x, two small dense layers on them
(the gate), and x scaled by the gate, per image (passes/squeeze_excite.py makes the node).

Unfused, a block is four steps (a global pool, two 1x1 convolutions on one pixel, a multiply),
three of them a few microseconds of arithmetic each, and each step after a big convolution finds
the caches cold. Here images in NHWC are one call of the OpenMP team. Where the team divides the
batch, each member takes whole images: it sums one, computes its gate and scales it while it is
still in its core's cache. Otherwise each member sums its rows of every image, waits for the
others, computes the gate itself (small) and scales the same rows. Blocked tensors (a batch from onednn.BLOCKED_MIN_BATCH up) take the
pool, GEMMs and the blocked scale, where the dense layers are real GEMMs. At one image in a chain,
gate_fold.py may take `weights_call` instead: the gate scales the next 1x1 convolution's weights
rather than the image.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import activations, jit, omp, onednn
from .omp import TeamChoice
from .primitive_chain import KernelCall, Link, linkable
from .registry import KernelSpec, Run, register, same_as_input

# The gate's activations as the team kernel computes them (what squeeze-and-excitation blocks
# use), by activation op; a block with another keeps its unfused nodes.
NONE, CLAMP, SILU, SIGMOID, HARD_SIGMOID = range(5)


def gate_form(act: activations.Act | None) -> tuple[int, float, float] | None:
    """(form, a, b) of a dense layer's activation for the team kernel; None where it has no form."""
    parsed = activations.parse(act)
    if parsed is None:
        return (NONE, 0.0, 0.0)
    entry, p = parsed
    if entry.op == "Relu":
        return (CLAMP, 0.0, np.inf)
    if entry.op == "Clip" and entry.scalar is not None:
        scalar = entry.scalar(p)
        return None if scalar is None else (CLAMP, scalar[1], scalar[2])
    if entry.op == "HardSigmoid":
        return (HARD_SIGMOID, float(p["alpha"]), float(p["beta"]))
    return {"Silu": (SILU, 0.0, 0.0), "Sigmoid": (SIGMOID, 0.0, 0.0)}.get(entry.op)


# The team's parameter block (int64): addresses, sizes, forms; bounds is a float32 (4,) array.
# _WT, _O: the (C, O) weights a folded gate scales (gate_fold.py), their output count.
_X, _OUT, _N, _HW, _C, _CR, _W1, _B1, _W2, _B2, _FORM1, _FORM2, _BOUNDS, _SCRATCH, _THREAD_NUM, _NUM_THREADS, _BARRIER, _PLACE, _WT, _O, _SIZE = range(21)
_PARALLEL, _MEMBER = _SIZE, _SIZE + 1  # after the block, where only _run reads them: the team's entry points

if jit.AVAILABLE and omp.PARALLEL:
    from numba import carray

    # In place, one compiled loop per form: exp is jit.expf, so each loop vectorizes (branching on
    # the form inside one function kept LLVM from vectorizing the exp loops).
    @jit.njit(cache=True, nogil=True, error_model="numpy")
    def _silu(v):
        for i in range(v.size):
            v[i] = v[i] / (np.float32(1) + jit.expf(-v[i]))

    @jit.njit(cache=True, nogil=True, error_model="numpy")
    def _sigmoid(v):
        for i in range(v.size):
            v[i] = np.float32(1) / (np.float32(1) + jit.expf(-v[i]))

    @jit.njit(cache=True, nogil=True, error_model="numpy")
    def _affine_clamp(v, scale, shift, lo, hi):
        for i in range(v.size):
            v[i] = min(max(scale * v[i] + shift, lo), hi)

    @jit.njit(cache=True, nogil=True)
    def _activate(v, form, a, b):
        if form == CLAMP:
            _affine_clamp(v, np.float32(1), np.float32(0), a, b)
        elif form == SILU:
            _silu(v)
        elif form == SIGMOID:
            _sigmoid(v)
        elif form == HARD_SIGMOID:
            _affine_clamp(v, a, b, np.float32(0), np.float32(1))

    @jit.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    def _dense(src, w, b, dst):
        # dst = w @ src + b as dot products: reductions vectorize where scattered updates do not
        for j in range(dst.size):
            v = b[j]
            wj = w[j]
            for k in range(src.size):
                v += src[k] * wj[k]
            dst[j] = v

    @jit.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    def _squeeze(rows, lo, hi, acc):
        # acc = sum of rows[lo:hi], four rows per pass over acc: its loads and stores, not the
        # rows', bound a loop of one row per pass at the few channels of early blocks
        acc[:] = 0
        r = lo
        while r + 4 <= hi:
            a, b, c, d = rows[r], rows[r + 1], rows[r + 2], rows[r + 3]
            for ch in range(acc.size):
                acc[ch] += (a[ch] + b[ch]) + (c[ch] + d[ch])
            r += 4
        for r in range(r, hi):
            row = rows[r]
            for ch in range(acc.size):
                acc[ch] += row[ch]

    @jit.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    def _gate(q, means, hidden):
        # means -> gate, in means' place (the means are spent once the hidden layer holds them)
        w1 = carray(jit.float32s_at(q[_W1]), (q[_CR], q[_C]))
        b1 = carray(jit.float32s_at(q[_B1]), (q[_CR],))
        w2 = carray(jit.float32s_at(q[_W2]), (q[_C], q[_CR]))
        b2 = carray(jit.float32s_at(q[_B2]), (q[_C],))
        bounds = carray(jit.float32s_at(q[_BOUNDS]), (4,))
        _dense(means, w1, b1, hidden)
        _activate(hidden, q[_FORM1], bounds[0], bounds[1])
        _dense(hidden, w2, b2, means)
        _activate(means, q[_FORM2], bounds[2], bounds[3])

    @jit.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    def _excite(q, means, hidden, rows, out, lo, hi):
        # means -> gate (in means' place), then out[lo:hi] = rows[lo:hi] * gate
        _gate(q, means, hidden)
        gate = means
        for r in range(lo, hi):
            row, orow = rows[r], out[r]
            for ch in range(gate.size):
                orow[ch] = row[ch] * gate[ch]

    @jit.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    def _team_means(sums, i, inv, means):
        # image i's channel means from every member's sums of its rows (sums: team, n, c), added
        # in member order
        for ch in range(means.size):
            total = np.float32(0)
            for t in range(sums.shape[0]):
                total += sums[t, i, ch]
            means[ch] = total * inv

    @jit.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    def _share(q, team, me):
        n, hw, c, cr = q[_N], q[_HW], q[_C], q[_CR]
        x = carray(jit.float32s_at(q[_X]), (n, hw, c))
        out = carray(jit.float32s_at(q[_OUT]), (n, hw, c))
        sums = carray(jit.float32s_at(q[_SCRATCH]), (team, n, c))
        # what a member writes often is its own (a heap array, its sums written once): members
        # writing into one cache line (neighbouring rows of the scratch) took turns at it
        mine = np.empty(c + cr, np.float32)
        means, hidden = mine[:c], mine[c:]
        inv = np.float32(1.0 / hw)
        if n % team == 0:  # whole images per member: the scale re-reads an image this core just summed
            for i in range(n * me // team, n * (me + 1) // team):
                _squeeze(x[i], 0, hw, means)
                for ch in range(c):
                    means[ch] *= inv
                _excite(q, means, hidden, x[i], out[i], 0, hw)
            return
        lo, hi = hw * me // team, hw * (me + 1) // team
        local = np.empty(c, np.float32)
        for i in range(n):  # squeeze: this member's rows of each image
            _squeeze(x[i], lo, hi, local)
            sums[me, i] = local
        jit.c_call0(q[_BARRIER])
        for i in range(n):  # excite: every member computes the whole gate, then scales its rows
            _team_means(sums, i, inv, means)
            _excite(q, means, hidden, x[i], out[i], lo, hi)

    @jit.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
    def _scale_weights(q, team, me):
        # one image: the gate as _share computes it (each member's rows summed, _team_means), then
        # out = wt scaled by the gate along its rows, each member its rows
        hw, c, o = q[_HW], q[_C], q[_O]
        x = carray(jit.float32s_at(q[_X]), (hw, c))
        sums = carray(jit.float32s_at(q[_SCRATCH]), (team, 1, c))
        mine = np.empty(2 * c + q[_CR], np.float32)
        local, means, hidden = mine[:c], mine[c:2 * c], mine[2 * c:]
        _squeeze(x, hw * me // team, hw * (me + 1) // team, local)
        sums[me, 0] = local
        jit.c_call0(q[_BARRIER])
        _team_means(sums, 0, np.float32(1.0 / hw), means)
        _gate(q, means, hidden)
        wt = carray(jit.float32s_at(q[_WT]), (c, o))
        out = carray(jit.float32s_at(q[_OUT]), (c, o))
        for ch in range(c * me // team, c * (me + 1) // team):
            g, src, dst = means[ch], wt[ch], out[ch]
            for j in range(o):
                dst[j] = src[j] * g

    def _weights_member(data):  # compiled into a C callable by jit.entry_address
        q = carray(jit.int64s_at(data), (_SIZE,))
        me = jit.c_call0(q[_THREAD_NUM])
        omp.apart(q[_PLACE], me)
        _scale_weights(q, jit.c_call0(q[_NUM_THREADS]), me)

    @jit.njit(cache=True)
    def _scratch_floats(team, n, c, cr):
        # every member's channel sums of every image, each written once
        return team * n * c

    def _member(data):  # compiled into a C callable by jit.entry_address
        q = carray(jit.int64s_at(data), (_SIZE,))
        me = jit.c_call0(q[_THREAD_NUM])
        omp.apart(q[_PLACE], me)
        _share(q, jit.c_call0(q[_NUM_THREADS]), me)

    @jit.njit(cache=True, nogil=True)
    def _run(consts, x, out, threads):
        q = consts.copy()
        n, hw, c = x.shape
        scratch = np.empty(_scratch_floats(threads, n, c, q[_CR]), np.float32)
        q[_X], q[_OUT], q[_N], q[_HW], q[_SCRATCH] = x.ctypes.data, out.ctypes.data, n, hw, scratch.ctypes.data
        jit.c_call4(q[_PARALLEL], q[_MEMBER], q.ctypes.data, threads, 0)
        return scratch.shape[0]  # a use after the team's: the scratch lives until the team is done


@dataclass(frozen=True)
class SqueezeExciteCall(KernelCall):
    """A block's team kernel as a chain runs it, with the block it computes (gate_fold.py may
    fold its gate into the next convolution's weights)."""

    se: "SqueezeExcite | None" = None


class SqueezeExcite:
    """y = x * act2(act1(mean_hw(x) @ w1.T + b1) @ w2.T + b2) per image, for float32 x in NHWC or
    blocked: w1 (Cr, C) and w2 (C, Cr), the two 1x1 convolutions' weights."""

    def __init__(self, w1: np.ndarray, b1: np.ndarray | None, act1: activations.Act | None,
                 w2: np.ndarray, b2: np.ndarray | None, act2: activations.Act | None, name: str) -> None:
        self.cr, self.c = w1.shape
        self.name = name
        self.w1, self.w2 = np.ascontiguousarray(w1, np.float32), np.ascontiguousarray(w2, np.float32)
        self.b1 = np.zeros(self.cr, np.float32) if b1 is None else np.ascontiguousarray(b1, np.float32)
        self.b2 = np.zeros(self.c, np.float32) if b2 is None else np.ascontiguousarray(b2, np.float32)
        self.act1, self.act2 = activations.epilogue(np, act1, False), activations.epilogue(np, act2, False)
        forms = gate_form(act1), gate_form(act2)
        self.team_consts: np.ndarray | None = None
        if jit.AVAILABLE and omp.PARALLEL and forms[0] is not None and forms[1] is not None:
            self.bounds = np.array([forms[0][1], forms[0][2], forms[1][1], forms[1][2]], np.float32)
            q = np.zeros(_SIZE + 2, np.int64)
            q[[_C, _CR, _W1, _B1, _W2, _B2, _FORM1, _FORM2, _BOUNDS]] = [
                self.c, self.cr, self.w1.ctypes.data, self.b1.ctypes.data, self.w2.ctypes.data, self.b2.ctypes.data,
                forms[0][0], forms[1][0], self.bounds.ctypes.data]
            q[[_THREAD_NUM, _NUM_THREADS, _BARRIER, _PLACE, _PARALLEL, _MEMBER]] = [
                omp.THREAD_NUM, omp.NUM_THREADS, omp.BARRIER, omp.PLACE, omp.PARALLEL, jit.entry_address(_member)]
            self.team_consts = q
        self._choices: dict[tuple[int, ...], TeamChoice] = {}
        self._pool = onednn.Pool2D("pooling_avg_exclude_padding", (), [1, 1], [1, 1], name) if onednn.AVAILABLE else None

    def call_for(self, shape: tuple[int, ...]) -> KernelCall | None:
        """The team kernel for NHWC inputs of `shape`, as a primitive chain runs it; None where the
        team kernel does not run (blocked input, a gate activation it has no form for)."""
        consts = self.team_consts
        if consts is None or len(shape) != 4 or shape[3] != self.c:
            return None
        n, h, w, c = shape
        cr = self.cr

        def block() -> tuple[np.ndarray, Any]:
            scratch = np.empty(_scratch_floats(omp.TEAM, n, c, cr), np.float32)  # for the largest team the chain runs it on
            q = consts.copy()
            q[[_N, _HW, _SCRATCH]] = [n, h * w, scratch.ctypes.data]
            return q, scratch
        return SqueezeExciteCall(int(consts[_MEMBER]), block, _X, _OUT, shape, team=True, se=self)

    def weights_call(self, shape: tuple[int, ...], wt: np.ndarray) -> KernelCall | None:
        """For one NHWC image of `shape`: the team kernel that computes this block's gate and
        writes `wt` (C, O), a 1x1 convolution's weights, scaled by it along C, reading the image
        from its source field and writing the weights at its destination field; None where the
        team kernel does not run."""
        consts = self.team_consts
        if consts is None or len(shape) != 4 or shape[0] != 1 or shape[3] != self.c or wt.shape[0] != self.c:
            return None
        _, h, w, c = shape
        o = wt.shape[1]
        weights = np.ascontiguousarray(wt, np.float32)

        def block() -> tuple[np.ndarray, Any]:
            scratch = np.empty(omp.TEAM * c, np.float32)  # for the largest team the chain runs it on
            q = consts.copy()
            q[[_N, _HW, _SCRATCH, _WT, _O]] = [1, h * w, scratch.ctypes.data, weights.ctypes.data, o]
            return q, (scratch, weights)
        return KernelCall(_weights_entry(), block, _X, _OUT, (c, o), team=True)

    def gate(self, means: np.ndarray) -> np.ndarray:
        """(N, C) channel means -> (N, C) gate, on NumPy."""
        hidden = means @ self.w1.T + self.b1
        if self.act1 is not None:
            self.act1(hidden, hidden)
        g = hidden @ self.w2.T + self.b2
        if self.act2 is not None:
            self.act2(g, g)
        return g.astype(np.float32, copy=False)

    def __call__(self, x: np.ndarray, overwrite: bool = False) -> np.ndarray:
        if x.dtype != np.float32:
            raise ValueError(f"SqueezeExcite {self.name}: expected a float32 input, got {x.dtype}")
        c = x.shape[-1] * (x.shape[1] if x.ndim == 5 else 1)
        if c != self.c:
            raise ValueError(f"SqueezeExcite {self.name}: input has {c} channels, the gate's weights expect {self.c}")
        out = x if overwrite and x.flags.writeable and x.flags.c_contiguous else np.empty(x.shape, np.float32)
        if x.ndim == 5:  # blocked: the pool reads the blocks, the dense layers are GEMMs over the batch
            n = x.shape[0]
            assert self._pool is not None, "blocked tensors exist only where oneDNN runs"
            means = self._pool(x, 1, 1, [0, 0], [0, 0]).reshape(n, c)
            return jit.scale_blocked(x, self.gate(means).reshape(n, 1, 1, c), out)
        n, h, w, _ = x.shape
        consts = self.team_consts
        if consts is None:
            g = self.gate(x.reshape(n, h * w, c).mean(axis=1, dtype=np.float32))
            np.multiply(x, g.reshape(n, 1, 1, c), out=out)
            return out
        rows = np.ascontiguousarray(x).reshape(n, h * w, c)
        omp.timed(omp.choice_for(self._choices, x.shape, keeps_apart=False), lambda threads: _run(consts, rows, out.reshape(n, h * w, c), threads))
        return out


@functools.cache
def _weights_entry() -> int:
    return jit.entry_address(_weights_member)


def _weights(spec: KernelSpec) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    w1, b1, w2, b2 = (spec.const(i) for i in range(1, 5))
    if w1 is None or w2 is None:
        raise ValueError(f"SqueezeExcite {spec.name}: the gate's weights must be constants")
    return w1, b1, w2, b2


@register("SqueezeExciteNHWC", same_as_input)
def squeeze_excite(spec: KernelSpec) -> Run:
    w1, b1, w2, b2 = _weights(spec)
    act1, act2 = spec.attrs.get("activations") or (None, None)
    se = SqueezeExcite(w1, b1, act1, w2, b2, act2, spec.name)
    overwrite = 0 in spec.inplace

    def run(x: np.ndarray, *_consts: Any) -> tuple[np.ndarray, ...]:
        return (se(x, overwrite),)

    def link(x: np.ndarray, *_consts: Any) -> Link | None:
        call = se.call_for(x.shape)
        return None if call is None else Link(call, 0, x.shape, into=0 if overwrite else None)

    return linkable(run, link)
