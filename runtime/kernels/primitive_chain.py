"""Runs of oneDNN steps (and jitted kernels between them) as one compiled call: a chain.

Why: a plan step costs Python besides its primitive (the kernel's closure, the call site's checks,
a fresh result array, the team choice's timer), microseconds that a small batch's primitives do
not hide: MobileNetV2 runs fifty convolutions per image, most of them shorter than a hundred
microseconds. A plan captures, per input signature, the runs of steps whose kernels say they are
one primitive for these operands, or one jitted kernel with a C entry (`Link`), and plans their
buffers once (runtime/capture.py); a chain runs them from one jitted loop that only points its
inputs and results at this call's arrays. The primitives and kernels are the steps' own, so the
results are the same bits, but where capture.py folds a squeeze-and-excitation gate into the next
convolution's weights (gate_fold.py): there they are within float32's tolerance.

Memory: the chain's inner values live in an arena, one per concurrent caller (taken and given back
per call), its results are fresh arrays as every kernel's are. The team choice (omp.TeamChoice) is
made for the chain as a whole, and so is whether its team runs the bands bands.py cut (BandsChoice).
"""
from __future__ import annotations

import ctypes
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import jit, omp, onednn
from .buffers import aligned, whole_lines
from .registry import Run

INPUT, RESULT, ARENA = range(3)  # where a chain buffer lives: a caller's array, a fresh array per call, the arena
# how a chain's rows run: on the team with runs of layers in bands where bands.py cut them, on one
# thread, on the team layer by layer
BANDS, ALONE, LAYERS = range(3)


@dataclass(frozen=True)
class KernelCall:
    """A jitted kernel a chain calls by address: `entry(block)` on the OpenMP team (GOMP_parallel)
    where `team`, else on the calling thread. `block()` makes one runner's parameter block (int64),
    with what keeps its scratch alive; before each call the chain writes the source's and the
    destination's addresses into its fields `src_field` and `dst_field`."""

    entry: int
    block: Callable[[], tuple[np.ndarray, Any]]
    src_field: int
    dst_field: int
    shape: tuple[int, ...]  # of the destination
    team: bool
    src_dtype: np.dtype = np.dtype(np.float32)
    dst_dtype: np.dtype = np.dtype(np.float32)


Callee = onednn.Site | KernelCall  # what a chain calls for one plan step


@dataclass(frozen=True)
class Link:
    """What one plan step is for the operands of one call: `step` reading operand `src` into a
    result of `shape` (the step's destination shape, or a reshape of it). `into`: the operand
    whose buffer the result takes (a residual the primitive sums into, or the source of a kernel
    that works in place). No step: the step hands operand `src` through as it is (a layout change
    that is none at this batch, a reshape)."""

    step: Callee | None
    src: int
    shape: tuple[int, ...]
    into: int | None = None


_LINKS: "weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., Link | None]]" = weakref.WeakKeyDictionary()


def linkable(run: Run, link: Callable[..., Link | None]) -> Run:
    """Declare the kernel `run` one a chain may take in: `link(*operands)` says what it is for these
    operands, None where it is not one primitive."""
    _LINKS[run] = link
    return run


def has_link(run: Callable[..., Any]) -> bool:
    return run in _LINKS


def link_for(run: Callable[..., Any], operands: list[Any]) -> Link | None:
    link = _LINKS.get(run)
    return None if link is None else link(*operands)


@dataclass(frozen=True)
class Buffer:
    """Memory that one or more of a chain's values live in: the chain's `index`-th input, a fresh
    array per call, or bytes at offset `index` of the arena. Values that share one are a step's
    result written over its residual, or handed through."""

    kind: int
    index: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Row:
    """One call of a chain: its step, read from buffer `src` into buffer `dst`. `weights`: a buffer
    a primitive reads as its weights instead of its own, where an earlier row writes them per call
    (gate_fold.py)."""

    step: Callee
    src: int
    dst: int
    weights: int | None = None


