"""Runs of a chain's convolutions and poolings cut into bands of image rows, one band per team member.

Why: at batch 1 every oneDNN primitive starts the team and waits for it, and hands its result,
cut the library's way, to the next primitive, which may cut it another way. A small CNN's
primitives are a few microseconds each, so these hand-offs cost as much as the arithmetic. Cut
into bands instead, each member runs the whole run of layers on its own rows with one-thread
primitives: one team start for the run, and each member's rows stay in its own cache. The price
is overlap: a band needs its input rows plus the kernel's reach at each layer, computed twice at
the cut. A stretch of layers is cut only where a cost model (gain_us) says the hand-offs it
saves outweigh the overlap.

The bands' primitives are the layers' own kernels on fewer rows, so each result row is the same
arithmetic as the uncut layer's, padding included where the band meets the image's edge.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from . import jit, omp, onednn
from .buffers import aligned, whole_lines
from .primitive_chain import ARENA, Buffer, KernelCall, Row
from .settings import switched_on

BANDS_ENV = "KUBETRT_ROW_BANDS"
MIN_BAND_ROWS = 2  # result rows per band below which a run is not cut
# The cost model a cut is weighed by, in microseconds: what a hand-off between two team calls
# costs (the team's start, and the result crossing to the other members' caches, per byte), and
# what the rows a band computes twice cost (multiply-adds per microsecond on one core: AVX-512's
# two FMA units at about 3 GHz).
HAND_OFF_US = 1.0
CROSSING_US_PER_BYTE = 2.0 / 100_000
MACS_PER_US = 100_000
# The least gain a cut must promise: below it the model's error decides; and a share of the run's
# time, as one-thread primitives on long layers run a few percent below the team's (measured on
# ResNet-50's, where cuts the hand-offs alone favoured made the model 1% slower).
MIN_GAIN_US = 2.5
MIN_GAIN_SHARE = 0.02
# The activations a layer in bands may end with. Measured: EfficientNet's layers ending in swish
# ran up to 1.7x slower on one of the two members when cut, which made the model 6-12% slower.
# The cause is where the member's stack lies: oneDNN's swish post-op spills vector registers to
# the stack, and at some stack addresses those stores alias (4K apart) the constants its code
# loads, which stalls every load; another stack offset for the member ran at full speed, yet
# moved the stall to other layers, and with no stall bands gained nothing on EfficientNet. ReLU
# and clip (MobileNet's ReLU6) spill nothing, and ran as fast as one thread alone on both.
PIECEWISE_LINEAR = ("", "eltwise_relu", "eltwise_clip", "eltwise_clip_v2", "eltwise_linear")

# The block a chain hands the team: the run's source and destination (written per call), then
# the addresses members call, then the band table's shape and address, and the layer the members
# wait for each other before (the layer count: none).
_SRC, _DST, _NUM_THREADS, _THREAD_NUM, _PLACE, _SET, _EXECUTE, _WAIT, _BARRIER, _BANDS, _LAYERS, _TABLE, _MEET, _BLOCK = range(14)
# A band's row in the table: its stream, its first layer's source memory and the byte offset of
# its first input row, its last layer's destination memory and the offset of its first result
# row; then per layer: primitive, argument count, packed arguments.
_STREAM, _SRC_MEM, _SRC_AT, _DST_MEM, _DST_AT, _BAND = range(6)


@dataclass(frozen=True)
class Cut:
    """One band's share of one layer: `oh` result rows from `ih` input rows starting at input row
    `first`, padded `pad_top`/`pad_bottom` rows where the band meets the image's edge."""

    first: int
    ih: int
    oh: int
    pad_top: int
    pad_bottom: int


def needs(rows: onednn.Rows, a: int, b: int) -> Cut | None:
    """What result rows a..b of a layer read: None where they read only padding."""
    lo = a * rows.stride - rows.pad_top
    hi = b * rows.stride - rows.pad_top + (rows.kernel - 1) * rows.dilation
    first, last = max(lo, 0), min(hi, rows.h - 1)
    if first > last:
        return None
    return Cut(first, last - first + 1, b - a + 1, first - lo, hi - last)


def plan(layers: list[onednn.Rows], bands: int) -> list[list[Cut]] | None:
    """Per band, per layer, its cut: the last layer's rows split evenly, each layer before it
    computing what the next one's cut reads. None where a band would be too thin."""
    oh = layers[-1].oh
    if bands < 2 or oh < bands * MIN_BAND_ROWS:
        return None
    cuts: list[list[Cut]] = []
    for t in range(bands):
        a, b = oh * t // bands, oh * (t + 1) // bands - 1
        band: list[Cut] = []
        for rows in reversed(layers):
            cut = needs(rows, a, b)
            if cut is None:
                return None
            band.append(cut)
            a, b = cut.first, cut.first + cut.ih - 1
        cuts.append(band[::-1])
    return cuts


