"""Chains of elementwise Mul/Add/Sub/Div by constants become one MulAdd node: y = x * scale + shift.

A model's input scaling (Keras' Rescaling and Normalization layers: multiply, subtract the mean,
divide by the deviation) is such a chain, each step a full pass over the input image. Composed,
it is one pass, and so is a ReLU that alone reads the chain's result (a batch normalization before
its activation, as DenseNet's layers begin). The constants must be scalars or vectors over the last axis (NHWC channels), so
the pass runs after the layout pass; every value inside the chain must be read by the next node
alone. The constants are composed in float64 and rounded once.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph, Node, unique_name
from .fusion import ConsumerIndex

OP = "MulAdd"
_AFFINE = ("Mul", "Add", "Sub", "Div")


def _step(graph: Graph, node: Node, x: str, shape: tuple[int, ...]) -> tuple[str, np.ndarray] | None:
    """(op, constant as a float64 vector over the last axis) of a node that maps x, of `shape`,
    affinely and keeps its shape; None otherwise."""
    if node.op not in _AFFINE or len(node.inputs) != 2 or len(node.outputs) != 1:
        return None
    first = node.inputs[0] == x
    c = graph.constants.get(node.inputs[1 if first else 0])
    if c is None or c.dtype != np.float32 or node.inputs[0] == node.inputs[1] or c.ndim > len(shape):
        return None
    width = shape[-1]
    if c.size != 1 and (c.shape[-1] != width or c.size != width):
        return None
    if node.op == "Div" and not np.all(c):  # x / 0 keeps its infinities and NaNs only unfolded
        return None
    vec = np.broadcast_to(c.astype(np.float64).reshape(-1), (width,))
    if first:
        return node.op, vec
    return {"Mul": ("Mul", vec), "Add": ("Add", vec), "Sub": ("RSub", vec)}.get(node.op)  # c / x is not affine


def _compose(steps: list[tuple[str, np.ndarray]], width: int) -> tuple[np.ndarray, np.ndarray]:
    scale, shift = np.ones(width), np.zeros(width)
    for op, c in steps:
        if op == "Mul":
            scale, shift = scale * c, shift * c
        elif op == "Div":
            scale, shift = scale / c, shift / c
        elif op == "Add":
            shift = shift + c
        elif op == "Sub":
            shift = shift - c
        else:  # c - x
            scale, shift = -scale, c - shift
    return scale.astype(np.float32), shift.astype(np.float32)


def fold_affine_chains(graph: Graph) -> Graph:
    idx = ConsumerIndex(graph)
    taken = graph.value_names()
    folded: set[int] = set()  # ids of nodes a MulAdd replaced (Node compares by value: no list lookups)
    for head in list(graph.nodes):
        if head.op not in _AFFINE or id(head) in folded:
            continue
        x = next((i for i in head.inputs if i not in graph.constants), "")
        info = graph.values.get(x)
        if info is None or info.dtype != np.float32 or not info.shape or not isinstance(info.shape[-1], int) or info.shape[-1] <= 0:
            continue
        shape, width = info.shape, info.shape[-1]
        chain: list[Node] = []
        steps: list[tuple[str, np.ndarray]] = []
        value = x
        node: Node | None = head
        while node is not None and (step := _step(graph, node, value, shape)) is not None:
            chain.append(node)
            steps.append(step)
            value = node.outputs[0]
            node = idx.sole_user(value)  # none past a graph output or a value read twice
        if len(chain) < 2:
            continue
        attrs = {}
        if node is not None and node.op == "Relu" and len(node.outputs) == 1:  # pre-activation batch norm + ReLU (DenseNet)
            chain.append(node)
            value, attrs = node.outputs[0], {"relu": 1}
        scale, shift = _compose(steps, width)
        names = [unique_name(f"{head.name}.scale", taken), unique_name(f"{head.name}.shift", taken)]
        graph.constants[names[0]], graph.constants[names[1]] = scale, shift
        fused = Node(OP, f"{head.name}.muladd", [x, *names], [value], attrs)
        gone = {id(n) for n in chain}
        folded |= gone
        graph.nodes[:] = [fused if n is head else n for n in graph.nodes if n is head or id(n) not in gone]
        idx = ConsumerIndex(graph)
    return graph
