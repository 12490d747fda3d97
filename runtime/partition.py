"""Partition a Graph into segments for a backend (TensorRT) and a fallback (host / cuda), like
TF-TRT's segmenter: each segment exports as a standalone ONNX model, and a runner chains them.

Segments are maximal runs of one kind in a topological order that, among ready nodes, keeps
extending the current kind before switching. Each segment depends only on earlier segments, so
running them in order is valid and contracting a segment can never introduce a cycle.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import onnx

from .graph import Graph, Node
from .onnx_export import graph_to_onnx

Support = Callable[[Node], bool]


@dataclass
class Segment:
    index: int
    supported: bool  # True: runs on the backend (e.g. TensorRT); False: fallback
    nodes: list[Node]
    inputs: list[str] = field(default_factory=list)  # non-constant values from outside, first-use order
    outputs: list[str] = field(default_factory=list)  # values later segments or the graph need

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "supported": self.supported, "nodes": self.node_names,
                "inputs": self.inputs, "outputs": self.outputs}


def _order(graph: Graph, supported: list[bool]) -> list[int]:
    """Topological order of node indices that clusters equal support classes."""
    producer = {o: i for i, n in enumerate(graph.nodes) for o in n.outputs if o}
    deps = [{producer[x] for x in n.inputs if x in producer} for n in graph.nodes]
    users: list[list[int]] = [[] for _ in graph.nodes]
    for i, d in enumerate(deps):
        for p in d:
            users[p].append(i)
    pending = [len(d) for d in deps]
    ready: dict[bool, list[int]] = {True: [], False: []}
    for i, waiting in enumerate(pending):
        if waiting == 0:
            heapq.heappush(ready[supported[i]], i)
    order: list[int] = []
    current: bool | None = None
    while ready[True] or ready[False]:
        if current is None or not ready[current]:  # switch to the class of the earliest ready node
            current = min((ready[c][0], c) for c in (True, False) if ready[c])[1]
        i = heapq.heappop(ready[current])
        order.append(i)
        for u in users[i]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready[supported[u]], u)
    if len(order) != len(graph.nodes):
        raise ValueError("graph has a cycle or a node reads a value no node produces before it")
    return order


def partition(graph: Graph, supported: Support, min_segment_size: int = 1) -> list[Segment]:
    """Split `graph` (as imported, before fusion) into supported and fallback segments.

    Supported runs shorter than `min_segment_size` fall back (an engine per two nodes costs more
    in boundary copies than it saves), as TF-TRT's minimum_segment_size does.
    """
    flags = [bool(supported(n)) for n in graph.nodes]
    order = _order(graph, flags)
    runs: list[tuple[bool, list[int]]] = []
    for i in order:
        if runs and runs[-1][0] == flags[i]:
            runs[-1][1].append(i)
        else:
            runs.append((flags[i], [i]))
    merged: list[tuple[bool, list[int]]] = []
    for ok, idx in runs:
        ok = ok and len(idx) >= min_segment_size
        if merged and merged[-1][0] == ok:
            merged[-1][1].extend(idx)
        else:
            merged.append((ok, list(idx)))
    segments = [Segment(k, ok, [graph.nodes[i] for i in idx]) for k, (ok, idx) in enumerate(merged)]
    _wire(graph, segments)
    return segments


def _wire(graph: Graph, segments: list[Segment]) -> None:
    """Fill in each segment's boundary inputs and outputs."""
    graph_outputs = [o.name for o in graph.outputs]
    needed_later: set[str] = set(graph_outputs)
    for seg in reversed(segments):
        produced = {o for n in seg.nodes for o in n.outputs if o}
        seg.outputs = [o for n in seg.nodes for o in n.outputs if o and o in needed_later]
        inputs: list[str] = []
        for n in seg.nodes:
            for x in n.inputs:
                if x and x not in produced and x not in graph.constants and x not in inputs:
                    inputs.append(x)
        seg.inputs = inputs
        needed_later |= set(inputs)


# ---------------------------------------------------------------------------- segments as models

def export_segment(graph: Graph, seg: Segment) -> onnx.ModelProto:
    return graph_to_onnx(graph, seg.nodes, seg.inputs, seg.outputs, name=f"segment{seg.index}")


def segment_graph(graph: Graph, seg: Segment) -> Graph:
    """A fallback segment as a Graph of its own, for the host or cuda runtime."""
    from .onnx_import import from_proto

    return from_proto(export_segment(graph, seg))


# ---------------------------------------------------------------------------- runner

class Executable(Protocol):
    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]: ...


class SegmentRunner:
    """Runs segments in order, handing boundary values from one to the next, freeing them after
    their last reader."""

    def __init__(self, graph: Graph, segments: list[Segment], executables: list[Executable]) -> None:
        if len(segments) != len(executables):
            raise ValueError(f"{len(segments)} segments but {len(executables)} executables")
        self.segments = segments
        self.executables = executables
        self.inputs = [v.name for v in graph.inputs]
        self.outputs = [v.name for v in graph.outputs]
        self.constants = {o: graph.constants[o] for o in self.outputs if o in graph.constants}
        keep = set(self.outputs)
        self.frees: list[list[str]] = []
        last: dict[str, int] = {}
        for seg in segments:
            for x in seg.inputs:
                last[x] = seg.index
        for seg in segments:
            self.frees.append([x for x in seg.inputs if last[x] == seg.index and x not in keep])

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        env: dict[str, Any] = dict(zip(self.inputs, feeds))
        env.update(self.constants)
        for seg, exe, frees in zip(self.segments, self.executables, self.frees):
            results = exe.run([env[x] for x in seg.inputs])
            env.update(zip(seg.outputs, results))
            for x in frees:
                env.pop(x, None)
        return [env[o] for o in self.outputs]
