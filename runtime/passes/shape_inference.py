"""Shape inference with the kernels' own shape functions (the same ones the eager API checks).

Shapes are symbolic only in the batch-like dims (-1); anything a shape function cannot know stays
None. Nothing downstream depends on shapes for correctness, only for optimization choices.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph, Node, ValueInfo
from ..kernels.registry import KernelSpec, lookup


def spec_for(graph: Graph, node: Node, inplace: frozenset[int] = frozenset()) -> KernelSpec:
    vals = graph.values
    consts = [graph.constants.get(i) if i else None for i in node.inputs]
    shapes = [(vals[i].shape if i in vals else None) if i else None for i in node.inputs]
    dtypes = [(vals[i].dtype if i in vals else None) if i else None for i in node.inputs]
    return KernelSpec(
        op=node.op,
        name=node.name,
        attrs=node.attrs,
        consts=consts,
        shapes=shapes,
        dtypes=dtypes,
        n_outputs=len(node.outputs),
        inplace=inplace,
        present=[bool(i) for i in node.inputs],
    )


def infer_shapes(graph: Graph) -> Graph:
    vals: dict[str, ValueInfo] = {}
    for v in graph.inputs:
        vals[v.name] = v
    for name, c in graph.constants.items():
        vals[name] = ValueInfo(name, c.dtype, tuple(c.shape))
    graph.values = vals
    for node in graph.nodes:
        for sub in node.subgraphs().values():
            _infer_subgraph(graph, node, sub)
        try:
            results = lookup(node.op, node=node.name).shape_fn(spec_for(graph, node))
        except Exception:
            results = [(None, None)] * len(node.outputs)
        for out, (shape, dtype) in zip(node.outputs, results):
            if out:
                vals[out] = ValueInfo(out, None if dtype is None else np.dtype(dtype), None if shape is None else tuple(int(d) for d in shape))
    return graph


def _infer_subgraph(graph: Graph, node: Node, sub: Graph) -> None:
    """A sub-graph's capture inputs are the outer values themselves: they take the outer types,
    then the sub-graph is inferred so the node's shape function can read its outputs."""
    k = node.captures
    if k:
        for formal, outer in zip(sub.inputs[len(sub.inputs) - k:], node.inputs[len(node.inputs) - k:]):
            info = graph.values.get(outer)
            if info is not None and info.dtype is not None:
                formal.dtype, formal.shape = info.dtype, info.shape
    infer_shapes(sub)
