"""Plans captured per input signature: runs of oneDNN steps become one chain step each.

The first call of a sequential plan with a new input signature runs step by step and asks each
kernel what it is for its operands (kernels/primitive_chain.Link). Runs of steps that are one
primitive or one jitted kernel each, with two primitives or more, become a PrimitiveChain whose
inner values live in planned buffers; the plan for later calls with that signature is generated
from the new steps. Where a step may overwrite an operand is the memory plan's decision
(program.py), which a kernel's link follows: the result then shares that operand's buffer.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from .kernels import bands, gate_fold, primitive_chain
from .kernels.buffers import whole_lines
from .kernels.primitive_chain import ARENA, INPUT, RESULT, Buffer, Link, PrimitiveChain, Row
from .kernels.settings import switched_on
from .program import Program, Step

CHAINS_ENV = "KUBETRT_PRIMITIVE_CHAINS"
# A chain whose inner values need more than this keeps its steps. Below it the arena pays at any
# batch: a fresh array of more than the allocator's mmap threshold (32 MiB at most) comes back from
# the kernel as new pages, which it faults in and zeroes on the first write, each call; the arena's
# pages stay mapped. Above it, holding the memory per concurrent caller costs more than that saves.
ARENA_LIMIT = 1 << 30
Failed = Callable[[Program, int, BaseException], BaseException]


def chains_enabled(env: Mapping[str, str]) -> bool:
    """CHAINS_ENV: 1 (the default) captures chains where oneDNN and numba are, 0 never does."""
    return switched_on(env, CHAINS_ENV, "capture primitive chains") and primitive_chain.AVAILABLE


ENABLED = chains_enabled(os.environ)


def may_chain(steps: list[Step]) -> bool:
    """Whether any two consecutive steps have kernels that may join a chain: where none do, a plan
    need not even compute its calls' signatures."""
    linkable = [primitive_chain.has_link(run) for run, *_ in steps]
    return any(a and b for a, b in zip(linkable, linkable[1:]))


def capture(prog: Program, steps: list[Step], feeds: list[Any], failed: Failed) -> tuple[list[Any], list[Step] | None]:
    """Run the plan's steps on `feeds` (this call's results) and return them with the steps of the
    plan for this signature: None where no chain forms."""
    results, links, metas = trace(prog, steps, feeds, failed)
    chained = _chained(prog, steps, links, metas)
    return results, chained


Meta = tuple[tuple[int, ...], np.dtype] | None  # an operand's shape and dtype as traced; None: not an array


def trace(prog: Program, steps: list[Step], feeds: list[Any], failed: Failed) -> tuple[list[Any], list[Link | None], list[list[Meta]]]:
    """Run the steps on `feeds` one by one: the results, and per step its link and its operands' shapes and dtypes."""
    env: dict[int, Any] = dict(zip(prog.inputs, feeds))
    links: list[Link | None] = []
    metas: list[list[Meta]] = []
    for run, ins, outs, frees, kid in steps:
        operands = _operands(prog, env, ins)
        try:
            link = _usable_link(prog, run, ins, outs, operands)
            results = run(*operands)
        except Exception as e:
            raise failed(prog, kid, e) from e
        if link is not None and not _produced(link, operands, results[0]):
            link = None
        links.append(link)
        metas.append([(x.shape, x.dtype) if isinstance(x, np.ndarray) else None for x in operands])
        for v, r in zip(outs, results):
            if v >= 0:
                env[v] = r
        for v in frees:
            env.pop(v, None)
    return _operands(prog, env, prog.outputs), links, metas


def _operands(prog: Program, env: dict[int, Any], vids: Any) -> list[Any]:
    """The values of `vids`: computed ones from `env`, constants from the program, None for omitted ones."""
    return [None if v < 0 else env[v] if v in env else prog.values[v].const for v in vids]