HEADER = 5  # a chain's pointer table starts with: set a memory's data pointer, execute, wait, the stream, start a team
PRIMITIVE, CALL = range(2)  # a table row's kind


if jit.AVAILABLE and onednn.AVAILABLE and omp.PARALLEL:
    from numba import carray, literal_unroll

    @jit.njit(cache=True, nogil=True)
    def _run_rows(table, ptrs, inputs, results):
        # ptrs: HEADER, then a pointer per buffer: the inputs', the results' (set here: a jitted
        # call reads an array's address for far less than Python does), then the arena's. Table
        # rows: PRIMITIVE, primitive, argument count, packed arguments, source memory and the
        # buffer whose pointer it takes (-1: fixed in the arena), destination memory and its
        # buffer; or CALL, entry, parameter block, team size (0: the calling thread alone), source
        # field and buffer, destination field and buffer.
        slot = HEADER
        for x in literal_unroll(inputs):
            ptrs[slot] = x.ctypes.data
            slot += 1
        for y in literal_unroll(results):
            ptrs[slot] = y.ctypes.data
            slot += 1
        set_handle, execute, stream = ptrs[0], ptrs[1], ptrs[3]
        for i in range(table.shape[0]):
            r = table[i]
            if r[0] == CALL:
                block = carray(jit.int64s_at(r[2]), (max(r[4], r[6]) + 1,))
                block[r[4]] = ptrs[HEADER + r[5]]
                block[r[6]] = ptrs[HEADER + r[7]]
                if r[3] > 0:
                    jit.c_call4(ptrs[4], r[1], r[2], r[3], 0)
                else:
                    jit.c_call1(r[1], r[2])
                continue
            if r[5] >= 0:
                status = jit.c_call2(set_handle, r[4], ptrs[HEADER + r[5]])
                if status != 0:
                    return status
            if r[7] >= 0:
                status = jit.c_call2(set_handle, r[6], ptrs[HEADER + r[7]])
                if status != 0:
                    return status
            status = jit.c_call4(execute, r[1], stream, r[2], r[3])
            if status != 0:
                return status
        return jit.c_call1(ptrs[2], stream)
else:
    _run_rows = None

AVAILABLE = _run_rows is not None


class _Arena:
    """One caller's memory for a chain: its inner buffers, the primitives' arguments bound to them
    (per team size, made when first run), a scratchpad and a stream."""

    def __init__(self, chain: "PrimitiveChain") -> None:
        self.chain = chain
        self.memory = aligned(max(chain.arena_bytes, 1))
        self.stream = onednn.Stream()
        base = self.memory.ctypes.data
        self.ptrs = np.array([*onednn.C_FUNCTIONS, self.stream.handle.value or 0, omp.PARALLEL]
                             + [base + b.index if b.kind == ARENA else 0 for b in chain.buffers], dtype=np.int64)
        self.tables: list[np.ndarray | None] = [None, None, None]  # per way: BANDS, ALONE, LAYERS
        self._kept: list[list[Any]] = [[], [], []]

    def table(self, way: int) -> np.ndarray:
        found = self.tables[way]
        if found is not None:
            return found
        chain = self.chain
        serial = way == ALONE
        chain_rows = chain.team_rows if way == BANDS else chain.rows
        made = [row.step.primitive(serial) if isinstance(row.step, onednn.Site) else None for row in chain_rows]
        scratch_bytes = max([m[0].scratch_bytes for m in made if m is not None] or [0])
        scratch = aligned(scratch_bytes) if scratch_bytes else None  # rows run one after another: one scratchpad
        rows = []
        for row, m in zip(chain_rows, made):
            step = row.step
            if isinstance(step, KernelCall):
                block, keep = step.block()
                self._kept[way].append((block, keep))
                threads = (1 if serial else omp.TEAM) if step.team else 0
                rows.append([CALL, step.entry, block.ctypes.data, threads, step.src_field, row.src, step.dst_field, row.dst])
                continue
            assert m is not None
            prim, consts, _ = m
            if row.weights is not None:  # written by an earlier row of this call
                consts = [int(self.ptrs[HEADER + row.weights]), *consts[1:]]
            args = onednn.Arguments(prim, [int(self.ptrs[HEADER + row.src]), int(self.ptrs[HEADER + row.dst]), *consts],
                                    scratch if prim.scratch_bytes else None, self.stream)
            self._kept[way].append(args)
            src_slot = -1 if chain.buffers[row.src].kind == ARENA else row.src
            dst_slot = -1 if chain.buffers[row.dst].kind == ARENA else row.dst
            rows.append([PRIMITIVE, prim.handle.value or 0, len(args.packed), ctypes.addressof(args.packed),
                         args.mems[0].value or 0, src_slot, args.mems[1].value or 0, dst_slot])
        self._kept[way].append(scratch)
        table = self.tables[way] = np.array(rows, dtype=np.int64)
        return table


