"""Layout choice: run convolution-family ops in NHWC and sink the transposes until they cancel.

NumPy's GEMM is fastest with one tall matrix: in NHWC an im2col convolution is a single
(N*OH*OW, kh*kw*C) x (kh*kw*C, O) product whose result already is the next layer's input, and a
pointwise convolution needs no copy at all. Converters hand us NCHW (with a Transpose at the
input), so each conv-family node is rewritten as its NHWC twin between two Transposes, and the
Transposes are then pushed through layout-agnostic ops until adjacent pairs compose to identity;
a transpose that several such ops read is copied for each, so each copy can sink on its own.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..graph import Graph, Node

TO_NHWC = [0, 2, 3, 1]
TO_NCHW = [0, 3, 1, 2]
FAMILY = {"FusedConv": "FusedConvNHWC", "QConv": "QConvNHWC", "MaxPool": "MaxPoolNHWC", "AveragePool": "AveragePoolNHWC",
          "GlobalAveragePool": "GlobalAveragePoolNHWC", "GlobalMaxPool": "GlobalMaxPoolNHWC"}
UNARY = {"Relu", "Sigmoid", "Silu", "Tanh", "HardSwish", "HardSigmoid", "LeakyRelu", "Clip", "Gelu", "Elu", "Softplus",
         "Exp", "Log", "Sqrt", "Neg", "Abs", "Reciprocal", "Erf", "Identity", "Cast", "QuantizeLinear", "DequantizeLinear"}
PER_TENSOR = {"QuantizeLinear", "DequantizeLinear"}  # layout-agnostic only with one scale for the whole tensor
BINARY = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"}
MIN_FAMILY_NODES = 2  # one lone convolution is cheaper with no transposes at all


def compose(first: list[int], then: list[int]) -> list[int]:
    """Perm of Transpose(then) applied after Transpose(first)."""
    return [first[k] for k in then]


def inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for k, p in enumerate(perm):
        inv[p] = k
    return inv


class _Rewriter:
    def __init__(self, graph: Graph) -> None:
        self.g = graph
        self.counter = 0

    def fresh(self, base: str) -> str:
        self.counter += 1
        return f"{base}:layout{self.counter}"

    def index(self) -> None:
        """Who makes and who reads each value, as the graph is now: every rule looks up through
        this and returns at its first change, so the index is taken again before each rule."""
        self._producers = {o: n for n in self.g.nodes for o in n.outputs}
        self._users: dict[str, list[Node]] = {}
        for n in self.g.nodes:
            for i in dict.fromkeys(n.inputs):
                self._users.setdefault(i, []).append(n)

    def producer(self, value: str) -> Node | None:
        return self._producers.get(value)

    def users(self, value: str) -> list[Node]:
        return self._users.get(value, [])

    def unread(self, value: str) -> bool:
        """After a change (the index is stale): whether no node reads `value`."""
        return all(value not in n.inputs for n in self.g.nodes)

    def single_use_transpose(self, value: str) -> Node | None:
        p = self.producer(value)
        if p is None or p.op != "Transpose" or value in self.g.output_names():
            return None
        return p if len(self.users(value)) == 1 else None

    def transpose(self, src: str, perm: list[int], out: str | None = None) -> Node:
        out = out or self.fresh(src)
        return Node("Transpose", self.fresh("transpose"), [src], [out], {"perm": list(perm)})

    def insert_before(self, anchor: Node, node: Node) -> None:
        self.g.nodes.insert(self.g.nodes.index(anchor), node)

    def insert_after(self, anchor: Node, node: Node) -> None:
        self.g.nodes.insert(self.g.nodes.index(anchor) + 1, node)


def _rank4(graph: Graph, value: str) -> bool:
    v = graph.values.get(value)
    return v is not None and v.shape is not None and len(v.shape) == 4


def to_nhwc(graph: Graph) -> Graph:
    family = [n for n in graph.nodes if n.op in FAMILY and _rank4(graph, n.inputs[0])
              and (n.op not in ("FusedConv", "QConv") or n.inputs[1] in graph.constants)]
    if len(family) < MIN_FAMILY_NODES:
        return graph
    rw = _Rewriter(graph)
    for node in family:
        operands = [0, 3] if node.op in ("FusedConv", "QConv") else [0]
        for i in operands:
            if i < len(node.inputs) and node.inputs[i]:
                t = rw.transpose(node.inputs[i], TO_NHWC)
                rw.insert_before(node, t)
                node.inputs[i] = t.outputs[0]
        out = node.outputs[0]
        node.outputs[0] = rw.fresh(out)
        node.op = FAMILY[node.op]
        rw.insert_after(node, rw.transpose(node.outputs[0], TO_NCHW, out))
    rules = (_cancel, _sink_unary, _sink_binary, _sink_pad, _sink_concat, _split_shared)
    while any(rule(rw) for rule in rules):
        pass
    return graph


def _replace_uses(rw: _Rewriter, old: str, new: str) -> None:
    for n in rw.g.nodes:
        n.inputs = [new if i == old else i for i in n.inputs]


def _indexed(rule: Callable[[_Rewriter], bool]) -> Callable[[_Rewriter], bool]:
    """A rule that looks values up in a fresh index; it returns at its first change."""
    def run(rw: _Rewriter) -> bool:
        rw.index()
        return rule(rw)

    return run


@_indexed
def _cancel(rw: _Rewriter) -> bool:
    for t2 in rw.g.nodes:
        if t2.op != "Transpose":
            continue
        t1 = rw.producer(t2.inputs[0])
        if t1 is None or t1.op != "Transpose":
            continue
        perm = compose(t1.attrs["perm"], t2.attrs["perm"])
        if perm == list(range(len(perm))):
            if t2.outputs[0] in rw.g.output_names():
                t2.op, t2.inputs, t2.attrs = "Identity", [t1.inputs[0]], {}
            else:
                _replace_uses(rw, t2.outputs[0], t1.inputs[0])
                rw.g.nodes.remove(t2)
        else:
            t2.inputs, t2.attrs = [t1.inputs[0]], {"perm": perm}
        if rw.unread(t1.outputs[0]) and t1.outputs[0] not in rw.g.output_names():
            rw.g.nodes.remove(t1)
        return True
    return False


def _move_after(rw: _Rewriter, node: Node, t: Node, sources: dict[int, str]) -> None:
    """node(T(x)...) -> T(node(x)...): node reads the transposes' sources, one T follows it."""
    for i, src in sources.items():
        node.inputs[i] = src
    out = node.outputs[0]
    node.outputs[0] = rw.fresh(out)
    rw.g.nodes.remove(t)
    rw.insert_after(node, Node("Transpose", t.name, [node.outputs[0]], [out], dict(t.attrs)))


