"""Control flow (If, Loop, Scan): sub-graphs compiled once and run on the same executor.

The program compiler lowers every GRAPH attribute once, with the passes and kernels of the
graph around it, and hands it to the factory in `KernelSpec.subgraphs`: an object with
`run(feeds) -> outputs` (the sub-program's executor), its input and output types, and which
outputs it may hand back borrowed. The kernels here only decide which sub-graph runs, how often
and on what; nothing is interpreted or compiled per call.

Operands after the op's own are outer values the sub-graphs read (captures; their count is the
attribute CAPTURES) and every sub-graph takes them, in order, as its last inputs.

Outputs never alias an operand or a sub-graph constant: the memory planner lets later kernels
overwrite dying values in place, so a branch that returns an outer value, or a body that passes a
carried value through (or a loop that runs zero times), yields a copy.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ..errors import UnsupportedOpError
from .registry import KernelSpec, OutputShapes, Run, Shape, norm_axis, refuse, register

CAPTURES = "kubetrt:captures"  # the IR's graph.CAPTURES: kernels do not import the IR
Types = list[tuple[Shape, np.dtype | None]]


class Subgraph(Protocol):
    """What the program compiler hands a control-flow factory for each GRAPH attribute."""

    inputs: Types
    outputs: Types
    borrowed: tuple[bool, ...]  # outputs that may be an input's, a constant's or another output's memory

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]: ...


# ---- shared helpers

def _captures(spec: KernelSpec) -> int:
    return int(spec.attr(CAPTURES, 0))


def _own(spec: KernelSpec) -> int:
    """Operands that are the op's own (not captures)."""
    return len(spec.shapes) - _captures(spec)


def _compiled(spec: KernelSpec, key: str, n_inputs: int, n_outputs: int) -> Subgraph:
    sub: Subgraph | None = spec.subgraphs.get(key)
    if sub is None:
        raise refuse(spec, f"sub-graph {key} is not compiled",
                      f"{spec.op} inside a compiled program (not eagerly, not in constant folding)")
    if len(sub.inputs) != n_inputs or len(sub.outputs) != n_outputs:
        raise refuse(spec, f"sub-graph {key} has {len(sub.inputs)} inputs and {len(sub.outputs)} outputs, "
                            f"the node's operands and outputs need {n_inputs} and {n_outputs}",
                      f"a {key} whose inputs and outputs match the node, as the ONNX spec defines {spec.op}")
    return sub


def _owned(outs: Sequence[np.ndarray], borrowed: Sequence[bool], operands: Sequence[Any]) -> list[np.ndarray]:
    """Outputs the caller may overwrite: copies of those the sub-program does not own (an input
    such as an operand or a capture, a constant, an earlier output). The flags come from the
    compiler's alias analysis, the one the memory planner trusts; the identity test also catches
    a kernel that hands back its operand unchanged (a one-operand Sum). No per-call overlap test:
    If runs per iteration inside loops."""
    return [np.array(out, copy=True) if flag or any(out is x for x in operands) else out
            for out, flag in zip(outs, borrowed)]


def _scalar(x: np.ndarray, what: str) -> Any:
    if np.size(x) != 1:
        raise ValueError(f"{what} must have exactly one element, got shape {np.shape(x)}")
    return x.item()


def _merge(a: Shape, b: Shape) -> Shape:
    """One shape for two that may differ (branches, loop iterations): -1 where they disagree."""
    if a is None or b is None or len(a) != len(b):
        return None
    return tuple(x if x == y else -1 for x, y in zip(a, b))


def _graph_types(graph: Any) -> Types:
    """Output types of an imported, not yet compiled sub-graph (shape inference fills its
    `values` before the node's shape function runs); kernels read the IR only through this."""
    values = getattr(graph, "values", None) or {}
    types: Types = []
    for v in getattr(graph, "outputs", None) or []:
        info = values.get(v.name)
        shape = info.shape if info is not None and info.shape is not None else v.shape
        dtype = info.dtype if info is not None and info.dtype is not None else v.dtype
        types.append((shape, dtype))
    return types


def _with_dim(elem: Shape, axis: int, dim: int) -> Shape:
    if elem is None:
        return None
    out = list(elem)
    out.insert(norm_axis(axis, len(elem) + 1), dim)
    return tuple(out)