class BandsChoice:
    """Whether a chain's team runs its cut runs in bands or layer by layer, whichever is faster.
    bands.py cuts by a cost model with one machine's prices for a hand-off and a multiply-add; on
    another machine the same bands may lose (MobileNetV2's, on a 2-core AMD EPYC). So team calls
    run one way and now and then try the other for two calls: every FILL-th call until SAMPLES
    tries are in, every EXPLORE-th after. A try's time is judged against the usual way's calls
    just before it, so a machine that speeds up or slows down between tries misleads no judgement;
    the way changes when the median of the last SAMPLES tries says the other is faster. The first
    call after a switch of way is not counted: it finds the other way's data cold in the caches."""

    SAMPLES, FILL, EXPLORE = 5, 4, 64
    __slots__ = ("layers", "tries", "recent", "usual", "calls", "previous", "switched")

    def __init__(self) -> None:
        self.layers = False  # the usual way is layer by layer; at first in bands, as the cost model cut them
        self.tries: list[float] = []  # the other way's time over the usual way's, per try
        self.recent: list[float] = []  # the usual way's latest counted seconds
        self.usual: float | None = None  # their median
        self.calls = 0
        self.previous = False
        self.switched = False

    def pick(self) -> bool:
        """Whether this team call runs layer by layer."""
        self.calls += 1
        every = self.FILL if len(self.tries) < self.SAMPLES else self.EXPLORE
        way = self.layers != (self.calls % every >= every - 2)
        self.switched, self.previous = way != self.previous, way
        return way

    def record(self, layers: bool, seconds: float) -> None:
        if self.switched:
            return
        if layers == self.layers:
            self.usual = omp.steady(self.recent, seconds, 3)
            return
        if self.usual is None:
            return
        other_over_usual = omp.steady(self.tries, seconds / self.usual, self.SAMPLES)
        if len(self.tries) == self.SAMPLES and other_over_usual < 1.0:
            self.layers = layers
            self.tries = [1.0 / t for t in self.tries]
            self.recent, self.usual = [], None


