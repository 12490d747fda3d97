"""Compiler passes: folding, fusion and memory planning change the program, never the numbers."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime import UnsupportedOpError
from kubetrt.runtime.onnx_import import from_proto
from kubetrt.runtime.program import compile_graph
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(1)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def compiled(model):  # type: ignore[no-untyped-def]
    return compile_graph(from_proto(model))


def assert_same_as_ort(model, feeds) -> None:  # type: ignore[no-untyped-def]
    ref = run_ort(model, feeds)
    for executor in ("sequential", "dataflow"):
        for g, r in zip(run_kubetrt(model, feeds, executor), ref):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_conv_batchnorm_relu_fold_into_one_kernel() -> None:
    nodes = [
        node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        node("BatchNormalization", ["c", "s", "bb", "m", "v"], ["n"], epsilon=1e-3),
        node("Relu", ["n"], ["y"]),
    ]
    consts = {"w": f32(8, 3, 3, 3), "b": f32(8), "s": f32(8), "bb": f32(8), "m": f32(8), "v": np.abs(f32(8)) + 0.5}
    feeds = {"x": f32(2, 3, 10, 10)}
    model = make_model(nodes, feeds, ["y"], consts)
    prog = compiled(model)
    assert [k.op for k in prog.kernels] == ["FusedConv"]
    assert assert_same_as_ort(model, feeds) is None


def test_decomposed_batchnorm_and_relu6_fold_into_depthwise_conv() -> None:
    nodes = [
        node("Conv", ["x", "w"], ["c"], group=4, pads=[1, 1, 1, 1]),
        node("Mul", ["c", "scale"], ["m"]),
        node("Add", ["m", "shift"], ["a"]),
        node("Clip", ["a", "lo", "hi"], ["y"]),
    ]
    consts = {"w": f32(4, 1, 3, 3), "scale": f32(1, 4, 1, 1), "shift": f32(4, 1, 1), "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
    feeds = {"x": f32(1, 4, 9, 9) * 3}
    model = make_model(nodes, feeds, ["y"], consts)
    prog = compiled(model)
    assert [k.op for k in prog.kernels] == ["FusedConv"]
    assert_same_as_ort(model, feeds)


def test_zero_pad_folds_into_conv_padding() -> None:
    nodes = [node("Pad", ["x", "p"], ["xp"]), node("Conv", ["xp", "w"], ["y"], strides=[2, 2])]
    consts = {"p": np.array([0, 0, 1, 1, 0, 0, 2, 2], np.int64), "w": f32(4, 3, 3, 3)}
    feeds = {"x": f32(1, 3, 11, 11)}
    model = make_model(nodes, feeds, ["y"], consts)
    assert [k.op for k in compiled(model).kernels] == ["FusedConv"]
    assert_same_as_ort(model, feeds)


def stem(activation: str | None) -> tuple[list, dict[str, np.ndarray]]:  # type: ignore[type-arg]
    """ResNet's stem tail: convolution, activation, one pixel of zeros, 3x3 max pool of stride 2."""
    nodes = [node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])]
    if activation is not None:
        nodes.append(node(activation, ["c"], ["a"]))
    nodes += [node("Pad", ["a" if activation else "c", "p"], ["cp"]), node("MaxPool", ["cp"], ["y"], kernel_shape=[3, 3], strides=[2, 2])]
    return nodes, {"w": f32(16, 3, 3, 3), "p": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64)}


def test_zero_pad_after_a_relu_folds_into_the_max_pool() -> None:
    nodes, consts = stem("Relu")
    feeds = {"x": f32(2, 3, 11, 11)}
    model = make_model(nodes, feeds, ["y"], consts)
    assert "Pad" not in [k.op for k in compiled(model).kernels]
    assert_same_as_ort(model, feeds)


def test_zero_pad_before_a_max_pool_of_signed_values_stays() -> None:
    # zeros beside negative values win the border windows: folding would change those outputs
    nodes, consts = stem(None)
    feeds = {"x": f32(2, 3, 11, 11) - 3.0}
    model = make_model(nodes, feeds, ["y"], consts)
    assert "Pad" in [k.op for k in compiled(model).kernels]
    assert_same_as_ort(model, feeds)


