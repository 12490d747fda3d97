"""Sibling dense layers: matmuls that read the same activations with their own constant weights
(attention's query, key and value projections) become one matmul over the weights side by side,
whose result a Split hands out as views. One kernel call instead of several narrow ones, and a
wider GEMM that keeps both cores busy where a narrow one cannot.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..graph import Graph, Node, ValueInfo, toposort, unique_name

DENSE = frozenset({"MatMul", "FusedMatMul"})


def constant_dense_weights(graph: Graph, node: Node) -> np.ndarray | None:
    """The constant (K, N) float32 weights of a dense layer that may merge: no residual, no other
    attribute than its activation, a constant 1-D bias if any."""
    if node.op not in DENSE or len(node.inputs) > 3 or set(node.attrs) - {"activation"} or not node.inputs[0]:
        return None
    w = graph.constants.get(node.inputs[1])
    if w is None or w.ndim != 2 or w.dtype != np.float32:
        return None
    if len(node.inputs) == 3 and node.inputs[2]:
        b = graph.constants.get(node.inputs[2])
        if b is None or b.shape != (w.shape[1],) or b.dtype != np.float32:
            return None
    return w


def _bias(graph: Graph, node: Node, n: int) -> np.ndarray:
    name = node.inputs[2] if len(node.inputs) == 3 else ""
    return graph.constants[name] if name else np.zeros(n, np.float32)


def merge_sibling_matmuls(graph: Graph) -> Graph:
    groups: dict[tuple[str, int, Any], list[Node]] = {}
    for node in graph.nodes:
        w = constant_dense_weights(graph, node)
        if w is not None:
            groups.setdefault((node.inputs[0], w.shape[0], repr(node.attrs.get("activation"))), []).append(node)
    siblings = [g for g in groups.values() if len(g) > 1]
    if not siblings:
        return graph
    taken = graph.value_names()
    for group in siblings:
        first = group[0]
        ws = [graph.constants[n.inputs[1]] for n in group]
        widths = [w.shape[1] for w in ws]
        w_name = unique_name(f"{first.name}__siblings_w", taken)
        graph.constants[w_name] = np.ascontiguousarray(np.concatenate(ws, axis=1))
        inputs = [first.inputs[0], w_name]
        if any(len(n.inputs) == 3 and n.inputs[2] for n in group):
            b_name = unique_name(f"{first.name}__siblings_b", taken)
            graph.constants[b_name] = np.concatenate([_bias(graph, n, k) for n, k in zip(group, widths)])
            inputs.append(b_name)
        sizes = unique_name(f"{first.name}__siblings_sizes", taken)
        graph.constants[sizes] = np.array(widths, np.int64)
        wide = unique_name(f"{first.name}__siblings", taken)
        graph.values[wide] = ValueInfo(wide)
        at = graph.nodes.index(first)
        for n in group:
            graph.nodes.remove(n)
        graph.nodes[at:at] = [
            Node("FusedMatMul", unique_name(f"{first.name}__merged", taken), inputs, [wide], dict(first.attrs)),
            Node("Split", unique_name(f"{first.name}__split", taken), [wide, sizes], [n.outputs[0] for n in group], {"axis": -1}),
        ]
    return toposort(graph)
