"""Float16 export of an ONNX model, for strongly typed TensorRT (11+), where reduced precision
is not a builder flag but the tensor types of the network itself.

Float32 initializers, Constant tensors and float Casts become float16; the model keeps float32
inputs and outputs, with Casts at the boundary, so callers and golden data are unchanged. Ops
named in `keep_fp32` compute in float32 between Casts (for numerically touchy ops).
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph import unique_name

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16


def _half_tensor(t: onnx.TensorProto) -> onnx.TensorProto:
    if t.data_type != FLOAT:
        return t
    arr = numpy_helper.to_array(t)
    if np.any(np.abs(arr[np.isfinite(arr)]) > 65504):
        raise ValueError(f"tensor {t.name!r}: values beyond float16's range (65504); keep this model in fp32")
    return numpy_helper.from_array(arr.astype(np.float16), t.name)


def to_float16(model: onnx.ModelProto, keep_fp32: Iterable[str] = ()) -> onnx.ModelProto:
    """A float16 copy of `model` with float32 I/O. Raises ValueError if a weight overflows fp16."""
    keep = set(keep_fp32)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    names = {x for n in g.node for x in list(n.input) + list(n.output)} | {v.name for v in g.input} | {t.name for t in g.initializer}
    for i, t in enumerate(list(g.initializer)):
        g.initializer[i].CopyFrom(_half_tensor(t))
    float_inputs = {v.name for v in g.input if v.type.tensor_type.elem_type == FLOAT}
    float_outputs = {v.name for v in g.output if v.type.tensor_type.elem_type == FLOAT}
    # float types of the original model's values, to know what a kept-fp32 op consumes/produces
    inferred = onnx.shape_inference.infer_shapes(model).graph
    is_float = {vi.name for vi in list(inferred.value_info) + list(inferred.input) + list(inferred.output)
                if vi.type.tensor_type.elem_type == FLOAT} | {t.name for t in model.graph.initializer if t.data_type == FLOAT}

    new_nodes: list[onnx.NodeProto] = []
    # boundary: float32 graph inputs -> float16 copies that the graph reads instead
    renamed = {x: unique_name(f"{x}__fp16", names) for x in float_inputs}
    for x, h in renamed.items():
        new_nodes.append(helper.make_node("Cast", [x], [h], to=HALF, name=f"{h}_cast"))
    out_renamed = {x: unique_name(f"{x}__fp16", names) for x in float_outputs}

    for n in g.node:
        node = onnx.NodeProto()
        node.CopyFrom(n)
        for i, x in enumerate(node.input):
            if x in renamed:
                node.input[i] = renamed[x]
        for i, x in enumerate(node.output):
            if x in out_renamed:
                node.output[i] = out_renamed[x]
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR:
                a.t.CopyFrom(_half_tensor(a.t))
            elif node.op_type == "Cast" and a.name == "to" and a.i == FLOAT:
                a.i = HALF
        if node.op_type in keep:
            pre, post = [], []
            for i, x in enumerate(node.input):
                if x and n.input[i] in is_float:
                    y = unique_name(f"{x}__fp32", names)
                    pre.append(helper.make_node("Cast", [x], [y], to=FLOAT, name=f"{y}_cast"))
                    node.input[i] = y
            for i, x in enumerate(node.output):
                if x and n.output[i] in is_float:
                    y = unique_name(f"{x}__fp32", names)
                    post.append(helper.make_node("Cast", [y], [x], to=HALF, name=f"{y}_cast"))
                    node.output[i] = y
            new_nodes.extend(pre + [node] + post)
        else:
            new_nodes.append(node)
    for x, h in out_renamed.items():
        new_nodes.append(helper.make_node("Cast", [h], [x], to=FLOAT, name=f"{h}_cast"))
    del g.node[:]
    g.node.extend(new_nodes)
    del g.value_info[:]  # stale float32 annotations; re-inferred by consumers
    onnx.checker.check_model(m)
    return m
