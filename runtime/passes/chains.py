"""Dense chains: dense layers that each feed only the next (an MLP, a classifier head), and the
Softmax that may end them, become one DenseChain node, whose kernel runs the whole chain in one
call at the row counts where a call per layer costs more than the layer (runtime/kernels/sgemm.py,
PackedChain).
"""
from __future__ import annotations

from typing import Any

from ..graph import Graph, Node, toposort, unique_name
from ..kernels.activations import scalar_form
from ..kernels.registry import SOFTMAX_SCALE
from .fusion import ConsumerIndex
from .siblings import constant_dense_weights

CHAIN = "DenseChain"


def _link(graph: Graph, node: Node) -> bool:
    """A layer that may join a chain: constant float32 weights, no residual, an activation the
    packed kernel applies."""
    return constant_dense_weights(graph, node) is not None and scalar_form(node.attrs.get("activation")) is not None


def over_last_axis(graph: Graph, node: Node) -> bool:
    """A (Log)Softmax over its input's last axis."""
    axis = node.attrs.get("axis", -1)
    info = graph.values.get(node.inputs[0])
    return axis == -1 or (info is not None and info.shape is not None and axis == len(info.shape) - 1)


def chain_dense_layers(graph: Graph) -> Graph:
    index = ConsumerIndex(graph)

    def sole_reader(node: Node) -> Node | None:
        """The one node that reads `node`'s only output, as its first operand."""
        reader = index.sole_user(node.outputs[0]) if len(node.outputs) == 1 else None
        return reader if reader is not None and reader.inputs[0] == node.outputs[0] else None

    def next_link(node: Node) -> Node | None:
        after = sole_reader(node)
        return after if after is not None and _link(graph, after) else None

    followers = set()
    for node in graph.nodes:
        if _link(graph, node) and (after := next_link(node)) is not None:
            followers.add(id(after))
    taken = graph.value_names()
    for head in [n for n in graph.nodes if _link(graph, n) and id(n) not in followers]:
        chain = [head]
        while (after := next_link(chain[-1])) is not None:
            chain.append(after)
        end = sole_reader(chain[-1])
        softmax: dict[str, Any] | None = None
        if end is not None and end.op in ("Softmax", "LogSoftmax") and over_last_axis(graph, end):
            softmax = {"log": end.op == "LogSoftmax", "scale": float(end.attrs.get(SOFTMAX_SCALE, 1.0))}
        if len(chain) < 2 and softmax is None:
            continue
        inputs = [head.inputs[0]]
        for layer in chain:
            inputs += [layer.inputs[1], layer.inputs[2] if len(layer.inputs) > 2 else ""]
        attrs = {"activations": [layer.attrs.get("activation") for layer in chain], "layers": [layer.name for layer in chain],
                 "softmax": softmax}
        absorbed = chain + ([end] if end is not None and softmax is not None else [])
        at = graph.nodes.index(head)
        for n in absorbed:
            graph.nodes.remove(n)
        graph.nodes.insert(at, Node(CHAIN, unique_name(f"{head.name}__chain", taken), inputs, list(absorbed[-1].outputs), attrs))
    return toposort(graph)
