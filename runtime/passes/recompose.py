"""Recompose what converters spell out op by op: GELU and layer normalization.

tf2onnx writes Keras' GELU as six elementwise nodes (0.5 * x * (1 - erf(-x / sqrt 2))) and its
LayerNormalization as thirteen (moments, rsqrt, scale, shift). Each node is a pass over the
tensor and a step of the plan; as one Gelu / LayerNormalization node they are one kernel, and
Gelu can then ride in a matmul's epilogue. A pattern is replaced only when nothing outside it
reads its intermediates.
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Graph, Node

_TOLERANCE = 1e-4  # how far a converter's rounded constant (0.5, 1/sqrt 2, 1) may be from exact


class _Matcher:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.producers = graph.producers()
        self.users = graph.consumers()
        self.outputs = graph.output_names()

    def node(self, value: str, *ops: str) -> Node | None:
        n = self.producers.get(value)
        return n if n is not None and n.op in ops else None

    def const(self, value: str) -> np.ndarray | None:
        return self.graph.constants.get(value)

    def scalar(self, value: str, expected: float) -> bool:
        c = self.const(value)
        return c is not None and c.size == 1 and abs(float(c.reshape(-1)[0]) - expected) <= _TOLERANCE * max(1.0, abs(expected))

    def with_scalar(self, node: Node | None, expected: float) -> str | None:
        """The other operand of a binary node whose one operand is the scalar `expected`."""
        if node is None or len(node.inputs) != 2:
            return None
        a, b = node.inputs
        if self.scalar(b, expected):
            return a
        if self.scalar(a, expected) and node.op in ("Mul", "Add"):
            return b
        return None

    def closed(self, root: Node, interior: list[Node]) -> bool:
        """Whether every value the interior nodes write is read only inside the pattern."""
        inside = {id(n) for n in interior} | {id(root)}
        for n in interior:
            for out in n.outputs:
                if out in self.outputs or any(id(u) not in inside for u in self.users.get(out, [])):
                    return False
        return True

    def replace(self, root: Node, interior: list[Node], new: Node) -> None:
        nodes = self.graph.nodes
        nodes[nodes.index(root)] = new
        for n in interior:
            nodes.remove(n)


def _gelu(m: _Matcher, root: Node) -> tuple[str, list[Node]] | None:
    """x and the interior of Mul(Mul(x, 0.5), 1 + erf(x / sqrt 2)), in the forms converters write."""
    for half_value, rest_value in (root.inputs, root.inputs[::-1]):
        half = m.node(half_value, "Mul")
        x = m.with_scalar(half, 0.5)
        if x is None or half is None:
            continue
        one_plus = m.node(rest_value, "Add", "Sub")
        if one_plus is None:
            continue
        if one_plus.op == "Add":
            erf_value, negated = m.with_scalar(one_plus, 1.0), False
        else:
            erf_value, negated = (one_plus.inputs[1] if m.scalar(one_plus.inputs[0], 1.0) else None), True
        erf = m.node(erf_value or "", "Erf")
        if erf is None:
            continue
        scaled = m.node(erf.inputs[0], "Mul", "Div")
        if scaled is None:
            continue
        arg = m.with_scalar(scaled, math.sqrt(0.5)) if scaled.op == "Mul" else m.with_scalar(scaled, math.sqrt(2.0))
        interior = [half, one_plus, erf, scaled]
        if negated:  # 1 - erf(-x / sqrt 2)
            neg = m.node(arg or "", "Neg")
            if neg is None:
                continue
            arg = neg.inputs[0]
            interior.append(neg)
        if arg == x and m.closed(root, interior):
            return x, interior
    return None


def _last_axis_mean(m: _Matcher, value: str) -> tuple[Node, str] | None:
    """(node, x) for a mean of x over its last axis, keeping it: ReduceMean, or GlobalAveragePool of a 3-D x."""
    n = m.node(value, "ReduceMean", "GlobalAveragePool")
    if n is None:
        return None
    x = n.inputs[0]
    info = m.graph.values.get(x)
    rank = None if info is None or info.shape is None else len(info.shape)
    if rank is None:
        return None
    if n.op == "GlobalAveragePool":
        return (n, x) if rank == 3 else None
    axes = n.attrs.get("axes")
    if axes is None and len(n.inputs) > 1:
        c = m.const(n.inputs[1])
        axes = None if c is None else [int(a) for a in c.reshape(-1)]
    if axes is None or len(axes) != 1 or axes[0] % rank != rank - 1 or not n.attrs.get("keepdims", 1):
        return None
    return n, x


def _channel_vector(c: np.ndarray | None, rank: int) -> np.ndarray | None:
    """A constant that varies only along the last axis of a rank-`rank` tensor, as (C,)."""
    if c is None or c.ndim > rank or any(d != 1 for d in c.shape[:-1]):
        return None
    return np.ascontiguousarray(c.reshape(-1), dtype=np.float32)


def _layer_norm(m: _Matcher, root: Node) -> tuple[str, np.ndarray, np.ndarray, float, list[Node]] | None:
    """(x, gamma, beta, epsilon, interior) of x * g + (beta - mean * g), g = gamma / sqrt(var + eps)."""
    for scaled_value, shift_value in (root.inputs, root.inputs[::-1]):
        scaled, shift = m.node(scaled_value, "Mul"), m.node(shift_value, "Add")
        if scaled is None or shift is None:
            continue
        for x, g_value in (scaled.inputs, scaled.inputs[::-1]):
            g = m.node(g_value, "Mul")
            if g is None:
                continue
            beta_value, shifted_value = shift.inputs if m.const(shift.inputs[0]) is not None else shift.inputs[::-1]
            shifted = m.node(shifted_value, "Mul")
            if shifted is None or g_value not in shifted.inputs:
                continue
            neg = m.node(shifted.inputs[1] if shifted.inputs[0] == g_value else shifted.inputs[0], "Neg")
            mean = _last_axis_mean(m, neg.inputs[0]) if neg is not None else None
            if mean is None or mean[1] != x:
                continue
            rstd_value, gamma_value = g.inputs if m.const(g.inputs[1]) is not None else g.inputs[::-1]
            rstd = m.node(rstd_value, "Reciprocal")
            sqrt = m.node(rstd.inputs[0], "Sqrt") if rstd is not None else None
            plus_eps = m.node(sqrt.inputs[0], "Add") if sqrt is not None else None
            if plus_eps is None:
                continue
            var_value, eps_value = plus_eps.inputs if m.const(plus_eps.inputs[1]) is not None else plus_eps.inputs[::-1]
            eps = m.const(eps_value)
            var = _last_axis_mean(m, var_value)
            square = m.node(var[1], "Mul") if var is not None else None
            diff = m.node(square.inputs[0], "Sub") if square is not None and square.inputs[0] == square.inputs[1] else None
            if diff is None or eps is None or eps.size != 1 or diff.inputs != [x, mean[0].outputs[0]]:
                continue
            rank = len(m.graph.values[x].shape or ())
            gamma, beta = _channel_vector(m.const(gamma_value), rank), _channel_vector(m.const(beta_value), rank)
            parts = [scaled, shift, g, shifted, neg, mean[0], rstd, sqrt, plus_eps, var[0] if var else None, square, diff]
            interior = [n for n in parts if n is not None]
            if len(interior) != len(parts) or gamma is None or beta is None or gamma.size != beta.size or not m.closed(root, interior):
                continue
            return x, gamma, beta, float(eps.reshape(-1)[0]), interior
    return None


def recompose_gelu(graph: Graph) -> bool:
    m = _Matcher(graph)
    for node in graph.nodes:
        if node.op == "Mul" and len(node.inputs) == 2 and (found := _gelu(m, node)) is not None:
            x, interior = found
            m.replace(node, interior, Node("Gelu", node.name, [x], list(node.outputs)))
            return True
    return False


def recompose_layer_norm(graph: Graph) -> bool:
    m = _Matcher(graph)
    taken = graph.value_names()
    for node in graph.nodes:
        if node.op == "Add" and len(node.inputs) == 2 and (found := _layer_norm(m, node)) is not None:
            x, gamma, beta, eps, interior = found
            names = []
            for suffix, value in (("gamma", gamma), ("beta", beta)):
                name = f"{node.name}/{suffix}"
                while name in taken:
                    name += "_"
                graph.constants[name] = value
                taken.add(name)
                names.append(name)
            m.replace(node, interior, Node("LayerNormalization", node.name, [x, *names], list(node.outputs),
                                           {"axis": -1, "epsilon": eps}))
            return True
    return False
