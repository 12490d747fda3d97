"""Constant folding: evaluate, once at load, every node whose inputs are all known.

Shape-of-static-tensor subgraphs (Shape -> Gather -> Concat -> Reshape) that converters emit
collapse to constants here, so the runtime never recomputes them per request.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph
from ..kernels.registry import lookup
from .shape_inference import infer_shapes, spec_for

# Folding these would bake per-run values into the program; never fold them.
NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial"}
MAX_FOLDED_ELEMENTS = 1 << 24


def _static_shape(graph: Graph, name: str) -> tuple[int, ...] | None:
    v = graph.values.get(name)
    if v is None or v.shape is None or any(d < 0 for d in v.shape):
        return None
    return v.shape


def fold_constants(graph: Graph) -> Graph:
    kept = []
    for node in graph.nodes:
        if node.op in NONDETERMINISTIC or node.subgraphs():  # control flow runs only with compiled sub-graphs
            kept.append(node)
            continue
        if node.op == "Shape":
            shape = _static_shape(graph, node.inputs[0])
            if shape is not None:
                start, end = node.attrs.get("start", 0), node.attrs.get("end")
                graph.constants[node.outputs[0]] = np.array(shape[start:end], dtype=np.int64)
                continue
        inputs = [i for i in node.inputs if i]
        if all(i in graph.constants for i in inputs):
            run = lookup(node.op, node=node.name).factory(spec_for(graph, node))
            outs = run(*[graph.constants[i] if i else None for i in node.inputs])
            if sum(np.size(o) for o in outs) <= MAX_FOLDED_ELEMENTS:
                for name, value in zip(node.outputs, outs):
                    if name:
                        graph.constants[name] = np.array(value)  # own the memory; views of weights may not alias
                continue
        kept.append(node)
    graph.nodes = kept
    return graph


def fold_to_fixpoint(graph: Graph) -> Graph:
    """Fold and infer shapes until nothing more folds: a folded shape makes the next shapes
    static, which can fold in turn."""
    while True:
        before = len(graph.nodes)
        infer_shapes(graph)
        fold_constants(graph)
        if len(graph.nodes) == before:
            return infer_shapes(graph)
