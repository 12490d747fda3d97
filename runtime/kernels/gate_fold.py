"""A squeeze-and-excitation gate folded into the 1x1 convolution that reads the block's result.

conv(x * g) = conv with g-scaled weights applied to x. Unfolded, the gate kernel scales the image
(a pass that reads and writes all of it) and the convolution reads it again; folded, the gate
kernel scales the convolution's C x O weights instead, into the chain's arena, and the
convolution reads x as it was. That pays where the image has more numbers than the weights: the
early blocks of EfficientNet, one image at a time. A gate per image would need weights per image,
so batches keep the unfolded steps. Chains only: capture.py folds the rows it builds.

The products round differently (x * (g * w) against (x * g) * w): results stay within float32's
tolerance of the unfolded ones, not bit-identical. KUBETRT_GATE_FOLD=0 keeps the unfolded steps.
"""
from __future__ import annotations

import os
from typing import Mapping

import numpy as np

from . import onednn
from .buffers import whole_lines
from .primitive_chain import ARENA, Buffer, KernelCall, Row
from .settings import switched_on
from .squeeze_excite import SqueezeExciteCall

GATE_FOLD_ENV = "KUBETRT_GATE_FOLD"
# Fold where the image has at least this many times more pixels than the convolution has outputs
# (its numbers against the weights' at the same channel count): scaling weights then costs at
# most half the pass over the image it saves.
MIN_PIXELS_PER_OUTPUT = 2


def gate_fold_enabled(env: Mapping[str, str]) -> bool:
    """GATE_FOLD_ENV: 1 (the default) folds gates into weights where it pays, 0 never does."""
    return switched_on(env, GATE_FOLD_ENV, "fold gates into the next 1x1 convolution's weights")


ENABLED = gate_fold_enabled(os.environ)


def _plain_1x1(site: onednn.Site) -> bool:
    """A float32 NHWC 1x1 convolution over one image (rows_of says so), stride 1, no padding, no
    groups: one GEMM whose weights a gate can scale along its input channels."""
    op = site.op
    if not isinstance(op, onednn.Conv2D) or op.rows_of(site.key) is None or op.group != 1:
        return False
    pads = site.key[5:9]
    return op.w.shape[2:] == (1, 1) and op.strides == [1, 1] and not any(pads)


def worth(x_shape: tuple[int, ...], outputs: int) -> bool:
    """Whether scaling the weights costs less than the pass over the image it saves."""
    return x_shape[1] * x_shape[2] >= MIN_PIXELS_PER_OUTPUT * outputs


def fold(rows: list[Row], buffers: list[Buffer], outputs: list[int], arena_bytes: int) -> tuple[list[Row], list[Buffer], int]:
    """The chain's rows with each gate whose image only the next row, a 1x1 convolution, reads
    folded into that convolution's weights; the buffers with one for each folded convolution's
    weights, placed past `arena_bytes`; the arena's new size."""
    if not ENABLED:
        return rows, buffers, arena_bytes
    buffers = list(buffers)
    out: list[Row] = []
    i = 0
    while i < len(rows):
        gate, conv = rows[i], rows[i + 1] if i + 1 < len(rows) else None
        folded = _folded(gate, conv, rows[i + 2:], buffers, outputs)
        if folded is None:
            out.append(gate)
            i += 1
            continue
        gate_call, conv_site = folded
        assert conv is not None
        weights = len(buffers)
        buffers.append(Buffer(ARENA, arena_bytes, gate_call.shape, np.dtype(np.float32)))
        arena_bytes += whole_lines(int(np.prod(gate_call.shape)) * 4)
        out += [Row(gate_call, gate.src, weights), Row(conv_site, gate.src, conv.dst, weights=weights)]
        i += 2
    return out, buffers, arena_bytes


def _folded(gate: Row, conv: Row | None, later: list[Row], buffers: list[Buffer],
            outputs: list[int]) -> tuple[KernelCall, onednn.Site] | None:
    """(the gate's weights kernel, the convolution with HWIO weights) where `gate` may fold into
    `conv`: the gated image is an arena buffer that neither `conv` sums into nor any row after it
    touches (one that read it, or summed into it, would miss the gate); None otherwise."""
    step = gate.step
    if conv is None or not isinstance(step, SqueezeExciteCall) or step.se is None or not isinstance(conv.step, onednn.Site):
        return None
    image = gate.dst
    if (conv.src != image or conv.dst == image or buffers[image].kind != ARENA or image in outputs
            or any(image in (r.src, r.dst, r.weights) for r in later) or conv.weights is not None or not _plain_1x1(conv.step)):
        return None
    op = conv.step.op
    o = op.w.shape[0]
    if not worth(step.shape, o):
        return None
    hwio = onednn.Conv2D(op.w, op.bias, 1, [1, 1], [1, 1], op.activation, op.residual, name=f"{op.name}/gated", hwio_weights=True)
    _, h, w, c = step.shape
    site = hwio.bind(step.shape, h, w, [0, 0], [0, 0])
    assert isinstance(site, onednn.Site), "a plain NHWC convolution binds to its site"
    # the gate scales the weights as the primitive reads them (HWIO: a C x O matrix), oneDNN's reorder of them
    weights = site.primitive(False)[2]
    assert weights is not None, "a convolution keeps its weights"
    call = step.se.weights_call(step.shape, weights.view(np.float32).reshape(c, o))
    return None if call is None else (call, site)
