"""ONNX -> Graph. The only module that knows the ONNX protobuf; passes see plain Python."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import InputError, RuntimeModelError
from .graph import CAPTURES, Graph, Node, ValueInfo
from .package import Manifest, model_file


def _attr_value(a: onnx.AttributeProto) -> Any:
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return numpy_helper.to_array(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [x.decode() for x in v]
    return v


def _value_info(vi: onnx.ValueInfoProto) -> ValueInfo:
    t = vi.type.tensor_type
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)) if t.elem_type else None
    shape = None
    if t.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
    return ValueInfo(vi.name, dtype, shape)


def _nodes(protos: Sequence[onnx.NodeProto], opset: int) -> list[Node]:
    nodes: list[Node] = []
    for i, n in enumerate(protos):
        if n.domain not in ("", "ai.onnx"):
            raise RuntimeModelError(
                f"node {n.name or i} ({n.domain}:{n.op_type}): custom op domains are not supported; "
                "expected standard ONNX (ai.onnx) ops"
            )
        node = Node(op=n.op_type, name=n.name or f"{n.op_type}_{i}", inputs=list(n.input), outputs=list(n.output))
        if n.op_type == "Scan" and opset < 9:
            raise RuntimeModelError(f"node {node.name} (Scan): opset {opset} Scan (batch axis, sequence_lens) is not "
                                    "supported; supported: Scan from opset 9 on")
        subgraphs: dict[str, tuple[Graph, list[str]]] = {}
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                subgraphs[a.name] = _subgraph(a.g, opset)
            elif a.type == onnx.AttributeProto.GRAPHS:
                raise RuntimeModelError(f"node {node.name} ({n.op_type}): attribute {a.name} is a list of graphs; "
                                        "only single sub-graphs (If, Loop, Scan) are supported")
            else:
                node.attrs[a.name] = _attr_value(a)
        if subgraphs:
            _capture(node, subgraphs)
        nodes.append(node)
    return nodes


def _subgraph(g: onnx.GraphProto, opset: int) -> tuple[Graph, list[str]]:
    """A GRAPH attribute as a Graph, and the outer-scope names it reads (first-use order)."""
    constants = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    nodes = _nodes(g.node, opset)
    inputs = [_value_info(v) for v in g.input if v.name not in constants]
    outputs = [_value_info(v) for v in g.output]
    defined = {v.name for v in inputs} | set(constants) | {o for n in nodes for o in n.outputs if o}
    free: list[str] = []
    for x in [i for n in nodes for i in n.inputs] + [o.name for o in outputs]:
        if x and x not in defined and x not in free:
            free.append(x)
    return Graph(nodes=nodes, inputs=inputs, outputs=outputs, constants=constants, opset=opset), free


def _capture(node: Node, subgraphs: dict[str, tuple[Graph, list[str]]]) -> None:
    """Outer values the sub-graphs read become the node's trailing operands and every sub-graph's
    trailing inputs, so passes and executors see the dependency as an ordinary operand."""
    names: list[str] = []
    for _, free in subgraphs.values():
        names.extend(x for x in free if x not in names)
    for key, (sub, _) in subgraphs.items():
        sub.inputs.extend(ValueInfo(x) for x in names)
        node.attrs[key] = sub
    if names:
        node.inputs.extend(names)
        node.attrs[CAPTURES] = len(names)


def from_proto(model: onnx.ModelProto) -> Graph:
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    constants = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    nodes = _nodes(g.node, opset)
    inputs = [_value_info(v) for v in g.input if v.name not in constants]
    outputs = [_value_info(v) for v in g.output]
    return Graph(nodes=nodes, inputs=inputs, outputs=outputs, constants=constants, opset=opset)


def load_onnx(path: str | os.PathLike[str]) -> Graph:
    try:
        model = onnx.load(os.fspath(path))
    except Exception as e:  # protobuf raises DecodeError and friends
        raise RuntimeModelError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from e
    return from_proto(model)


def load_package_graph(package_dir: str | os.PathLike[str], manifest: Manifest, precision: str = "fp32") -> Graph:
    """The package's model for `precision` (model.onnx, or its Q/DQ twin for int8) as a Graph,
    refused if the manifest names inputs it does not have."""
    graph = load_onnx(Path(package_dir) / model_file(manifest, precision))
    names = {v.name for v in graph.inputs}
    missing = [t.name for t in manifest.inputs if t.name not in names]
    if missing:
        raise InputError(f"{package_dir}: manifest inputs {missing} are not inputs of model.onnx ({sorted(names)})")
    return graph