def test_residual_add_and_activation_fuse_into_conv() -> None:
    nodes = [node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), node("Add", ["c", "x"], ["a"]), node("Relu", ["a"], ["y"])]
    consts = {"w": f32(3, 3, 3, 3), "b": f32(3)}
    feeds = {"x": f32(2, 3, 6, 6)}
    model = make_model(nodes, feeds, ["y"], consts)
    prog = compiled(model)
    assert [k.op for k in prog.kernels] == ["FusedConv"]
    assert len(prog.kernels[0].inputs) == 4  # x, w, b, residual
    assert_same_as_ort(model, feeds)


def test_matmul_bias_gelu_like_epilogue() -> None:
    nodes = [node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["a"]), node("Sigmoid", ["a"], ["y"])]
    feeds = {"x": f32(2, 5, 8)}
    model = make_model(nodes, feeds, ["y"], {"w": f32(8, 4), "b": f32(4)})
    assert [k.op for k in compiled(model).kernels] == ["FusedMatMul"]
    assert_same_as_ort(model, feeds)


def test_fusion_never_swallows_a_value_someone_else_reads() -> None:
    # c is a graph output and feeds the Relu: Conv must not absorb the Relu.
    nodes = [node("Conv", ["x", "w"], ["c"]), node("Relu", ["c"], ["y"])]
    feeds = {"x": f32(1, 2, 4, 4)}
    model = make_model(nodes, feeds, ["c", "y"], {"w": f32(2, 2, 1, 1)})
    assert [k.op for k in compiled(model).kernels] == ["FusedConv", "Relu"]
    assert_same_as_ort(model, feeds)


def test_constant_subgraphs_and_static_shapes_fold_away() -> None:
    nodes = [
        node("Add", ["c1", "c2"], ["c3"]),  # constant-only
        node("Shape", ["x"], ["s"]),  # x has a fully static shape
        node("Gather", ["s", "zero"], ["d0"], axis=0),
        node("Unsqueeze", ["d0", "ax"], ["d0v"]),
        node("Concat", ["d0v", "minus1"], ["target"], axis=0),
        node("Reshape", ["x", "target"], ["r"]),
        node("Mul", ["r", "c3"], ["y"]),
    ]
    consts = {"c1": f32(12), "c2": f32(12), "zero": np.array(0, np.int64), "ax": np.array([0], np.int64), "minus1": np.array([-1], np.int64)}
    feeds = {"x": f32(2, 3, 4)}
    model = make_model(nodes, feeds, ["y"], consts)
    prog = compiled(model)
    assert [k.op for k in prog.kernels] == ["Reshape", "Mul"]
    assert_same_as_ort(model, feeds)


def test_inplace_chain_never_overwrites_the_callers_input() -> None:
    nodes = [node("Relu", ["x"], ["a"]), node("Sigmoid", ["a"], ["b"]), node("Tanh", ["b"], ["y"])]
    x = f32(4, 5)
    model = make_model(nodes, {"x": x}, ["y"])
    prog = compiled(model)
    ops_inplace = {k.op: bool(k.inplace) for k in prog.kernels}
    assert ops_inplace == {"Relu": False, "Sigmoid": True, "Tanh": True}  # x is the caller's
    before = x.copy()
    assert_same_as_ort(model, {"x": x})
    np.testing.assert_array_equal(x, before)


def test_no_inplace_write_into_a_buffer_a_live_view_shares() -> None:
    # r dies at Sigmoid in program order, but its view v is read afterwards.
    nodes = [
        node("Relu", ["x"], ["r"]),
        node("Reshape", ["r", "shape"], ["v"]),
        node("Sigmoid", ["r"], ["s"]),
        node("Reshape", ["s", "shape"], ["sv"]),
        node("Add", ["sv", "v"], ["y"]),
    ]
    feeds = {"x": f32(3, 4)}
    model = make_model(nodes, feeds, ["y"], {"shape": np.array([4, 3], np.int64)})
    prog = compiled(model)
    sigmoid = next(k for k in prog.kernels if k.op == "Sigmoid")
    assert not sigmoid.inplace
    assert_same_as_ort(model, feeds)


