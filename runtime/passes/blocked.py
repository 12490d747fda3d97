"""Regions of oneDNN kernels that pass activations in the blocked layout (kernels/onednn.py).

oneDNN's direct and depthwise convolution kernels are written for channels in blocks of the vector
width (16 on AVX-512, 8 on AVX2: onednn.BLOCK); on NHWC tensors it runs others (on AVX2, slower
ones), and a kernel given one layout in and the other out falls back to its reference code. So the
layout is chosen per region, not per node: connected convolutions and pools that all take it
(kernels/nhwc.py `takes_blocked`) pass blocked tensors among themselves, a ToBlocked reorders each
tensor entering the region and a FromBlocked each one leaving it for a kernel that reads NHWC; a
global pool reads the blocks and leaves for free, and a convolution with fewer input channels than a
block (the stem, on an image's three) writes the blocks the region reads instead of a ToBlocked
reordering its result. Whether the tensors are really blocked is the batch's call at run time
(ToBlocked passes small batches through), so the rewritten graph serves every batch size. A region
pays for its reorders only where it has convolutions enough to win them back.
"""
from __future__ import annotations

from ..graph import Graph, Node, ValueInfo, toposort, unique_name
from ..kernels import onednn
from ..kernels.registry import BLOCKED_OPERAND, BLOCKED_RESULT
from ..kernels.nhwc import BLOCKED_OPS, BLOCKED_SINKS, blocked_operand, takes_blocked, writes_blocked
from .shape_inference import spec_for

CONVS_PER_REORDER = 4  # a region's convolutions per reorder beyond its first one


def _data_inputs(node: Node) -> list[int]:
    """Operand positions that carry activations: the input, a convolution's residual, the scaled
    operand of a Mul by per-channel scales."""
    if node.op == "Mul":
        return [node.attrs[BLOCKED_OPERAND]]
    return [i for i in (0, 3) if i < len(node.inputs) and node.inputs[i] and (i == 0 or node.op == "FusedConvNHWC")]


def _regions(graph: Graph) -> tuple[list[list[Node]], set[str]]:
    """Connected members (blocked in and out), and the names of the global pools that may read them.
    A Mul that may join is marked with its activations' position (unmarked again if its region stays NHWC)."""
    members: list[Node] = []
    sinks: set[str] = set()
    for n in graph.nodes:
        if n.op == "Mul":
            pos = blocked_operand(spec_for(graph, n))
            if pos is not None:
                n.attrs[BLOCKED_OPERAND] = pos
                members.append(n)
        elif (n.op in BLOCKED_OPS or n.op in BLOCKED_SINKS) and takes_blocked(spec_for(graph, n)):
            if n.op in BLOCKED_SINKS:
                sinks.add(n.name)
            else:
                members.append(n)
    root = {n.name: n.name for n in members}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    producer = {o: n for n in members for o in n.outputs}
    for n in members:
        for i in _data_inputs(n):
            p = producer.get(n.inputs[i])
            if p is not None:
                root[find(n.name)] = find(p.name)
    groups: dict[str, list[Node]] = {}
    for n in members:
        groups.setdefault(find(n.name), []).append(n)
    return list(groups.values()), sinks


def _writes_blocked_for(graph: Graph, producer: Node | None, v: str, readers: set[str], consumers: dict[str, list[Node]],
                        outputs: set[str]) -> bool:
    """Whether `producer`, a convolution outside the region (fewer input channels than a block),
    can write v blocked instead of a ToBlocked reordering it: v read by the region (and
    its global pools) alone. Marks the producer so."""
    if producer is None or v in outputs or any(c.name not in readers for c in consumers.get(v, [])):
        return False
    if not writes_blocked(spec_for(graph, producer)):
        return False
    producer.attrs[BLOCKED_RESULT] = True
    return True


def _describe_like(graph: Graph, new: str, old: str) -> None:
    """The blocked twin of a value has its logical (NHWC) dtype and shape."""
    info = graph.values.get(old)
    graph.values[new] = ValueInfo(new, info.dtype, info.shape) if info is not None else ValueInfo(new)


def to_blocked(graph: Graph) -> Graph:
    if not onednn.AVAILABLE or onednn.BLOCKED_MIN_BATCH >= onednn.NEVER:  # no batch would take the layout
        return graph
    regions, sinks = _regions(graph)
    if not regions:
        return graph
    consumers = graph.consumers()
    outputs = graph.output_names()
    taken = graph.value_names()
    for region in regions:
        inside = {n.name for n in region}
        made = {o for n in region for o in n.outputs}
        entries = sorted({n.inputs[i] for n in region for i in _data_inputs(n)} - made)
        exits = sorted(v for v in made if v in outputs or any(
            c.name not in inside and not (c.name in sinks and c.inputs[0] == v) for c in consumers.get(v, [])))
        convs = sum(n.op == "FusedConvNHWC" for n in region)
        if convs < 2 or len(entries) + len(exits) > 1 + convs // CONVS_PER_REORDER:
            for n in region:
                n.attrs.pop(BLOCKED_OPERAND, None)
            continue
        producers = graph.producers()
        for v in entries:
            if _writes_blocked_for(graph, producers.get(v), v, inside | sinks, consumers, outputs):
                continue  # its producer writes the blocks itself: the region reads v as it is
            b = unique_name(f"{v}__blocked", taken)
            graph.nodes.append(Node("ToBlocked", b, [v], [b]))
            _describe_like(graph, b, v)
            for n in region:
                for i in _data_inputs(n):
                    if n.inputs[i] == v:
                        n.inputs[i] = b
        for v in exits:  # the region writes v's blocks under a new name; v itself becomes their NHWC copy
            b = unique_name(f"{v}__blocked", taken)
            for n in region:
                n.outputs = [b if o == v else o for o in n.outputs]
                n.inputs = [b if (i == v and k in _data_inputs(n)) else i for k, i in enumerate(n.inputs)]
            for c in consumers.get(v, []):
                if c.name in sinks and c.inputs[0] == v:
                    c.inputs[0] = b
            graph.nodes.append(Node("FromBlocked", unique_name(f"{v}__nhwc", taken), [b], [v]))
            _describe_like(graph, b, v)
    return toposort(graph)
