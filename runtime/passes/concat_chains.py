"""Chains of channel concatenations grow one buffer instead of copying every prefix again.

A DenseNet block concatenates each layer's few new channels to everything before them: layer k's
Concat copies all the channels the block has so far, so a block of L layers copies its early
channels L times. Here the chain's first Concat allocates the channels of the chain's last one
(`reserve`) and hands on a view of the part written so far; each later Concat (`grow`) finds its
first operand to be such a view and writes only its new channels after it. Every value in the
chain but the last is then a view with rows longer than its channels, so the chain is taken only
where those values are read by the next Concat and by kernels that read such views as they are
(STRIDED_READERS); the last one is the whole buffer, contiguous, for any reader.
"""
from __future__ import annotations

from ..graph import Graph, Node
from ..kernels.tensor import CONCAT_GROW as GROW, CONCAT_RESERVE as RESERVE

OP = "Concat"
STRIDED_READERS = {"MulAdd"}  # kernels/elementwise.py reads a row view of the channels without a copy


def _channels(graph: Graph, node: Node) -> tuple[int, list[int]] | None:
    """(output channels, each operand's channels) of a float32 Concat along the last axis of
    operands whose channel counts are known; None for any other node."""
    if node.op != OP or len(node.inputs) < 2 or len(node.outputs) != 1:
        return None
    infos = [graph.values.get(i) for i in node.inputs]
    shapes = [v.shape for v in infos if v is not None and v.shape is not None and str(v.dtype) == "float32"]
    if len(shapes) != len(infos) or len({len(s) for s in shapes}) != 1 or len(shapes[0]) < 2:
        return None
    rank = len(shapes[0])
    axis = node.attrs.get("axis")
    if axis is None or int(axis) % rank != rank - 1 or any(s[-1] <= 0 for s in shapes):
        return None
    widths = [int(s[-1]) for s in shapes]
    return sum(widths), widths


def grow_concat_chains(graph: Graph) -> Graph:
    users = graph.consumers()
    outputs = graph.output_names()
    producers = graph.producers()

    def next_link(node: Node) -> Node | None:
        """The Concat that continues the chain after `node`: the one reader of its output taking it
        first, every other reader a strided one."""
        out = node.outputs[0]
        readers = users.get(out, [])
        links = [u for u in readers if u.op == OP]
        if out in outputs or len(links) != 1 or any(u.op not in STRIDED_READERS for u in readers if u is not links[0]):
            return None
        link = links[0]
        if link.inputs[0] != out or link.inputs.count(out) != 1 or _channels(graph, link) is None:
            return None
        return link

    for node in graph.nodes:
        if _channels(graph, node) is None:
            continue
        first = producers.get(node.inputs[0])
        if first is not None and _channels(graph, first) is not None and next_link(first) is node:
            continue  # not a chain's head: its head marks it
        chain = [node]
        while (link := next_link(chain[-1])) is not None:
            chain.append(link)
        if len(chain) < 2:
            continue
        last = _channels(graph, chain[-1])
        assert last is not None  # next_link took only such Concats
        reserve = last[0]
        for i, c in enumerate(chain):
            c.attrs = {**c.attrs, RESERVE: reserve, **({GROW: 1} if i else {})}
    return graph

