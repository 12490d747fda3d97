"""Graph IR: the ONNX graph in plain Python objects, the input of every compiler pass."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Attribute key for how many trailing operands of a node with sub-graphs are outer-scope captures.
# ONNX attribute names are C identifiers, so the colon keeps it from ever meeting a real one.
CAPTURES = "kubetrt:captures"


@dataclass
class Node:
    op: str
    name: str
    inputs: list[str]  # "" marks an omitted optional input
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""

    def __repr__(self) -> str:
        return f"{self.op}({self.name})"

    def subgraphs(self) -> dict[str, "Graph"]:
        """GRAPH attributes (If's branches, Loop's and Scan's body) by attribute name."""
        return {k: v for k, v in self.attrs.items() if isinstance(v, Graph)}

    @property
    def captures(self) -> int:
        """Trailing operands that are outer values the sub-graphs read (each sub-graph takes
        them, in this order, as its last inputs)."""
        return int(self.attrs.get(CAPTURES, 0))


@dataclass
class ValueInfo:
    name: str
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None  # -1 for dynamic dims; None when unknown


@dataclass
class Graph:
    nodes: list[Node]
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    constants: dict[str, np.ndarray]
    values: dict[str, ValueInfo] = field(default_factory=dict)  # inferred shapes/dtypes
    opset: int = 17

    def producers(self) -> dict[str, Node]:
        return {o: n for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    users.setdefault(i, []).append(n)
        return users

    def output_names(self) -> set[str]:
        return {o.name for o in self.outputs}

    def value_names(self) -> set[str]:
        """Every name a constant or value holds: what a new value's name must avoid (unique_name)."""
        return set(self.constants) | set(self.values) | {o for n in self.nodes for o in n.outputs}


def toposort(graph: Graph) -> Graph:
    """Stable topological order. Fusion can move a read before its producer (a fused residual
    add takes the convolution's place, the shortcut branch may come later), so passes re-sort."""
    available = {v.name for v in graph.inputs} | set(graph.constants) | {""}
    pending = list(graph.nodes)
    ordered: list[Node] = []
    while pending:
        progressed = False
        rest = []
        for node in pending:
            if all(i in available for i in node.inputs):
                ordered.append(node)
                available.update(node.outputs)
                progressed = True
            else:
                rest.append(node)
        if not progressed:
            missing = sorted({i for n in rest for i in n.inputs if i not in available})
            raise ValueError(f"graph has a cycle or reads values nothing produces: {missing[:5]}")
        pending = rest
    graph.nodes = ordered
    return graph


def unique_name(base: str, taken: set[str]) -> str:
    """`base`, or `base__1`, `base__2`, ... whichever `taken` does not hold yet; recorded in `taken`."""
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}__{k}"
    taken.add(name)
    return name