def _feeder(types: Types, i: int, dtype: type) -> Callable[[Any], np.ndarray]:
    """Iteration number and condition go in with the rank the body declares (0-d or [1])."""
    shape = types[i][0] if i < len(types) else None
    if shape:
        return lambda v: np.full((1,) * len(shape), v, dtype)
    return lambda v: np.array(v, dtype)


# ---- If

def _if_shape(spec: KernelSpec) -> OutputShapes:
    then, other = _graph_types(spec.attr("then_branch")), _graph_types(spec.attr("else_branch"))
    if len(then) != spec.n_outputs or len(other) != spec.n_outputs:
        return [(None, None)] * spec.n_outputs
    return [(_merge(s1, s2), d1 if d1 is not None else d2) for (s1, d1), (s2, d2) in zip(then, other)]


@register("If", _if_shape)
def if_(spec: KernelSpec) -> Run:
    k = _captures(spec)
    then = _compiled(spec, "then_branch", k, spec.n_outputs)
    other = _compiled(spec, "else_branch", k, spec.n_outputs)

    def run(cond: np.ndarray, *captures: np.ndarray) -> tuple[np.ndarray, ...]:
        branch = then if bool(_scalar(cond, "If condition")) else other
        return tuple(_owned(branch.run(list(captures)), branch.borrowed, captures))

    return run


# ---- Loop

def _loop_counts(spec: KernelSpec) -> tuple[int, int]:
    """(loop-carried values, scan outputs)."""
    carried = _own(spec) - 2
    return carried, spec.n_outputs - carried


def _loop_shape(spec: KernelSpec) -> OutputShapes:
    n, scans = _loop_counts(spec)
    body = _graph_types(spec.attr("body"))
    if n < 0 or scans < 0 or len(body) != 1 + n + scans:
        return [(None, None)] * spec.n_outputs
    out: OutputShapes = []
    for j in range(n):  # a carried value may change shape between iterations
        shape, dtype = body[1 + j]
        out.append((_merge(spec.shapes[2 + j], shape), spec.dtypes[2 + j] if spec.dtypes[2 + j] is not None else dtype))
    for shape, dtype in body[1 + n:]:  # the trip count is known only at run time (the body may end the loop)
        out.append((_with_dim(shape, 0, -1), dtype))
    return out


def _empty_scan(spec: KernelSpec, j: int, types: tuple[Shape, np.dtype | None]) -> np.ndarray:
    """A zero-iteration scan output as onnxruntime makes it: (0, element dims, unknown ones 0),
    or (0,) where the element shape is unknown."""
    shape, dtype = types
    if dtype is None:
        raise ValueError(f"Loop {spec.name}: zero iterations and the element type of scan output {j} is unknown")
    dims = (0,) if shape is None else (0, *(d if d >= 0 else 0 for d in shape))
    return np.empty(dims, dtype)


@register("Loop", _loop_shape)
def loop(spec: KernelSpec) -> Run:
    n, scans = _loop_counts(spec)
    if n < 0 or scans < 0:
        raise refuse(spec, f"{_own(spec)} operands and {spec.n_outputs} outputs",
                      "M, cond, N loop-carried values in; N loop-carried values and scan outputs out")
    k = _captures(spec)
    body = _compiled(spec, "body", 2 + n + k, 1 + n + scans)
    iteration, condition = _feeder(body.inputs, 0, np.int64), _feeder(body.inputs, 1, np.bool_)
    carried_borrowed = body.borrowed[1:1 + n]
    scan_types = body.outputs[1 + n:]

    def run(m: np.ndarray | None, cond: np.ndarray | None, *rest: np.ndarray) -> tuple[np.ndarray, ...]:
        state, captures = list(rest[:n]), list(rest[n:])
        trips = None if m is None else int(_scalar(m, "Loop trip count M"))
        go = True if cond is None else bool(_scalar(cond, "Loop condition"))
        collected: list[list[np.ndarray]] = [[] for _ in range(scans)]
        i = 0
        while go and (trips is None or i < trips):
            outs = body.run([iteration(i), condition(go), *state, *captures])
            # the body's condition ends the loop even without a cond operand, as onnxruntime runs it
            go = bool(_scalar(outs[0], "Loop body condition"))
            state = outs[1:1 + n]
            for c, x in zip(collected, outs[1 + n:]):
                c.append(x)
            i += 1
        finals = _owned(state, carried_borrowed if i else (True,) * n, rest)
        stacked = [np.stack(c) if c else _empty_scan(spec, j, t) for j, (c, t) in enumerate(zip(collected, scan_types))]
        return (*finals, *stacked)

    return run


