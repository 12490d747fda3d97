"""Keras GRU layers, exported as ONNX Loops, back to ONNX GRU nodes.

Keras 3 runs a GRU as a tf.while_loop, which tf2onnx keeps as a Loop whose body spells the cell
out op by op (its LSTM it rewrites to an ONNX LSTM itself): every time step is one trip of the
executor through a few dozen small kernels. As a GRU node, the input projection of all steps is
one GEMM and the recurrence one compiled kernel (kernels/recurrent.py).

A Loop is rewritten only when all of this holds, and is left as it is otherwise (masking, other
activations, a trip count known only at run time):
- its trip count is known when the plan is compiled: the values that steer it fold to constants
  (a static sequence length, or a plan compiled for a request's shapes), and running the body's
  control part on them ends the loop within the sequence;
- each step reads its input as row `t` of an outer sequence, `t` a carried counter stepping by one;
- the cell's weights are constants (x @ W and h @ R, biases added after them; for a GRU with
  reset_after=False, h @ R's z and r columns and (r * h) @ R's h columns);
- the body's new state and scan output equal the ONNX cell's on random probes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..graph import Graph, Node, ValueInfo, unique_name
from ..kernels.registry import lookup
from .constant_folding import fold_to_fixpoint
from .shape_inference import infer_shapes, spec_for

GATES = 3  # z, r, h: Keras' order and ONNX's
PROBE_ROWS = 3
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-5  # float64 reference vs the body's float32 kernels


@dataclass(frozen=True)
class _Cell:
    w: np.ndarray  # (inputs, 3 * hidden): the body's x @ w
    r: np.ndarray  # (hidden, 3 * hidden): the body's h @ r
    bx: np.ndarray  # bias after x @ w
    bh: np.ndarray  # bias after h @ r
    reset_after: bool  # r scales h @ Rh (Keras' default, ONNX's linear_before_reset) or h before it

    @property
    def hidden(self) -> int:
        return int(self.r.shape[0])

    def step(self, x: np.ndarray, h: np.ndarray) -> np.ndarray:
        """The ONNX GRU cell in float64 (default activations)."""
        n = self.hidden
        gx = x.astype(np.float64) @ self.w + self.bx
        gh = h.astype(np.float64) @ self.r + self.bh
        z = _sigmoid(gx[:, :n] + gh[:, :n])
        r = _sigmoid(gx[:, n:2 * n] + gh[:, n:2 * n])
        recurrent = r * gh[:, 2 * n:] if self.reset_after else (r * h) @ self.r[:, 2 * n:] + self.bh[2 * n:]
        return z * h + (1 - z) * np.tanh(gx[:, 2 * n:] + recurrent)

    def onnx_weights(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """W (1, 3H, I), R (1, 3H, H) and B (1, 6H) as ONNX's GRU takes them."""
        dtype = self.w.dtype
        w = np.ascontiguousarray(self.w.T)[None]
        r = np.ascontiguousarray(self.r.T)[None]
        return w.astype(dtype), r.astype(dtype), np.concatenate([self.bx, self.bh])[None].astype(dtype)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _evaluate(body: Graph, feeds: Mapping[str, np.ndarray], wanted: list[str]) -> list[np.ndarray] | None:
    """The body's `wanted` values for `feeds`, computed by constant folding (its kernels, once)."""
    g = fold_to_fixpoint(Graph(nodes=list(body.nodes), inputs=[], outputs=body.outputs, constants={**body.constants, **feeds},
                               opset=body.opset))
    if any(w not in g.constants for w in wanted):
        return None
    return [g.constants[w] for w in wanted]


