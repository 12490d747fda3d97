"""Float16 ONNX export (for strongly typed TensorRT 11), run by onnxruntime on the CPU and compared
with TensorFlow's golden float32 outputs at fp16 tolerance."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import OrtExecutable, check_all_batches, load
from kubetrt.runtime.fp16 import to_float16
from kubetrt.runtime.partition import export_segment, partition
from onnx import TensorProto, helper, numpy_helper


@pytest.mark.parametrize("name", ["small_cnn", "mlp", "transformer", "two_in_two_out"])
def test_fp16_export_matches_golden(zoo, name: str) -> None:
    pkg = zoo.package(name)
    graph, golden = load(pkg)
    model = onnx.load(pkg / "model.onnx")
    half = to_float16(model)
    assert all(t.data_type != TensorProto.FLOAT for t in half.graph.initializer), "float32 weights left"
    assert any(t.data_type == TensorProto.FLOAT16 for t in half.graph.initializer)
    assert [v.type.tensor_type.elem_type for v in half.graph.input] == [v.type.tensor_type.elem_type for v in model.graph.input]
    assert [v.type.tensor_type.elem_type for v in half.graph.output] == [v.type.tensor_type.elem_type for v in model.graph.output]
    check_all_batches(OrtExecutable(half).run, graph, golden, 1e-2)


def test_fp16_export_of_a_segment(zoo) -> None:
    graph, _ = load(zoo.package("small_cnn"))
    seg = partition(graph, lambda n: n.op != "Softmax")[0]
    half = to_float16(export_segment(graph, seg))
    onnx.checker.check_model(half, full_check=True)


def test_keep_fp32_ops_compute_between_casts(zoo) -> None:
    pkg = zoo.package("mlp")
    graph, golden = load(pkg)
    half = to_float16(onnx.load(pkg / "model.onnx"), keep_fp32={"Softmax"})
    softmax = next(n for n in half.graph.node if n.op_type == "Softmax")
    producers = {o: n for n in half.graph.node for o in n.output}
    pre = producers[softmax.input[0]]
    assert pre.op_type == "Cast" and pre.attribute[0].i == TensorProto.FLOAT
    check_all_batches(OrtExecutable(half).run, graph, golden, 1e-2)


def test_fp16_refuses_weights_beyond_fp16_range() -> None:
    w = numpy_helper.from_array(np.array([[1e6]], np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])], initializer=[w])
    with pytest.raises(ValueError, match="float16's range"):
        to_float16(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