@_indexed
def _sink_unary(rw: _Rewriter) -> bool:
    for node in rw.g.nodes:
        if node.op not in UNARY or len(node.outputs) != 1:
            continue
        if any(i and i not in rw.g.constants for i in node.inputs[1:]):
            continue
        if node.op in PER_TENSOR and rw.g.constants[node.inputs[1]].size != 1:
            continue
        t = rw.single_use_transpose(node.inputs[0])
        if t is not None:
            _move_after(rw, node, t, {0: t.inputs[0]})
            return True
    return False


@_indexed
def _sink_binary(rw: _Rewriter) -> bool:
    for node in rw.g.nodes:
        if node.op not in BINARY or len(node.inputs) != 2:
            continue
        ts = [rw.single_use_transpose(i) for i in node.inputs]
        t0, t1 = ts
        if t0 is not None and t1 is not None and t0 is not t1 and t0.attrs["perm"] == t1.attrs["perm"]:
            rw.g.nodes.remove(t1)
            _move_after(rw, node, t0, {0: t0.inputs[0], 1: t1.inputs[0]})
            return True
        for k in (0, 1):
            t, other = ts[k], node.inputs[1 - k]
            if t is None or other not in rw.g.constants:
                continue
            perm = t.attrs["perm"]
            c = rw.g.constants[other]
            if c.ndim > len(perm):
                continue
            c4 = c.reshape((1,) * (len(perm) - c.ndim) + c.shape)
            name = rw.fresh(other)
            rw.g.constants[name] = np.ascontiguousarray(np.transpose(c4, inverse(perm)))
            _move_after(rw, node, t, {k: t.inputs[0], 1 - k: name})
            return True
    return False


