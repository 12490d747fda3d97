"""View chains: every op that only reshapes becomes one Reshape, chains of them collapse, and a
chain that ends where it began disappears.

Converters and the layout pass leave runs like GlobalAveragePool -> Transpose -> Squeeze ->
Reshape -> Transpose in front of a squeeze-and-excitation convolution: each is free in NumPy, but
each is one more executor step, and after a large kernel has streamed through the cache a step's
interpreter work costs far more than it does warm. A Transpose that moves only size-1 axes keeps
the element order, so it is a reshape too.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph, Node, unique_name
from ..kernels.registry import TRANSPOSE_VIEW

RESHAPES = {"Reshape", "Squeeze", "Unsqueeze", "Flatten"}


def _shape(graph: Graph, value: str) -> tuple[int, ...] | None:
    v = graph.values.get(value)
    return None if v is None else v.shape


def _keeps_order(perm: list[int], shape: tuple[int, ...]) -> bool:
    """Transpose(perm) of `shape` leaves the element order alone: the axes that are not 1 stay in order."""
    moved = [axis for axis in perm if shape[axis] != 1]
    return moved == sorted(moved)


def _is_reshape(graph: Graph, node: Node) -> bool:
    if len(node.outputs) != 1 or not node.inputs or not node.inputs[0]:
        return False
    src, dst = _shape(graph, node.inputs[0]), _shape(graph, node.outputs[0])
    if src is None or dst is None or 0 in src or 0 in dst or dst.count(-1) > 1:
        return False  # a Reshape target spells at most one unknown dimension
    if node.op in RESHAPES:
        return True
    if node.op == "Transpose":
        perm = node.attrs.get("perm") or list(range(len(src)))[::-1]
        return _keeps_order(list(perm), src)
    return False


def collapse_views(graph: Graph) -> Graph:
    if any(n.subgraphs() for n in graph.nodes):  # bodies read outer values by name: leave their names alone
        return graph
    taken = graph.value_names()
    outputs = graph.output_names()
    renamed: dict[str, str] = {}  # a value that is its source again -> that source
    viewed: dict[str, str] = {}  # a reshaped value -> the value it reshapes
    kept: list[Node] = []
    for node in graph.nodes:
        node.inputs = [renamed.get(i, i) for i in node.inputs]
        if not _is_reshape(graph, node):
            kept.append(node)
            continue
        src = viewed.get(node.inputs[0], node.inputs[0])  # a reshape of a reshape reads the first one's input
        out = node.outputs[0]
        if _shape(graph, src) == _shape(graph, out) and out not in outputs:
            renamed[out] = src  # same shape, same element order: the same tensor
            continue
        target = unique_name(f"{node.name}:view_shape", taken)
        graph.constants[target] = np.array(_shape(graph, out), dtype=np.int64)
        kept.append(Node("Reshape", node.name, [src, target], [out]))
        viewed[out] = src
    graph.nodes = kept
    return graph


def matmul_operands_as_views(graph: Graph) -> Graph:
    """A Transpose that keeps its batch axes and is read only by MatMuls of two activations (an
    attention's K^T, its V) is left a view: BLAS reads a transposed operand in place, which
    costs nothing next to the copy."""
    consumers = graph.consumers()
    outputs = graph.output_names()
    for node in graph.nodes:
        perm = node.attrs.get("perm") if node.op == "Transpose" else None
        if perm is None or list(perm[:-2]) != list(range(len(perm) - 2)) or node.outputs[0] in outputs:
            continue
        readers = consumers.get(node.outputs[0], [])
        if readers and all(r.op == "MatMul" and not any(i in graph.constants for i in r.inputs) for r in readers):
            node.attrs[TRANSPOSE_VIEW] = True
    return graph