# ---- Scan (opset 9+: no batch axis, no sequence_lens)

class _ScanLayout:
    """Scan's attributes, checked once."""

    def __init__(self, spec: KernelSpec) -> None:
        m = spec.attr("num_scan_inputs")
        if m is None or int(m) < 1 or int(m) > _own(spec):
            raise refuse(spec, f"num_scan_inputs={m} with {_own(spec)} operands", "1 <= num_scan_inputs <= operands")
        self.m = int(m)
        self.n = _own(spec) - self.m
        self.k = spec.n_outputs - self.n
        if self.k < 0:
            raise refuse(spec, f"{spec.n_outputs} outputs for {self.n} state values", "one output per state value, then scan outputs")
        self.in_axes = self._ints(spec, "scan_input_axes", self.m, 0)
        self.in_rev = [d == 1 for d in self._ints(spec, "scan_input_directions", self.m, 0, directions=True)]
        self.out_axes = self._ints(spec, "scan_output_axes", self.k, 0)
        self.out_rev = [d == 1 for d in self._ints(spec, "scan_output_directions", self.k, 0, directions=True)]

    @staticmethod
    def _ints(spec: KernelSpec, key: str, n: int, default: int, directions: bool = False) -> list[int]:
        value = spec.attr(key)
        values = [default] * n if value is None else [int(v) for v in value]
        if len(values) != n:
            raise refuse(spec, f"{key}={values} for {n} values", f"one entry per value ({n})")
        if directions and any(v not in (0, 1) for v in values):
            raise refuse(spec, f"{key}={values}", "0 (forward) or 1 (reverse)")
        return values


def _scan_shape(spec: KernelSpec) -> OutputShapes:
    try:
        lay = _ScanLayout(spec)
    except UnsupportedOpError:
        return [(None, None)] * spec.n_outputs
    body = _graph_types(spec.attr("body"))
    if len(body) != spec.n_outputs:
        return [(None, None)] * spec.n_outputs
    first = spec.shapes[lay.n]
    steps = -1 if first is None else first[norm_axis(lay.in_axes[0], len(first))]
    out: OutputShapes = []
    for j in range(lay.n):
        shape, dtype = body[j]
        out.append((_merge(spec.shapes[j], shape), spec.dtypes[j] if spec.dtypes[j] is not None else dtype))
    for (shape, dtype), axis in zip(body[lay.n:], lay.out_axes):
        out.append((_with_dim(shape, axis, steps), dtype))
    return out


@register("Scan", _scan_shape)
def scan(spec: KernelSpec) -> Run:
    lay = _ScanLayout(spec)
    n, m, k = lay.n, lay.m, lay.k
    body = _compiled(spec, "body", n + m + _captures(spec), n + k)
    state_borrowed = body.borrowed[:n]
    out_types = body.outputs[n:]

    def run(*operands: np.ndarray) -> tuple[np.ndarray, ...]:
        state, xs, captures = list(operands[:n]), operands[n:n + m], list(operands[n + m:])
        axes = [norm_axis(a, x.ndim) for a, x in zip(lay.in_axes, xs)]
        lengths = {x.shape[a] for x, a in zip(xs, axes)}
        if len(lengths) != 1:
            raise ValueError(f"Scan inputs differ in length along their scan axes: {sorted(lengths)}")
        steps = lengths.pop()
        collected: list[list[np.ndarray]] = [[] for _ in range(k)]
        for t in range(steps):
            elems = [x[(slice(None),) * a + (steps - 1 - t if rev else t,)] for x, a, rev in zip(xs, axes, lay.in_rev)]
            outs = body.run([*state, *elems, *captures])
            state = outs[:n]
            for c, y in zip(collected, outs[n:]):
                c.append(y)
        finals = _owned(state, state_borrowed if steps else (True,) * n, operands)
        results = []
        for j, (c, axis, rev) in enumerate(zip(collected, lay.out_axes, lay.out_rev)):
            if c:
                results.append(np.stack(c[::-1] if rev else c, axis=axis))
                continue
            shape, dtype = out_types[j]
            if shape is None or dtype is None:
                raise ValueError(f"Scan {spec.name}: zero iterations and the element type of output {n + j} is unknown")
            results.append(np.empty(_with_dim(tuple(max(d, 0) for d in shape), axis, 0) or (), dtype))
        return (*finals, *results)

    return run
