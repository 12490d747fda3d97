"""Strides move up the graph. A tensor that only unpadded 1x1 convolutions of stride s read is
needed at every s-th row and column alone, so what makes it can compute just those: a stride-1
convolution takes the stride itself, a 1x1 one hands the request on to its input, and a residual
it adds is subsampled to match (by the convolution that makes it, when that is its only reader, or
by a 1x1 max pool of stride s otherwise). The readers drop to stride 1.

ResNet v1 puts each stage's stride on the first block's 1x1 convolutions, so the last block of the
stage before computes four times the outputs anyone reads; after this pass it does not. Every value
that is still computed is computed by the same arithmetic as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..graph import Graph, Node, toposort, unique_name
from .fusion import explicit_pads
from .shape_inference import infer_shapes

RESIDUAL = 3  # FusedConv's operand slot of a fused residual add


def _kernel(graph: Graph, node: Node) -> tuple[int, ...] | None:
    """A float convolution's spatial kernel, where its padding is explicit (SAME padding would
    change with the stride)."""
    if node.op != "FusedConv" or node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    w = graph.constants.get(node.inputs[1])
    return None if w is None or w.ndim != 4 else tuple(int(d) for d in w.shape[2:])


def _strides(node: Node) -> tuple[int, ...]:
    return tuple(node.attrs.get("strides") or (1, 1))


def _unpadded(node: Node) -> bool:
    return not any(explicit_pads(node))


def subsampling_stride(graph: Graph, node: Node, value: str) -> int | None:
    """s where `node` is an unpadded 1x1 convolution of stride s (s > 1 in both dims) whose
    input is `value`: it reads exactly value[..., ::s, ::s]."""
    if _kernel(graph, node) != (1, 1) or node.inputs[0] != value or value in node.inputs[1:] or not _unpadded(node):
        return None
    sh, sw = _strides(node)
    return sh if sh == sw and sh > 1 else None


@dataclass
class Plan:
    """The rewrite one request turns into, applied only once the whole of it is known."""

    strided: list[Node] = field(default_factory=list)  # convolutions that take the stride
    pooled: list[tuple[Node, int]] = field(default_factory=list)  # (node, operand) read through a subsampling pool


class _Planner:
    def __init__(self, graph: Graph, producers: dict[str, Node], users: dict[str, list[Node]], outputs: set[str]) -> None:
        self.graph, self.producers, self.users, self.outputs = graph, producers, users, outputs

    def absorbs(self, node: Node, slot: int, plan: Plan) -> bool:
        """Whether the producer of node's operand `slot` can shrink instead: node is its only reader."""
        value = node.inputs[slot]
        producer = self.producers.get(value)
        return value not in self.outputs and len(self.users.get(value, [])) == 1 and producer is not None and self.shrink(producer, plan)

    def shrink(self, conv: Node, plan: Plan) -> bool:
        """Plans `conv` to compute only every stride-th row and column of its output; False
        where it cannot (not a stride-1 float convolution with explicit padding)."""
        kernel = _kernel(self.graph, conv)
        if kernel is None or any(s != 1 for s in _strides(conv)):
            return False
        if not (kernel == (1, 1) and _unpadded(conv) and self.absorbs(conv, 0, plan)):  # a 1x1 hands the request up
            plan.strided.append(conv)
        if len(conv.inputs) > RESIDUAL and conv.inputs[RESIDUAL] and not self.absorbs(conv, RESIDUAL, plan):
            plan.pooled.append((conv, RESIDUAL))
        return True


def _apply(graph: Graph, readers: list[Node], plan: Plan, stride: int) -> None:
    for node in readers:
        node.attrs = {**node.attrs, "strides": [1, 1]}
    for node in plan.strided:
        node.attrs = {**node.attrs, "strides": [stride, stride]}
    taken = graph.value_names()
    for node, slot in plan.pooled:
        value = node.inputs[slot]
        sub = unique_name(f"{value}:every_{stride}", taken)
        graph.nodes.insert(graph.nodes.index(node), Node("MaxPool", unique_name(f"{node.name}/subsample", taken), [value], [sub],
                                                         {"kernel_shape": [1, 1], "strides": [stride, stride]}))
        node.inputs = node.inputs[:slot] + [sub] + node.inputs[slot + 1:]


def hoist_strides(graph: Graph) -> Graph:
    """Moves each subsampling stride to the convolutions that make what it subsamples, until none moves."""
    moved = False
    for _ in range(len(graph.nodes)):  # each move takes a stride at least one node up
        users, outputs, producers = graph.consumers(), graph.output_names(), graph.producers()
        for value, readers in users.items():
            strides = {subsampling_stride(graph, r, value) for r in readers}
            producer = producers.get(value)
            if len(strides) != 1 or None in strides or value in outputs or producer is None:
                continue
            stride = strides.pop()
            assert stride is not None
            plan = Plan()
            if _Planner(graph, producers, users, outputs).shrink(producer, plan):
                _apply(graph, readers, plan, stride)
                moved = True
                break
        else:
            break
    if moved:
        infer_shapes(toposort(graph))
    return graph
