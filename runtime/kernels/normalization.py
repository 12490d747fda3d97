"""Per-instance and per-group normalization.

Both are one computation: statistics over (instance, group) rows, then a per-channel scale and
bias. Statistics are two-pass (mean, then the mean of squared deviations) in at least float32,
because the one-pass E[x^2] - E[x]^2 cancels catastrophically on activations with a large mean.
"""
from __future__ import annotations

import numpy as np

from . import parallel
from .registry import KernelSpec, Run, check_attrs, refuse, register, same_as_input


def _size(dims: tuple[int, ...]) -> int:
    return int(np.prod(dims, dtype=np.int64))


CHUNK_ELEMENTS = 1 << 18  # rows are normalized a cache-sized chunk at a time: every pass hits cache


def normalize(x: np.ndarray, groups: int, scale: np.ndarray, bias: np.ndarray, eps: float, work: np.dtype,
              overwrite: bool = False) -> np.ndarray:
    """(x - mean) / sqrt(var + eps) * scale + bias over `groups` channel groups per instance;
    `scale` and `bias` are per channel. Computed in `work`, returned in x's dtype; written into x
    itself where `overwrite` allows and the dtypes agree (one large allocation fewer)."""
    n, c = x.shape[:2]
    cg, spatial = c // groups, _size(x.shape[2:])
    rows, m = n * groups, cg * spatial
    src = x.reshape(rows, m)
    if src.dtype != work:
        src, overwrite = src.astype(work), True  # the converted copy is ours
    own = overwrite and src.flags.writeable and src.flags.c_contiguous
    out = src if own else np.empty((rows, m), dtype=work)
    scale_rows = np.broadcast_to(scale.astype(work, copy=False).reshape(1, groups, cg), (n, groups, cg)).reshape(rows, cg)
    bias_rows = np.broadcast_to(bias.astype(work, copy=False).reshape(1, groups, cg), (n, groups, cg)).reshape(rows, cg)
    eps_w = np.asarray(eps, dtype=work)
    step = max(1, CHUNK_ELEMENTS // max(m, 1))

    def rows_range(lo: int, hi: int) -> None:
        for r0 in range(lo, hi, step):
            r1 = min(hi, r0 + step)
            d = np.subtract(src[r0:r1], src[r0:r1].mean(axis=1, keepdims=True), out=out[r0:r1])
            # Centred values are small: a batched BLAS dot sums their squares accurately in one read.
            var = np.matmul(d[:, None, :], d[:, :, None]).reshape(-1) / max(m, 1)
            factor = scale_rows[r0:r1] / np.sqrt(var + eps_w)[:, None]
            y = d.reshape(r1 - r0, cg, spatial)
            y *= factor[:, :, None]
            y += bias_rows[r0:r1, :, None]

    parallel.split_range(rows_range, rows, parallel.parts_for(8 * rows * m, rows))
    return out.reshape(x.shape).astype(x.dtype, copy=False)


def _check_input(spec: KernelSpec) -> int | None:
    """The channel count where known; refuses inputs that are not float [N, C, D1, ...]."""
    dt, s = spec.dtypes[0], spec.shapes[0]
    if dt is not None and dt.kind != "f":
        raise refuse(spec, f"input dtype {dt}", "floating-point inputs")
    if s is not None and len(s) < 3:
        raise refuse(spec, f"a rank-{len(s)} input", "inputs [N, C, D1, ...] of rank >= 3")
    return None if s is None or s[1] < 0 else s[1]


def _operand_size(spec: KernelSpec, i: int) -> int | None:
    s = spec.shapes[i] if i < len(spec.shapes) else None
    return None if s is None or any(d < 0 for d in s) else _size(tuple(s))


def _check_run(spec: KernelSpec, x: np.ndarray, expected: set[int], scale: np.ndarray, bias: np.ndarray) -> None:
    if x.ndim < 3 or scale.size not in expected or bias.size != scale.size:
        raise ValueError(f"{spec.op} {spec.name}: input {x.shape} with scale {scale.shape} and bias {bias.shape}; "
                         f"expected rank >= 3 and {' or '.join(map(str, sorted(expected)))} scale and bias values")


@register("InstanceNormalization", same_as_input)
def instance_norm(spec: KernelSpec) -> Run:
    """float16 is computed in float32; float64 stays float64 (onnxruntime computes it in double)."""
    check_attrs(spec, {"epsilon"})
    eps = float(spec.attr("epsilon", 1e-5))
    c = _check_input(spec)
    for i in (1, 2):
        size = _operand_size(spec, i)
        if c is not None and size is not None and size != c:
            raise refuse(spec, f"{('scale', 'B')[i - 1]} of {size} values for {c} channels", "one scale and bias value per channel")

    overwrite = 0 in spec.inplace

    def run(x: np.ndarray, scale: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, ...]:
        _check_run(spec, x, {x.shape[1] if x.ndim > 1 else -1}, scale, b)
        work = np.dtype(np.float64) if x.dtype == np.float64 else np.dtype(np.float32)
        return (normalize(x, x.shape[1], scale.reshape(-1), b.reshape(-1), eps, work, overwrite),)

    return run


@register("GroupNormalization", same_as_input)
def group_norm(spec: KernelSpec) -> Run:
    """Opset 18 gives scale and bias per group, opset 21 per channel; the operands' size tells
    which (with as many groups as channels the two agree). stash_type 1 (float32) is the
    spec's default and the only precision this kernel computes in."""
    check_attrs(spec, {"num_groups", "epsilon", "stash_type"})
    groups, eps, stash = spec.attr("num_groups"), float(spec.attr("epsilon", 1e-5)), spec.attr("stash_type", 1)
    if not isinstance(groups, int) or groups < 1:
        raise refuse(spec, f"num_groups={groups!r}", "a positive num_groups")
    if stash != 1:
        raise refuse(spec, f"stash_type={stash!r}", "stash_type 1 (float32 statistics)")
    c = _check_input(spec)
    if c is not None and c % groups:
        raise refuse(spec, f"{c} channels in {groups} groups", "a channel count divisible by num_groups")
    for i in (1, 2):
        size = _operand_size(spec, i)
        if size is not None and size != groups and (c is None or size != c):
            raise refuse(spec, f"{('scale', 'bias')[i - 1]} of {size} values with {groups} groups and {c if c is not None else 'unknown'} channels",
                         "scale and bias per group (opset 18) or per channel (opset 21)")
    work = np.dtype(np.float32)
    overwrite = 0 in spec.inplace

    def run(x: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, ...]:
        ch = x.shape[1] if x.ndim > 1 else 0
        if ch % groups:
            raise ValueError(f"GroupNormalization {spec.name}: {ch} channels are not divisible into {groups} groups")
        _check_run(spec, x, {groups, ch}, scale, bias)
        s, b = scale.reshape(-1), bias.reshape(-1)
        if s.size != ch:  # per group: the same value for each channel of the group
            s, b = np.repeat(s, ch // groups), np.repeat(b, ch // groups)
        return (normalize(x, groups, s, b, eps, work, overwrite),)

    return run
