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
from onnx import TensorProto, helper, numpy_helper

from .graph import Graph, Node

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


# ---------------------------------------------------------------------------- ONNX export

def _attribute(key: str, value: Any) -> onnx.AttributeProto | None:
    if isinstance(value, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(value))
    if isinstance(value, (list, tuple)) and not value:
        return None  # empty lists carry no information and have no inferable ONNX type
    return helper.make_attribute(key, value)


def _node_proto(n: Node) -> onnx.NodeProto:
    if "activation" in n.attrs or n.op.startswith("Fused"):
        raise ValueError(f"node {n.name} ({n.op}) is a fused runtime node: partition the graph before optimizing it")
    attrs = [a for a in (_attribute(k, v) for k, v in n.attrs.items()) if a is not None]
    proto = helper.make_node(n.op, n.inputs, n.outputs, name=n.name, domain=n.domain or None)
    proto.attribute.extend(attrs)
    return proto


def _value_info(name: str, dtype: np.dtype | None, shape: tuple[int, ...] | None, batch_dim: bool = True) -> onnx.ValueInfoProto:
    if dtype is None:
        raise ValueError(f"value {name!r}: element type unknown; cannot export it as a segment boundary")
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    if shape is None:
        return helper.make_tensor_value_info(name, elem, None)
    dims: list[Any] = [("N" if i == 0 and batch_dim else f"{name}_d{i}") if d < 0 else d for i, d in enumerate(shape)]
    return helper.make_tensor_value_info(name, elem, dims)


def graph_to_onnx(graph: Graph, nodes: Sequence[Node] | None = None, inputs: Sequence[str] | None = None,
                  outputs: Sequence[str] | None = None, name: str = "kubetrt") -> onnx.ModelProto:
    """The whole graph, or a segment of it, as a standalone ONNX model with only the constants it reads."""
    from .passes.shape_inference import infer_shapes

    nodes = list(graph.nodes if nodes is None else nodes)
    inputs = [v.name for v in graph.inputs] if inputs is None else list(inputs)
    outputs = [v.name for v in graph.outputs] if outputs is None else list(outputs)
    types = _types(graph)
    if any(t is None for t in (types.get(x) for x in inputs + outputs)):
        infer_shapes(graph)
        for k, v in graph.values.items():
            types.setdefault(k, (v.dtype, v.shape))
    used = {x for n in nodes for x in n.inputs if x}
    inits = [numpy_helper.from_array(np.asarray(c), k) for k, c in graph.constants.items() if k in used]
    g = helper.make_graph(
        [_node_proto(n) for n in nodes], name,
        [_value_info(x, *types.get(x, (None, None))) for x in inputs],
        [_value_info(x, *types.get(x, (None, None))) for x in outputs],
        initializer=inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", graph.opset)], producer_name="kubetrt")
    model.ir_version = min(model.ir_version, 8 if graph.opset <= 17 else model.ir_version)
    return model


def _types(graph: Graph) -> dict[str, tuple[np.dtype | None, tuple[int, ...] | None]]:
    """Element types and shapes of every value, from ONNX's own shape inference on the whole graph."""
    types: dict[str, tuple[np.dtype | None, tuple[int, ...] | None]] = {}
    for v in graph.inputs + graph.outputs:
        types[v.name] = (v.dtype, v.shape)
    cached = getattr(graph, "_onnx_types", None)
    if cached is not None:
        types.update(cached)
        return types
    g = helper.make_graph(
        [_node_proto(n) for n in graph.nodes], "full",
        [_value_info(v.name, v.dtype, v.shape) for v in graph.inputs],
        [helper.make_tensor_value_info(v.name, TensorProto.UNDEFINED, None) for v in graph.outputs],
        initializer=[numpy_helper.from_array(np.asarray(c), k) for k, c in graph.constants.items()],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", graph.opset)])
    inferred = onnx.shape_inference.infer_shapes(model).graph
    found: dict[str, tuple[np.dtype | None, tuple[int, ...] | None]] = {}
    for vi in list(inferred.value_info) + list(inferred.output):
        t = vi.type.tensor_type
        if not t.elem_type:
            continue
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim) if t.HasField("shape") else None
        found[vi.name] = (np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)), shape)
    graph._onnx_types = found  # type: ignore[attr-defined]
    types.update({k: v for k, v in found.items() if k not in types or types[k][0] is None})
    return types


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