def gain_us(layers: list[onednn.Rows], cuts: list[list[Cut]]) -> float:
    """What running `layers` in the bands `cuts` saves over the team running them one by one, by
    the cost model above: the hand-offs between them, less what the slowest band computes beyond
    an even share of the work (the rows it computes twice, and an uneven split)."""
    hand_offs = sum(HAND_OFF_US + rows.oh * rows.out_row_bytes * CROSSING_US_PER_BYTE for rows in layers[:-1])
    slowest = max(sum(c.oh * rows.work for c, rows in zip(band, layers)) for band in cuts)
    even = sum(rows.oh * rows.work for rows in layers) / len(cuts)
    return hand_offs - (slowest - even) / MACS_PER_US


@dataclass(frozen=True)
class _Layer:
    """A chain row's site that may run in bands, with its rows' geometry."""

    site: onednn.Site
    rows: onednn.Rows


def _layer(row: Row) -> _Layer | None:
    step = row.step
    if not isinstance(step, onednn.Site) or row.weights is not None:  # a band binds constant weights
        return None
    rows = step.rows()
    return None if rows is None or rows.activation not in PIECEWISE_LINEAR else _Layer(step, rows)


def _runs(rows: list[Row], layers: list[_Layer | None], buffers: list[Buffer], outputs: list[int]) -> list[tuple[int, int]]:
    """The maximal runs [i, j) of rows that may be cut: each a layer, each but the last writing an
    arena buffer only the next row reads, in the rows' layout the next reads, and not summing into
    it (bands compute their overlap's rows twice: a sum would land twice)."""
    readers: dict[int, int] = {}
    writers: dict[int, int] = {}
    for row in rows:
        readers[row.src] = readers.get(row.src, 0) + 1
        writers[row.dst] = writers.get(row.dst, 0) + 1

    def joins(k: int) -> bool:  # row k hands its result to row k + 1 alone
        g, h, d = layers[k], layers[k + 1], rows[k].dst
        return (g is not None and h is not None and not g.rows.sums_into and rows[k + 1].src == d and buffers[d].kind == ARENA
                and d not in outputs and readers[d] == 1 and writers[d] == 1
                and g.rows.oh == h.rows.h and g.rows.out_row_bytes == h.rows.in_row_bytes)
    runs, i = [], 0
    while i < len(rows):
        j = i + 1
        while j < len(rows) and joins(j - 1):
            j += 1
        runs.append((i, j))
        i = j
    return runs


def bands_enabled(env: Mapping[str, str]) -> bool:
    """BANDS_ENV: 1 (the default) cuts runs of layers into bands where the cost model gains, 0 never does."""
    return switched_on(env, BANDS_ENV, "cut runs of layers into bands of rows")


def team_rows(rows: list[Row], buffers: list[Buffer], outputs: list[int], bands: int | None = None) -> list[Row]:
    """The chain's rows as its team runs them: in each run of layers, from its start on, the
    stretch that gains the most by the cost model, where one gains, becomes one team call of
    `bands` bands (one per team member by default)."""
    if not ENABLED:
        return rows
    bands = omp.TEAM if bands is None else bands
    layers = [_layer(row) for row in rows]
    out: list[Row] = []
    for i, j in _runs(rows, layers, buffers, outputs):
        run = [layer for layer in layers[i:j] if layer is not None]  # every row's in a run of two or more
        while i < j:
            best = _best_stretch(rows[i:j], run, bands, buffers)
            if best is None:
                out.append(rows[i])
                i, run = i + 1, run[1:]
                continue
            k, cuts = best
            out.append(Row(_call(run[:k], cuts, _in_place(rows[i:i + k], buffers)), rows[i].src, rows[i + k - 1].dst))
            i, run = i + k, run[k:]
    return out


def _best_stretch(rows: list[Row], run: list[_Layer], bands: int, buffers: list[Buffer]) -> tuple[int, list[list[Cut]]] | None:
    """The length of the stretch from the run's first row that gains the most, and its cuts."""
    best: tuple[float, int, list[list[Cut]]] | None = None
    for k in range(2, len(rows) + 1):
        geometry = [layer.rows for layer in run[:k]]
        cuts = plan(geometry, bands)
        if cuts is None:
            continue
        gain = gain_us(geometry, cuts) - _in_place(rows[:k], buffers) * HAND_OFF_US
        run_us = sum(g.oh * g.work for g in geometry) / bands / MACS_PER_US
        if gain > max(MIN_GAIN_US, MIN_GAIN_SHARE * run_us) and (best is None or gain > best[0]):
            best = (gain, k, cuts)
    return None if best is None else best[1:]