class PrimitiveChain:
    """Rows of primitives over planned buffers, called as one plan step: the chain's inputs in,
    its results (`outputs`: buffer and shape of each) out. Inputs of other shapes or dtypes than
    captured (a shape that depends on data) take `fallback`, the steps the chain replaced."""

    def __init__(self, rows: list[Row], buffers: list[Buffer], outputs: list[tuple[int, tuple[int, ...]]],
                 arena_bytes: int, fallback: Callable[..., tuple[np.ndarray, ...]], name: str,
                 team_rows: list[Row] | None = None) -> None:
        if not AVAILABLE:
            raise RuntimeError("primitive chains need oneDNN and numba")
        # the inputs' buffers first (in input order), then the results', then the arena's: the order _run_rows fills them in
        order = sorted(range(len(buffers)), key=lambda i: (buffers[i].kind, buffers[i].index if buffers[i].kind == INPUT else i))
        at = {old: new for new, old in enumerate(order)}
        self.buffers = [buffers[i] for i in order]
        def moved(r: Row) -> Row:
            return Row(r.step, at[r.src], at[r.dst], None if r.weights is None else at[r.weights])
        self.rows = [moved(r) for r in rows]
        # what the team runs: the same, or with runs of layers cut into bands (kernels/bands.py)
        self.team_rows = self.rows if team_rows is None else [moved(r) for r in team_rows]
        self.outputs = [(at[b], shape) for b, shape in outputs]
        self.arena_bytes, self.fallback, self.name = arena_bytes, fallback, name
        self.expect = [(b.shape, b.dtype) for b in self.buffers if b.kind == INPUT]
        self.results = [(b.shape, b.dtype) for b in self.buffers if b.kind == RESULT]
        # what each output is: its buffer, and the shape to view it in where the buffer's differs
        self._views = [(b, None if self.buffers[b].shape == shape else shape) for b, shape in self.outputs]
        self.choice = omp.SteadyChoice()
        cut = len(self.team_rows) != len(self.rows) or any(a.step is not b.step for a, b in zip(self.team_rows, self.rows))
        self.bands = BandsChoice() if cut else None
        self._idle: list[_Arena] = []

    def __call__(self, *xs: np.ndarray) -> tuple[np.ndarray, ...]:
        for x, (shape, dtype) in zip(xs, self.expect):
            if x.shape != shape or x.dtype != dtype:
                return self.fallback(*xs)
            if not x.flags.c_contiguous:
                xs = tuple(np.ascontiguousarray(x) for x in xs)
        results = tuple([np.empty(shape, dtype) for shape, dtype in self.results])
        try:
            arena = self._idle.pop()
        except IndexError:
            arena = _Arena(self)
        try:
            choice, cut = self.choice, self.bands
            if choice.untimed():
                way = LAYERS if cut is not None and cut.layers else BANDS
                status = _run_rows(arena.table(way), arena.ptrs, xs, results)
            else:
                serial = choice.pick()
                way = ALONE if serial else BANDS if cut is None or not cut.pick() else LAYERS
                table = arena.table(way)
                start = time.perf_counter()
                if serial:
                    with omp.TeamOf(1):
                        status = _run_rows(table, arena.ptrs, xs, results)
                else:
                    status = _run_rows(table, arena.ptrs, xs, results)
                seconds = time.perf_counter() - start
                if choice.record(serial, seconds) and cut is not None and not serial:
                    cut.record(way == LAYERS, seconds)
        finally:
            self._idle.append(arena)
        if status:
            onednn.check(status, f"chain {self.name}")
        bases = xs + results
        return tuple([bases[b] if shape is None else bases[b].reshape(shape) for b, shape in self._views])


def in_line(steps: list[Callee], shape: tuple[int, ...], result_shape: tuple[int, ...],
            fallback: Callable[..., tuple[np.ndarray, ...]], name: str) -> PrimitiveChain:
    """A chain of steps each reading the one before's result, for one input of `shape`: a kernel
    whose layers are primitives (a dense chain at many rows) runs them without a Python call each.
    Inner results take turns in two arena buffers; the last step writes the result (`result_shape`)."""
    inner = [whole_lines(math.prod(step.shape) * step.dst_dtype.itemsize) for step in steps[:-1]]
    half = max(inner, default=0)
    buffers = [Buffer(INPUT, 0, shape, steps[0].src_dtype), Buffer(ARENA, 0, (half,), np.dtype(np.uint8)),
               Buffer(ARENA, half, (half,), np.dtype(np.uint8)), Buffer(RESULT, 0, result_shape, steps[-1].dst_dtype)]
    rows, src = [], 0
    for i, step in enumerate(steps):
        dst = 3 if i == len(steps) - 1 else 1 + i % 2
        rows.append(Row(step, src, dst))
        src = dst
    return PrimitiveChain(rows, buffers, [(3, result_shape)], 2 * half, fallback, name)