def _accepts(rw: _Rewriter, user: Node, perm: list[int]) -> bool:
    """Whether a transpose by `perm` feeding `user` would sink through it (or cancel in it)."""
    def transposed(value: str) -> bool:
        p = rw.producer(value)
        return p is not None and p.op == "Transpose" and p.attrs["perm"] == perm

    if user.op == "Transpose":
        return True
    if user.op in UNARY:
        return len(user.outputs) == 1 and all(not i or i in rw.g.constants for i in user.inputs[1:]) and (
            user.op not in PER_TENSOR or rw.g.constants[user.inputs[1]].size == 1)
    if user.op in BINARY:
        return len(user.inputs) == 2 and all(transposed(i) or (i in rw.g.constants and rw.g.constants[i].ndim <= len(perm))
                                             for i in user.inputs)
    if user.op == "Concat":
        return all(transposed(i) for i in user.inputs)
    return False


@_indexed
def _split_shared(rw: _Rewriter) -> bool:
    """A transpose read by several nodes, each of which it would sink through, becomes one copy
    per reader: DenseNet's concatenations feed both the next layer and the next concatenation."""
    for t in rw.g.nodes:
        if t.op != "Transpose" or t.outputs[0] in rw.g.output_names():
            continue
        users = rw.users(t.outputs[0])
        if len(users) < 2 or not all(_accepts(rw, u, t.attrs["perm"]) for u in users):
            continue
        for user in users[1:]:
            copy = rw.transpose(t.inputs[0], t.attrs["perm"])
            rw.insert_after(t, copy)
            user.inputs = [copy.outputs[0] if i == t.outputs[0] else i for i in user.inputs]
        return True
    return False


@_indexed
def _sink_pad(rw: _Rewriter) -> bool:
    for node in rw.g.nodes:
        if node.op != "Pad" or len(node.inputs) < 2 or node.inputs[1] not in rw.g.constants:
            continue
        if len(node.inputs) > 3 and node.inputs[3]:
            continue
        t = rw.single_use_transpose(node.inputs[0])
        if t is None:
            continue
        perm = t.attrs["perm"]
        pads = rw.g.constants[node.inputs[1]].reshape(-1)
        r = len(perm)
        begin, end = np.zeros(r, np.int64), np.zeros(r, np.int64)
        for k in range(r):
            begin[perm[k]], end[perm[k]] = pads[k], pads[k + r]
        name = rw.fresh(node.inputs[1])
        rw.g.constants[name] = np.concatenate([begin, end])
        node.inputs[1] = name
        _move_after(rw, node, t, {0: t.inputs[0]})
        return True
    return False


@_indexed
def _sink_concat(rw: _Rewriter) -> bool:
    for node in rw.g.nodes:
        if node.op != "Concat":
            continue
        found = [t for t in (rw.single_use_transpose(i) for i in node.inputs) if t is not None]
        if (len(found) != len(node.inputs) or len({tuple(t.attrs["perm"]) for t in found}) != 1
                or len(set(map(id, found))) != len(found)):
            continue
        perm = found[0].attrs["perm"]
        axis = node.attrs["axis"] % len(perm)
        node.attrs = {**node.attrs, "axis": perm[axis]}
        for t in found[1:]:
            rw.g.nodes.remove(t)
        _move_after(rw, node, found[0], {i: t.inputs[0] for i, t in enumerate(found)})
        return True
    return False