def _usable_link(prog: Program, run: Any, ins: tuple[int, ...], outs: tuple[int, ...], operands: list[Any]) -> Link | None:
    """The step's link where a chain can run it: one result; the source (and the operand it writes
    over) computed values of the types the call was made for; every other operand a constant."""
    link = primitive_chain.link_for(run, operands)
    if link is None or len(outs) != 1 or outs[0] < 0:
        return None
    computed = [link.src] + ([link.into] if link.into is not None else [])
    for pos, vid in enumerate(ins):
        if (vid < 0 or prog.values[vid].const is not None) == (pos in computed):
            return None  # the chain passes the computed operands only: the others must be the constants the primitive holds
    src = operands[link.src]
    if not isinstance(src, np.ndarray):
        return None
    step = link.step
    if step is None:
        return link
    if src.dtype != step.src_dtype or math.prod(src.shape) == 0:
        return None
    if link.into is not None:
        into = operands[link.into]
        if into.shape != step.shape or into.dtype != step.dst_dtype:
            return None
    return link


def _produced(link: Link, operands: list[Any], result: Any) -> bool:
    """Whether the step's result is what its link said: the shape, and a handed-through operand's very memory."""
    if not isinstance(result, np.ndarray) or result.shape != link.shape:
        return False
    if link.step is None:
        src = operands[link.src]
        return bool(result.flags.c_contiguous and src.flags.c_contiguous and result.ctypes.data == src.ctypes.data
                    and result.dtype == src.dtype)
    return bool(result.dtype == link.step.dst_dtype)


@dataclass
class _Group:
    """Values in one buffer: a value and the result written over it (a residual summed into, a
    kernel working in place), a value and what hands it through."""

    values: list[int]
    shape: tuple[int, ...]
    dtype: np.dtype
    external: int | None = None  # the chain input it is, if it comes from outside the run
    first: int = 0  # step of its first value
    last: int = 0  # last step that reads any of its values
    escapes: bool = False
    offset: int = -1  # in the arena, where it lives there
    buffer: int = -1


@dataclass
class _Run:
    """A run of linked steps being made into a chain."""

    members: list[int] = field(default_factory=list)  # step indices
    primitives: int = 0
    groups: list[_Group] = field(default_factory=list)
    group_of: dict[int, _Group] = field(default_factory=dict)
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # of each value the run computes
    inputs: list[int] = field(default_factory=list)  # chain inputs, as value ids


def _chained(prog: Program, steps: list[Step], links: list[Link | None], metas: list[list[Meta]]) -> list[Step] | None:
    last_use: dict[int, int] = {}
    for i, (_, ins, _, _, _) in enumerate(steps):
        for v in ins:
            last_use[v] = i
    for v in prog.outputs:
        last_use[v] = len(steps)  # read after the last step
    out: list[Step] = []
    changed = False
    i = 0
    while i < len(steps):
        if links[i] is None:
            out.append(steps[i])
            i += 1
            continue
        run = _Run()
        j = i
        while j < len(steps) and links[j] is not None:
            _take(run, steps, links, metas, j)
            j += 1
        chain = _chain_step(prog, steps, links, run, last_use) if run.primitives >= 2 else None
        if chain is None:
            out.extend(steps[k] for k in run.members)
        else:
            out.append(chain)
            changed = True
        i = j
    return out if changed else None


def _take(run: _Run, steps: list[Step], links: list[Link | None], metas: list[list[Meta]], k: int) -> None:
    """Add step k to the run: its operands from outside become chain inputs, its result joins the
    buffer of the value it writes over (a residual the memory plan let it overwrite) or hands
    through, or gets one of its own."""
    _, ins, outs, _, _ = steps[k]
    link = links[k]
    assert link is not None
    for pos in dict.fromkeys([link.src] + ([link.into] if link.into is not None else [])):
        vid = ins[pos]
        if vid not in run.group_of:
            meta = metas[k][pos]
            assert meta is not None
            group = _Group([vid], meta[0], meta[1], external=len(run.inputs), first=k)
            run.inputs.append(vid)
            run.groups.append(group)
            run.group_of[vid] = group
    out = outs[0]
    if link.step is None:
        group = run.group_of[ins[link.src]]
    elif link.into is not None:
        group = run.group_of[ins[link.into]]
    else:
        group = _Group([], link.step.shape, link.step.dst_dtype, first=k)
        run.groups.append(group)
    group.values.append(out)
    run.group_of[out] = group
    run.shapes[out] = link.shape
    run.primitives += link.step is not None
    run.members.append(k)


