"""Dead-node elimination: drop nodes no graph output depends on."""
from __future__ import annotations

from ..graph import Graph


def eliminate_dead_nodes(graph: Graph) -> Graph:
    live = graph.output_names()
    kept = []
    for node in reversed(graph.nodes):
        if any(o in live for o in node.outputs if o):
            kept.append(node)
            live.update(i for i in node.inputs if i)
    graph.nodes = kept[::-1]
    graph.constants = {k: v for k, v in graph.constants.items() if k in live}
    return graph
