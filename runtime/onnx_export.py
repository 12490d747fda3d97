"""Graph -> ONNX. The inverse of onnx_import: a whole graph, or a segment of it, as a standalone
ONNX model (TensorRT's parser, onnxruntime and segment graphs read it)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph import CAPTURES, Graph, Node, unique_name


def _attribute(key: str, value: Any) -> onnx.AttributeProto | None:
    if isinstance(value, np.ndarray):
        return helper.make_attribute(key, numpy_helper.from_array(value))
    if isinstance(value, (list, tuple)) and not value:
        return None  # empty lists carry no information and have no inferable ONNX type
    return helper.make_attribute(key, value)


def _node_proto(n: Node) -> onnx.NodeProto:
    if "activation" in n.attrs or n.op.startswith("Fused"):
        raise ValueError(f"node {n.name} ({n.op}) is a fused runtime node: partition the graph before optimizing it")
    own = len(n.inputs) - n.captures
    outer = n.inputs[own:]
    attrs = []
    for key, value in n.attrs.items():
        if key == CAPTURES:
            continue
        if isinstance(value, Graph):
            attrs.append(helper.make_attribute(key, _subgraph_proto(value, outer, f"{n.name}_{key}")))
        elif (a := _attribute(key, value)) is not None:
            attrs.append(a)
    proto = helper.make_node(n.op, n.inputs[:own], n.outputs, name=n.name, domain=n.domain or None)
    proto.attribute.extend(attrs)
    return proto


def _subgraph_proto(sub: Graph, outer: Sequence[str], name: str) -> onnx.GraphProto:
    """A sub-graph as ONNX wants it: its capture inputs dropped and read by their outer names."""
    own = sub.inputs[:len(sub.inputs) - len(outer)]
    formals = [f.name for f in sub.inputs[len(own):]]
    rename = {f: o for f, o in zip(formals, outer) if f != o}
    defined = {v.name for v in own} | set(sub.constants) | {o for n in sub.nodes for o in n.outputs if o}
    taken = defined | set(formals) | set(outer)

    for inner in sorted(defined & set(rename.values())):  # an inner value shadowing an outer name
        rename[inner] = unique_name(inner, taken)

    def r(x: str) -> str:
        return rename.get(x, x)

    nodes = [_node_proto(replace(n, inputs=[r(x) for x in n.inputs], outputs=[r(x) for x in n.outputs]))
             for n in sub.nodes]
    outputs = []
    for v in sub.outputs:
        exported = r(v.name)
        if v.name in formals:  # onnxruntime refuses an outer value as a sub-graph output: copy it in
            exported = unique_name(f"{v.name}__out", taken)
            nodes.append(helper.make_node("Identity", [r(v.name)], [exported], name=f"{name}_{exported}"))
        outputs.append(_sub_value_info(sub, v.name, exported))
    used = {x for n in sub.nodes for x in n.inputs} | {o.name for o in sub.outputs}
    return helper.make_graph(
        nodes, name, [_sub_value_info(sub, v.name, r(v.name)) for v in own], outputs,
        initializer=[numpy_helper.from_array(np.asarray(c), r(k)) for k, c in sub.constants.items() if k in used],
    )


def _sub_value_info(sub: Graph, name: str, exported: str) -> onnx.ValueInfoProto:
    """Declared type of a sub-graph input or output, else the inferred one; dims as known."""
    declared = next((v for v in sub.inputs + sub.outputs if v.name == name), None)
    inferred = sub.values.get(name)
    dtype = declared.dtype if declared is not None and declared.dtype is not None else inferred.dtype if inferred else None
    shape = declared.shape if declared is not None and declared.shape is not None else inferred.shape if inferred else None
    if dtype is None:
        return helper.make_empty_tensor_value_info(exported)
    dims = None if shape is None else [d if d >= 0 else None for d in shape]
    return helper.make_tensor_value_info(exported, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims)


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
