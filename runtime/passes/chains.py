"""Dense chains: dense layers that each feed only the next (an MLP, a classifier head) become one
DenseChain node, whose kernel runs the whole chain in one call at the row counts where one call
per layer costs more than the layer (runtime/kernels/sgemm.py, PackedChain).
"""
from __future__ import annotations

from ..graph import Graph, Node, toposort, unique_name
from ..kernels.activations import scalar_form
from .siblings import constant_dense_weights

CHAIN = "DenseChain"


def _link(graph: Graph, node: Node) -> bool:
    """A layer that may join a chain: constant float32 weights, no residual, an activation the
    packed kernel applies."""
    return constant_dense_weights(graph, node) is not None and scalar_form(node.attrs.get("activation")) is not None


def chain_dense_layers(graph: Graph) -> Graph:
    users = graph.consumers()
    outputs = graph.output_names()

    def next_link(node: Node) -> Node | None:
        out = node.outputs[0]
        readers = users.get(out, [])
        if len(readers) != 1 or out in outputs or len(node.outputs) != 1:
            return None
        after = readers[0]
        return after if _link(graph, after) and after.inputs[0] == out else None

    followers = set()
    for node in graph.nodes:
        if _link(graph, node) and (after := next_link(node)) is not None:
            followers.add(id(after))
    taken = graph.value_names()
    for head in [n for n in graph.nodes if _link(graph, n) and id(n) not in followers]:
        chain = [head]
        while (after := next_link(chain[-1])) is not None:
            chain.append(after)
        if len(chain) < 2:
            continue
        inputs = [head.inputs[0]]
        for layer in chain:
            inputs += [layer.inputs[1], layer.inputs[2] if len(layer.inputs) > 2 else ""]
        attrs = {"activations": [layer.attrs.get("activation") for layer in chain], "layers": [layer.name for layer in chain]}
        at = graph.nodes.index(head)
        for layer in chain:
            graph.nodes.remove(layer)
        graph.nodes.insert(at, Node(CHAIN, unique_name(f"{head.name}__chain", taken), inputs, [chain[-1].outputs[0]], attrs))
    return toposort(graph)
