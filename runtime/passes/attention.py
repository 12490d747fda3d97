"""Attention: MatMul(q, k) -> Softmax over the last axis -> MatMul(p, v) becomes one FusedAttention
node (runtime/kernels/attention.py), together with what only lays its tensors out:

- the reshapes between the three, where they keep the last two dims (a converter's 3-D batched
  MatMuls around a 4-D Softmax);
- the Transposes and Reshapes that split q, k and v into heads, and the ones that merge the heads
  of the result back, as view ops the kernel reads through (strides, not copies).

Only what is statically known fuses: float32 operands whose shapes have no unknown dims, the
MatMuls without broadcasting, and every absorbed value read by the next node alone.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from ..graph import Graph, Node, toposort, unique_name
from ..kernels.registry import SOFTMAX_SCALE
from .chains import over_last_axis
from .fusion import ConsumerIndex

ATTENTION = "FusedAttention"
_F32 = np.dtype(np.float32)


def _static(graph: Graph, value: str) -> tuple[int, ...] | None:
    info = graph.values.get(value)
    if info is None or info.shape is None or any(d < 0 for d in info.shape) or info.dtype != _F32:
        return None
    return tuple(info.shape)


def _layout_op(graph: Graph, node: Node) -> bool:
    """A Transpose, or a Reshape to a constant target, between static float32 tensors."""
    if len(node.outputs) != 1 or _static(graph, node.inputs[0]) is None or _static(graph, node.outputs[0]) is None:
        return False
    return node.op == "Transpose" or (node.op == "Reshape" and len(node.inputs) > 1 and node.inputs[1] in graph.constants)


def _view(graph: Graph, node: Node) -> tuple[str, list[int]]:
    if node.op == "Transpose":
        rank = len(_static(graph, node.inputs[0]) or ())
        return ("T", [int(a) for a in node.attrs.get("perm") or range(rank - 1, -1, -1)])
    return ("R", list(_static(graph, node.outputs[0]) or ()))


def _keeps_rows(graph: Graph, node: Node) -> bool:
    """A Reshape that regroups only the batch dims: the last two stay."""
    if not _layout_op(graph, node) or node.op != "Reshape":
        return False
    src, dst = _static(graph, node.inputs[0]), _static(graph, node.outputs[0])
    return src is not None and dst is not None and len(src) >= 2 and len(dst) >= 2 and src[-2:] == dst[-2:]


def fuse_attention(graph: Graph) -> Graph:
    index = ConsumerIndex(graph)
    producers = graph.producers()
    taken = graph.value_names()

    def back(value: str, reader: Node, accept: Callable[[Node], bool]) -> tuple[str, list[Node]]:
        """From `value` (read by `reader`) back through accepted nodes each read only by the next:
        the first value not made so, and the nodes in program order."""
        chain: list[Node] = []
        while (node := producers.get(value)) is not None and accept(node) and index.sole_user(value) is reader:
            chain.append(node)
            reader, value = node, node.inputs[0]
        return value, chain[::-1]

    def forward(value: str, accept: Callable[[Node], bool]) -> tuple[str, list[Node]]:
        chain: list[Node] = []
        while (user := index.sole_user(value)) is not None and accept(user) and user.inputs[0] == value:
            chain.append(user)
            value = user.outputs[0]
        return value, chain

    def matmul(node: Node | None) -> bool:
        return node is not None and node.op == "MatMul" and len(node.inputs) == 2 and not any(i in graph.constants for i in node.inputs)

    layout, keeps_rows = functools.partial(_layout_op, graph), functools.partial(_keeps_rows, graph)

    for softmax in [n for n in graph.nodes if n.op == "Softmax"]:
        if not over_last_axis(graph, softmax) or _static(graph, softmax.inputs[0]) is None:
            continue
        scores, before = back(softmax.inputs[0], softmax, keeps_rows)
        first = producers.get(scores)
        if not matmul(first) or index.sole_user(scores) is not (before[0] if before else softmax):
            continue
        probs, after = forward(softmax.outputs[0], keeps_rows)
        second = index.sole_user(probs)
        if first is None or second is None or not matmul(second) or second.inputs[0] != probs:
            continue
        q, k, p, v, result = first.inputs[0], first.inputs[1], second.inputs[0], second.inputs[1], second.outputs[0]
        shapes = [s for x in (q, k, p, v, result) if (s := _static(graph, x)) is not None and len(s) >= 2]
        if len(shapes) < 5:
            continue
        qs, ks, ps, vs, _ = shapes
        if qs[:-2] != ks[:-2] or ps[:-2] != vs[:-2] or qs[-1] != ks[-2] or ps[-1] != vs[-2]:
            continue  # broadcasting batch dims or mismatched contractions stay as they were
        operands = [back(x, reader, layout) for x, reader in ((q, first), (k, first), (v, second))]
        output, out_nodes = forward(result, layout)
        absorbed = [n for _, chain in operands for n in chain] + [first, *before, softmax, *after, second, *out_nodes]
        attrs = {
            "scale": float(softmax.attrs.get(SOFTMAX_SCALE, 1.0)),
            "shapes": [list(qs), list(ks), list(vs)],
            **{f"{name}_views": [_view(graph, n) for n in chain] for name, (_, chain) in zip("qkv", operands)},
            "out_views": [_view(graph, n) for n in out_nodes],
            "out_from": [list(_static(graph, n.inputs[0]) or ()) for n in out_nodes],
            "out_shape": list(_static(graph, output) or ()),
        }
        at = graph.nodes.index(second)
        node = Node(ATTENTION, unique_name(f"{second.name}__attention", taken), [src for src, _ in operands], [output], attrs)
        graph.nodes.insert(at, node)
        for n in absorbed:
            graph.nodes.remove(n)
        index = ConsumerIndex(graph)
        producers = graph.producers()
    return toposort(graph)