def _stepper(part: Graph, feeds: Mapping[str, np.ndarray]) -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
    """`part` with its kernels made once for inputs typed like `feeds`: run once per simulated step."""
    g = Graph(nodes=list(part.nodes), inputs=[ValueInfo(k, v.dtype, v.shape) for k, v in feeds.items()], outputs=[],
              constants=part.constants, opset=part.opset)
    infer_shapes(g)
    runs = [(node, lookup(node.op, node=node.name).factory(spec_for(g, node))) for node in g.nodes]

    def step(values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        env = {**g.constants, **values}
        for node, run in runs:
            env.update(zip(node.outputs, run(*[env[i] if i else None for i in node.inputs])))
        return env

    return step


def _slice_for(body: Graph, wanted: list[str]) -> Graph:
    """The body's nodes that `wanted` depends on, in order: the loop's control part."""
    producers = body.producers()
    needed, stack = set(), list(wanted)
    while stack:
        node = producers.get(stack.pop())
        if node is not None and id(node) not in needed:
            needed.add(id(node))
            stack.extend(i for i in node.inputs if i)
    return Graph(nodes=[n for n in body.nodes if id(n) in needed], inputs=[], outputs=[], constants=body.constants, opset=body.opset)


def _bias_chain(body: Graph, value: str, width: int) -> tuple[str, np.ndarray]:
    """Follow `value` through Adds of a constant bias of `width` (its only reader each time)."""
    consumers, bias = body.consumers(), np.zeros(width)
    while len(users := consumers.get(value, [])) == 1 and users[0].op == "Add":
        other = [i for i in users[0].inputs if i != value]
        const = body.constants.get(other[0]) if len(other) == 1 else None
        if const is None or const.size != width or const.shape[-1] != width:
            break
        bias = bias + const.reshape(width)
        value = users[0].outputs[0]
    return value, bias


@dataclass(frozen=True)
class _Plan:
    cell: _Cell
    sequence: str  # the outer sequence the steps read rows of
    time: int  # carried slot of the row counter
    h: int  # carried slot of the state
    passthrough: dict[int, str]  # carried slot -> the outer value it passes on unchanged


def rewrite_recurrent_loops(graph: Graph) -> Graph:
    """Replace every Loop that is a Keras GRU over a known number of steps. Shapes are
    inferred again after each, so a layer reading the one before sees a static sequence."""
    taken = graph.value_names()
    i = 0
    while i < len(graph.nodes):
        node = graph.nodes[i]
        new = _rewrite(graph, node, taken) if node.op == "Loop" and not node.domain else None
        if new is None:
            i += 1
            continue
        graph.nodes[i:i + 1] = new
        infer_shapes(graph)
        i += len(new)
    return graph


def _rewrite(graph: Graph, node: Node, taken: set[str]) -> list[Node] | None:
    body = node.attrs.get("body")
    k = node.captures
    own = len(node.inputs) - k
    n = own - 2
    if not isinstance(body, Graph) or n < 2 or len(body.inputs) != own + k or len(body.outputs) < 1 + n:
        return None
    if any(sub.subgraphs() for sub in body.nodes):
        return None
    formal = [v.name for v in body.inputs]
    returned = [v.name for v in body.outputs]
    control = [node.inputs[0], node.inputs[1]]
    if any(x and x not in graph.constants for x in control):
        return None

    # every outer constant the body reads (captured, or carried through unchanged) becomes its own
    consts: dict[str, np.ndarray] = {}
    passthrough: dict[int, str] = {}
    for j in range(n):
        if returned[1 + j] == formal[2 + j]:
            passthrough[j] = node.inputs[2 + j]
            if node.inputs[2 + j] in graph.constants:
                consts[formal[2 + j]] = graph.constants[node.inputs[2 + j]]
    captured = {formal[own + j]: node.inputs[own + j] for j in range(k)}
    for f, outer in captured.items():
        if outer in graph.constants:
            consts[f] = graph.constants[outer]
    body = fold_to_fixpoint(Graph(nodes=list(body.nodes), inputs=[v for v in body.inputs if v.name not in consts],
                                  outputs=body.outputs, constants={**body.constants, **consts}, opset=body.opset))  # the weights' splits fold

    plan = _recognize(graph, body, node, formal, captured, passthrough, n)
    if plan is None:
        return None
    trips = _trip_count(graph, body, node, formal, returned, plan)
    if trips is None:
        return None
    start, count, time_final = trips
    if not _probe_matches(body, node, formal, returned, plan, graph, n, start):
        return None
    return _replacement(graph, node, plan, start, count, time_final, n, taken)


def _recognize(graph: Graph, body: Graph, node: Node, formal: list[str], captured: dict[str, str],
               passthrough: dict[int, str], n: int) -> _Plan | None:
    carried = {formal[2 + j]: j for j in range(n)}
    producers = body.producers()
    matmuls = [m for m in body.nodes if m.op == "MatMul" and m.inputs[1] in body.constants and body.constants[m.inputs[1]].ndim == 2]
    recurrent = [m for m in matmuls if m.inputs[0] in carried and carried[m.inputs[0]] not in passthrough]
    reads = [(m, g) for m in matmuls if (g := producers.get(m.inputs[0])) is not None and g.op == "Gather"
             and int(g.attrs.get("axis", 0)) == 0 and g.inputs[0] in captured and captured[g.inputs[0]] not in graph.constants
             and g.inputs[1] in carried]
    if len(recurrent) != 1 or len(reads) != 1:
        return None
    (rm,), ((xm, gather),) = recurrent, reads
    r, w = body.constants[rm.inputs[1]], body.constants[xm.inputs[1]]
    hidden = r.shape[0]
    reset_after = True
    if hidden and r.shape[1] == 2 * hidden and w.shape[1] == 3 * hidden:
        # GRU with reset_after=False: h @ R[:, :2H] for z and r, then (r * h) @ R[:, 2H:]
        gated = [m for m in matmuls if m is not rm and m is not xm and body.constants[m.inputs[1]].shape == (hidden, hidden)]
        if len(gated) != 1:
            return None
        r, reset_after = np.concatenate([r, body.constants[gated[0].inputs[1]]], axis=1), False
    width = GATES * hidden
    if not hidden or r.shape[1] != width or w.shape[1] != width or w.dtype != r.dtype:
        return None
    _, bx = _bias_chain(body, xm.outputs[0], width)
    _, bh = _bias_chain(body, rm.outputs[0], width if reset_after else 2 * hidden)
    if not reset_after:
        bh = np.concatenate([bh, np.zeros(hidden)])
    h, time = carried[rm.inputs[0]], carried[gather.inputs[1]]
    if any(j not in passthrough and j not in (h, time) for j in range(n)):
        return None  # more state than a GRU's
    if any(p not in graph.constants for p in passthrough.values()):
        return None  # a non-constant value carried along: not a cell this pass knows
    return _Plan(_Cell(w, r, bx, bh, reset_after), captured[gather.inputs[0]], time, h, passthrough)


def _trip_count(graph: Graph, body: Graph, node: Node, formal: list[str], returned: list[str], plan: _Plan) -> tuple[int, int, np.ndarray] | None:
    """The counter's first value, how many steps the loop takes and the counter's final value, by running its control part;
    None where that part reads more than the iteration, condition and counter, or the steps
    would read past the sequence."""
    m_name, cond_name = node.inputs[0], node.inputs[1]
    limit = int(graph.constants[m_name].reshape(-1)[0]) if m_name else None
    go = bool(graph.constants[cond_name].reshape(-1)[0]) if cond_name else True
    time_in = node.inputs[2 + plan.time]
    seq = graph.values.get(plan.sequence)
    if time_in not in graph.constants or seq is None or seq.shape is None or not seq.shape or seq.shape[0] < 0:
        return None
    rows = seq.shape[0]
    t = graph.constants[time_in]
    start = int(t.reshape(-1)[0])
    wanted = [returned[0], returned[1 + plan.time]]
    part = _slice_for(body, wanted)
    allowed = {formal[0], formal[1], formal[2 + plan.time]} | set(body.constants) | {o for x in part.nodes for o in x.outputs}
    if any(i and i not in allowed for x in part.nodes for i in x.inputs):
        return None
    names = (formal[0], formal[1], formal[2 + plan.time])
    step = _stepper(part, dict(zip(names, (np.array(0, np.int64), np.array(go), t))))
    i = 0
    while go and (limit is None or i < limit):
        if int(t.reshape(-1)[0]) != start + i or not 0 <= start + i < rows:
            return None
        env = step(dict(zip(names, (np.array(i, np.int64), np.array(go), t))))
        go, t = bool(np.asarray(env[wanted[0]]).reshape(-1)[0]), np.asarray(env[wanted[1]])
        i += 1
    return (start, i, t) if i else None


def _probe_matches(body: Graph, node: Node, formal: list[str], returned: list[str], plan: _Plan, graph: Graph, n: int,
                   start: int) -> bool:
    """Whether one step of the body is the ONNX cell, on random inputs and states: the new state
    and every scan output (the state of each step, as Keras collects it)."""
    rng = np.random.default_rng(0)
    cell, dtype = plan.cell, plan.cell.w.dtype
    seq_formal = next(f for f, outer in zip(formal[2 + n:], node.inputs[2 + n:]) if outer == plan.sequence)
    x = rng.standard_normal((PROBE_ROWS, cell.w.shape[0])).astype(dtype)
    h = (0.5 * rng.standard_normal((PROBE_ROWS, cell.hidden))).astype(dtype)
    seq = np.zeros((start + 1, PROBE_ROWS, x.shape[1]), dtype)
    seq[start] = x
    feeds = {formal[0]: np.array(0, np.int64), formal[1]: np.array(True), formal[2 + plan.time]: graph.constants[node.inputs[2 + plan.time]],
             formal[2 + plan.h]: h, seq_formal: seq}
    if any(v.name not in feeds for v in body.inputs):
        return False
    wanted = [returned[1 + plan.h], *returned[1 + n:]]
    outs = _evaluate(body, feeds, wanted)
    if outs is None:
        return False
    ref = cell.step(x, h)
    return all(o.shape == ref.shape and np.allclose(o, ref, rtol=PROBE_RTOL, atol=PROBE_ATOL) for o in outs)


def _replacement(graph: Graph, node: Node, plan: _Plan, start: int, count: int, time_final: np.ndarray, n: int,
                 taken: set[str]) -> list[Node]:
    """The GRU node over the rows the loop read, and the Loop's outputs from its results."""
    def name(base: str) -> str:
        return unique_name(f"{node.name}/{base}", taken)

    def const(base: str, value: np.ndarray) -> str:
        graph.constants[c := name(base)] = value
        return c

    cell, nodes = plan.cell, []
    xs = plan.sequence
    if start != 0 or count != graph.values[plan.sequence].shape[0]:  # type: ignore[index]
        xs = name("steps")
        nodes.append(Node("Slice", xs, [plan.sequence, const("starts", np.array([start], np.int64)),
                                        const("ends", np.array([start + count], np.int64)), const("axes", np.array([0], np.int64))], [xs]))
    axis0, axis1 = const("axis0", np.array([0], np.int64)), const("axis1", np.array([1], np.int64))
    initial, y, y_h = name("initial_h"), name("Y"), name("Y_h")
    nodes.append(Node("Unsqueeze", initial, [node.inputs[2 + plan.h], axis0], [initial]))
    w, r, b = cell.onnx_weights()
    attrs = {"hidden_size": cell.hidden, "direction": "forward", "linear_before_reset": int(cell.reset_after)}
    nodes.append(Node("GRU", f"{node.name}/gru", [xs, const("W", w), const("R", r), const("B", b), "", initial], [y, y_h], attrs))
    for j, out in enumerate(node.outputs):
        if not out:
            continue
        if j >= n:  # scan outputs: the new state of every step
            nodes.append(Node("Squeeze", f"{out}/squeeze", [y, axis1], [out]))
        elif j == plan.h:
            nodes.append(Node("Squeeze", f"{out}/squeeze", [y_h, axis0], [out]))
        elif j == plan.time:
            graph.constants[out] = np.array(time_final)
        else:
            graph.constants[out] = graph.constants[plan.passthrough[j]]
    return nodes