def test_program_counts_are_consistent() -> None:
    nodes = [node("Relu", ["x"], ["a"]), node("Neg", ["x"], ["b"]), node("Add", ["a", "b"], ["c"]), node("Mul", ["c", "k"], ["y"])]
    model = make_model(nodes, {"x": f32(3)}, ["y"], {"k": f32(3)})
    prog = compiled(model)
    for v in prog.values:
        readers = sum(k.inputs.count(v.id) for k in prog.kernels)
        assert v.use_count == readers, v.name
    for k in prog.kernels:
        assert k.operand_count == sum(1 for i in k.inputs if i >= 0 and prog.values[i].const is None)
        for user in k.used_by:
            assert set(prog.kernels[user].inputs) & set(k.outputs)
    x_value = prog.value("x")
    assert x_value.use_count == 2
    freed = [v for k in prog.kernels for v in k.frees]
    assert prog.value("a").id in freed and prog.value("y").id not in freed


def test_unsupported_op_fails_at_load_naming_op_node_and_supported_list() -> None:
    model = make_model([node("Det", ["x"], ["y"])], {"x": f32(3, 3)}, ["y"])
    with pytest.raises(UnsupportedOpError) as err:
        compiled(model)
    msg = str(err.value)
    assert "op Det" in msg and "det_y" in msg and "Conv" in msg and "MatMul" in msg


def test_layout_pass_runs_conv_chains_in_nhwc_with_transposes_only_at_the_edges() -> None:
    nodes = [
        node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        node("Relu", ["c1"], ["r1"]),
        node("Pad", ["r1", "p"], ["pd"]),
        node("MaxPool", ["pd"], ["m"], kernel_shape=[3, 3], strides=[2, 2]),
        node("Conv", ["m", "w2"], ["c2"], group=8, pads=[1, 1, 1, 1]),
        node("Mul", ["c2", "scale"], ["s"]),
        node("Conv", ["m", "w3"], ["c3"]),
        node("Concat", ["s", "c3"], ["cat"], axis=1),
        node("GlobalAveragePool", ["cat"], ["g"]),
        node("Flatten", ["g"], ["y"]),
    ]
    consts = {"w1": f32(8, 3, 3, 3), "b1": f32(8), "p": np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64),
              "w2": f32(8, 1, 3, 3), "scale": f32(1, 8, 1, 1), "w3": f32(4, 8, 1, 1)}
    feeds = {"x": f32(2, 3, 12, 12)}
    model = make_model(nodes, feeds, ["y"], consts)
    ops = [k.op for k in compiled(model).kernels]
    assert ops.count("FusedConvNHWC") == 3 and "MaxPoolNHWC" in ops and "GlobalAveragePoolNHWC" in ops
    # into NHWC after the input; back to NCHW before Flatten only moves the pooled 1x1 axes, so it
    # and the Flatten are one reshape of the pooled tensor
    assert ops.count("Transpose") == 1 and ops[-1] == "Reshape" and ops.count("Reshape") == 1
    assert_same_as_ort(model, feeds)


def test_fused_residual_from_a_later_branch_keeps_topological_order() -> None:
    # ResNet's projection shortcut: the main path's last conv is listed before the shortcut conv,
    # so fusing the Add into it makes it read a value produced later unless passes re-sort.
    nodes = [
        node("Conv", ["x", "wa"], ["a"], pads=[1, 1, 1, 1]),
        node("Relu", ["a"], ["ra"]),
        node("Conv", ["ra", "wb"], ["b"], pads=[1, 1, 1, 1]),
        node("Conv", ["x", "ws"], ["s"]),
        node("Add", ["b", "s"], ["sum"]),
        node("Relu", ["sum"], ["y"]),
    ]
    consts = {"wa": f32(6, 4, 3, 3), "wb": f32(6, 6, 3, 3), "ws": f32(6, 4, 1, 1)}
    feeds = {"x": f32(2, 4, 7, 7)}
    model = make_model(nodes, feeds, ["y"], consts)
    prog = compiled(model)
    assert [k.op for k in prog.kernels].count("FusedConvNHWC") == 3 and "Add" not in [k.op for k in prog.kernels]
    assert_same_as_ort(model, feeds)