def _chain_step(prog: Program, steps: list[Step], links: list[Link | None], run: _Run, last_use: dict[int, int]) -> Step | None:
    end = run.members[-1]
    escaping = [steps[k][2][0] for k in run.members if last_use.get(steps[k][2][0], -1) > end]
    if not escaping:
        return None
    for group in run.groups:
        group.last = max(min(last_use.get(v, group.first), end) for v in group.values)
        group.escapes = any(v in escaping for v in group.values)
    arena_bytes = _place(run)
    if arena_bytes > ARENA_LIMIT:
        return None
    buffers: list[Buffer] = []
    for group in run.groups:
        group.buffer = len(buffers)
        kind, index = (INPUT, group.external) if group.external is not None else (RESULT, 0) if group.escapes else (ARENA, group.offset)
        buffers.append(Buffer(kind, index, group.shape, group.dtype))
    rows = []
    for k in run.members:
        link, ins, out = links[k], steps[k][1], steps[k][2][0]
        assert link is not None
        if link.step is not None:
            rows.append(Row(link.step, run.group_of[ins[link.src]].buffer, run.group_of[out].buffer))
    outputs = [(run.group_of[v].buffer, run.shapes[v]) for v in escaping]
    rows, buffers, arena_bytes = gate_fold.fold(rows, buffers, [b for b, _ in outputs], arena_bytes)
    members = [steps[k] for k in run.members]
    names = [prog.kernels[kid].name for _, _, _, _, kid in members]
    chain = PrimitiveChain(rows, buffers, outputs, arena_bytes, _fallback(prog, members, run.inputs, escaping),
                           f"{names[0]}..{names[-1]} ({len(members)} steps)", bands.team_rows(rows, buffers, [b for b, _ in outputs]))
    inputs = set(run.inputs)
    frees = tuple(v for _, _, _, fr, _ in members for v in fr if v in inputs)
    return (chain, tuple(run.inputs), tuple(escaping), frees, members[0][4])


def _place(run: _Run) -> int:
    """Byte offsets in the arena for the groups that live there, first fit by liveness; returns the
    arena's size."""
    live: list[tuple[int, int, _Group]] = []  # (offset, bytes, group), by offset
    size = 0
    for k in run.members:
        for group in run.groups:
            if group.first == k and group.external is None and not group.escapes:
                nbytes = whole_lines(math.prod(group.shape) * group.dtype.itemsize)
                offset = 0
                for start, taken, _ in live:
                    if start - offset >= nbytes:
                        break
                    offset = max(offset, start + taken)
                live.append((offset, nbytes, group))
                live.sort(key=lambda t: t[0])
                size = max(size, offset + nbytes)
                group.offset = offset
        live = [t for t in live if t[2].last > k]
    return size


def _fallback(prog: Program, members: list[Step], inputs: list[int], outputs: list[int]) -> Callable[..., tuple[Any, ...]]:
    """The steps a chain replaced, run one by one: for inputs of other shapes than captured."""
    def run_steps(*xs: Any) -> tuple[Any, ...]:
        env: dict[int, Any] = dict(zip(inputs, xs))
        for run, ins, outs, _, _ in members:
            results = run(*_operands(prog, env, ins))
            env.update((v, r) for v, r in zip(outs, results) if v >= 0)
        return tuple(env[v] for v in outputs)
    return run_steps