def _in_place(stretch: list[Row], buffers: list[Buffer]) -> bool:
    """Whether the stretch's last layer writes over its first's source: the same buffer (a residual
    sum), or arena bytes the source shares. The arena is planned for the rows one after another,
    where the source is dead once the first layer has read it, so the last layer's result may be
    placed over it; a band call runs all the layers at once, one band ahead of another."""
    src, dst = stretch[0].src, stretch[-1].dst
    if src == dst:
        return True
    a, b = buffers[src], buffers[dst]
    return a.kind == ARENA and b.kind == ARENA and a.index < b.index + b.nbytes and b.index < a.index + a.nbytes


def _call(run: list[_Layer], cuts: list[list[Cut]], in_place: bool) -> KernelCall:
    """The team call that runs the layers `run` in the bands `cuts`; each arena's block has its own
    bands' primitives' arguments, inner results, scratchpads and streams. `in_place`: the last
    layer writes over the first's source (a residual sum), so every band reads its rows before
    any band writes: the members meet at a barrier before the last layer."""
    sites, layers = [layer.site for layer in run], [layer.rows for layer in run]
    first, last = layers[0], layers[-1]

    def block() -> tuple[np.ndarray, Any]:
        table = np.zeros((len(cuts), _BAND + 3 * len(sites)), np.int64)
        kept: list[Any] = [table]
        for t, band in enumerate(cuts):
            made = [site.band(c.ih, c.oh, c.pad_top, c.pad_bottom) for site, c in zip(sites, band)]
            inner = [whole_lines(c.oh * rows.out_row_bytes) for c, rows in zip(band[:-1], layers)]
            memory = aligned(max(sum(inner), 1))
            scratch_bytes = max(m[0].scratch_bytes for m in made)
            scratch = aligned(scratch_bytes) if scratch_bytes else None
            stream = onednn.Stream()
            kept += [memory, scratch, stream]
            row = table[t]
            src, at = 0, memory.ctypes.data  # the first layer's source and the last's destination are set per call
            for k, (prim, consts, keep) in enumerate(made):
                dst = at if k < len(made) - 1 else 0
                args = onednn.Arguments(prim, [src, dst, *consts], scratch if prim.scratch_bytes else None, stream)
                kept += [prim, keep, args]
                row[_BAND + 3 * k:_BAND + 3 * k + 3] = [prim.handle.value or 0, len(args.packed), ctypes.addressof(args.packed)]
                if k == 0:
                    row[_SRC_MEM] = args.mems[0].value or 0
                if k < len(made) - 1:
                    src, at = dst, at + inner[k]
            row[_DST_MEM] = args.mems[1].value or 0
            row[_STREAM] = stream.handle.value or 0
            row[_SRC_AT] = band[0].first * first.in_row_bytes
            row[_DST_AT] = (last.oh * t // len(cuts)) * last.out_row_bytes
        head = np.zeros(_BLOCK, np.int64)
        head[_NUM_THREADS:_BARRIER + 1] = [omp.NUM_THREADS, omp.THREAD_NUM, omp.PLACE, *onednn.C_FUNCTIONS, omp.BARRIER]
        head[_BANDS], head[_LAYERS], head[_TABLE] = len(cuts), len(sites), table.ctypes.data
        head[_MEET] = len(sites) - 1 if in_place else len(sites)
        return head, kept

    return KernelCall(jit.entry_address(_member), block, _SRC, _DST, sites[-1].shape, team=True,
                      src_dtype=sites[0].src_dtype, dst_dtype=sites[-1].dst_dtype)


AVAILABLE = jit.AVAILABLE and onednn.AVAILABLE and omp.PARALLEL != 0
ENABLED = AVAILABLE and bands_enabled(os.environ)

if AVAILABLE:
    from numba import carray

    def _member(data):  # compiled into a C callable by jit.entry_address
        head = carray(jit.int64s_at(data), (_BLOCK,))
        team, me = jit.c_call0(head[_NUM_THREADS]), jit.c_call0(head[_THREAD_NUM])
        omp.apart(head[_PLACE], me)
        layers = head[_LAYERS]
        table = carray(jit.int64s_at(head[_TABLE]), (head[_BANDS], _BAND + 3 * layers))
        meet = head[_MEET]
        for t in range(me, head[_BANDS], team):  # a smaller team than planned: members take turns at the bands
            band = table[t]
            jit.c_call2(head[_SET], band[_SRC_MEM], head[_SRC] + band[_SRC_AT])
            jit.c_call2(head[_SET], band[_DST_MEM], head[_DST] + band[_DST_AT])
            _layers(head, band, 0, meet)
        if meet < layers:
            jit.c_call0(head[_BARRIER])
            for t in range(me, head[_BANDS], team):
                _layers(head, table[t], meet, layers)

    @jit.njit(cache=True, nogil=True, inline="always")
    def _layers(head, band, start, stop):
        for k in range(start, stop):
            at = _BAND + 3 * k
            jit.c_call4(head[_EXECUTE], band[at], band[_STREAM], band[at + 1], band[at + 2])
        jit.c_call1(head[_WAIT], band[_STREAM])
