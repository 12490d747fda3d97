"""ONNX -> Graph. The only module that knows the ONNX protobuf; passes see plain Python."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import InputError, RuntimeModelError
from .graph import Graph, Node, ValueInfo
from .package import MODEL_ONNX, Manifest


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


def from_proto(model: onnx.ModelProto) -> Graph:
    g = model.graph
    constants = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    nodes: list[Node] = []
    for i, n in enumerate(g.node):
        if n.domain not in ("", "ai.onnx"):
            raise RuntimeModelError(
                f"node {n.name or i} ({n.domain}:{n.op_type}): custom op domains are not supported; "
                "expected standard ONNX (ai.onnx) ops"
            )
        nodes.append(
            Node(
                op=n.op_type,
                name=n.name or f"{n.op_type}_{i}",
                inputs=list(n.input),
                outputs=list(n.output),
                attrs={a.name: _attr_value(a) for a in n.attribute},
            )
        )
    inputs = [_value_info(v) for v in g.input if v.name not in constants]
    outputs = [_value_info(v) for v in g.output]
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    return Graph(nodes=nodes, inputs=inputs, outputs=outputs, constants=constants, opset=opset)


def load_onnx(path: str | os.PathLike[str]) -> Graph:
    try:
        model = onnx.load(os.fspath(path))
    except Exception as e:  # protobuf raises DecodeError and friends
        raise RuntimeModelError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from e
    return from_proto(model)


def load_package_graph(package_dir: str | os.PathLike[str], manifest: Manifest) -> Graph:
    """The package's model.onnx as a Graph, refused if the manifest names inputs it does not have."""
    graph = load_onnx(Path(package_dir) / MODEL_ONNX)
    names = {v.name for v in graph.inputs}
    missing = [t.name for t in manifest.inputs if t.name not in names]
    if missing:
        raise InputError(f"{package_dir}: manifest inputs {missing} are not inputs of model.onnx ({sorted(names)})")
    return graph
