"""Every host kernel against onnxruntime on single-node graphs (graph path) and via the eager API."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime import ops
from kubetrt.runtime.kernels import onednn, sgemm
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(0)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# (id, node, runtime inputs, constant initializers)
CASES = [
    ("conv3x3_pad", node("Conv", ["x", "w", "b"], pads=[1, 1, 1, 1]), {"x": f32(2, 3, 9, 9)}, {"w": f32(8, 3, 3, 3), "b": f32(8)}),
    ("conv_stride2_asym", node("Conv", ["x", "w"], strides=[2, 2], pads=[0, 0, 1, 1]), {"x": f32(1, 4, 10, 10)}, {"w": f32(6, 4, 3, 3)}),
    ("conv_dilated", node("Conv", ["x", "w"], dilations=[2, 2], pads=[2, 2, 2, 2]), {"x": f32(1, 3, 12, 12)}, {"w": f32(5, 3, 3, 3)}),
    ("conv_same_upper", node("Conv", ["x", "w"], strides=[2, 2], auto_pad="SAME_UPPER"), {"x": f32(1, 3, 11, 11)}, {"w": f32(4, 3, 3, 3)}),
    ("conv_grouped", node("Conv", ["x", "w"], group=2, pads=[1, 1, 1, 1]), {"x": f32(2, 4, 8, 8)}, {"w": f32(6, 2, 3, 3)}),
    ("conv_depthwise", node("Conv", ["x", "w", "b"], group=8, pads=[1, 1, 1, 1]), {"x": f32(3, 8, 12, 12)}, {"w": f32(8, 1, 3, 3), "b": f32(8)}),
    ("conv_depthwise_s2", node("Conv", ["x", "w"], group=6, strides=[2, 2], pads=[0, 0, 1, 1]), {"x": f32(1, 6, 14, 14)}, {"w": f32(6, 1, 3, 3)}),
    ("conv_depthwise_5x5_dilated", node("Conv", ["x", "w"], group=4, dilations=[2, 2], pads=[4, 4, 4, 4]), {"x": f32(1, 4, 9, 9)}, {"w": f32(4, 1, 5, 5)}),
    ("conv_pointwise", node("Conv", ["x", "w", "b"]), {"x": f32(4, 16, 7, 7)}, {"w": f32(32, 16, 1, 1), "b": f32(32)}),
    ("conv_weight_input", node("Conv", ["x", "w"], pads=[1, 1, 1, 1]), {"x": f32(1, 2, 5, 5), "w": f32(3, 2, 3, 3)}, {}),
    ("maxpool_pad", node("MaxPool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), {"x": f32(2, 3, 9, 9)}, {}),
    ("maxpool_ceil", node("MaxPool", ["x"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1), {"x": f32(1, 2, 7, 7)}, {}),
    ("avgpool_excl_pad", node("AveragePool", ["x"], kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]), {"x": f32(1, 2, 6, 6)}, {}),
    ("avgpool_incl_pad", node("AveragePool", ["x"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1), {"x": f32(1, 2, 7, 7)}, {}),
    ("global_avg", node("GlobalAveragePool", ["x"]), {"x": f32(2, 5, 4, 4)}, {}),
    ("global_max", node("GlobalMaxPool", ["x"]), {"x": f32(2, 5, 4, 4)}, {}),
    ("batchnorm", node("BatchNormalization", ["x", "s", "b", "m", "v"]), {"x": f32(2, 3, 4, 4)}, {"s": f32(3), "b": f32(3), "m": f32(3), "v": np.abs(f32(3)) + 0.5}),
    ("gemm_transB", node("Gemm", ["a", "b", "c"], transB=1, alpha=0.5, beta=2.0), {"a": f32(4, 6)}, {"b": f32(5, 6), "c": f32(5)}),
    ("gemm_transA", node("Gemm", ["a", "b"], transA=1), {"a": f32(6, 4), "b": f32(6, 3)}, {}),
    ("matmul_batched", node("MatMul", ["a", "b"]), {"a": f32(2, 3, 4, 5), "b": f32(2, 3, 5, 6)}, {}),
    ("matmul_3d_2d", node("MatMul", ["a", "b"]), {"a": f32(2, 7, 8)}, {"b": f32(8, 3)}),
    ("einsum_attention", node("Einsum", ["a", "b"], equation="abcd,aecd->acbe"), {"a": f32(2, 5, 4, 8), "b": f32(2, 6, 4, 8)}, {}),
    ("softmax", node("Softmax", ["x"], axis=-1), {"x": f32(3, 4, 10)}, {}),
    ("softmax_axis1", node("Softmax", ["x"], axis=1), {"x": f32(3, 4, 10)}, {}),
    ("logsoftmax", node("LogSoftmax", ["x"]), {"x": f32(3, 10)}, {}),
    ("layernorm", node("LayerNormalization", ["x", "s", "b"], axis=-1, epsilon=1e-5), {"x": f32(2, 5, 16)}, {"s": f32(16), "b": f32(16)}),
    ("reducemean", node("ReduceMean", ["x"], axes=[1, 2], keepdims=1), {"x": f32(2, 3, 4, 5)}, {}),
    ("reducesum_input_axes", node("ReduceSum", ["x", "a"], keepdims=0), {"x": f32(2, 3, 4)}, {"a": i64(-1)}),
    ("reducemax", node("ReduceMax", ["x"], axes=[0], keepdims=0), {"x": f32(4, 3)}, {}),
    ("reduceprod", node("ReduceProd", ["x"], keepdims=1), {"x": f32(2, 3)}, {}),
    ("argmax", node("ArgMax", ["x"], axis=1, keepdims=0), {"x": f32(4, 7)}, {}),
    ("relu", node("Relu", ["x"]), {"x": f32(3, 4)}, {}),
    ("sigmoid", node("Sigmoid", ["x"]), {"x": f32(3, 4)}, {}),
    ("tanh", node("Tanh", ["x"]), {"x": f32(3, 4)}, {}),
    ("erf", node("Erf", ["x"]), {"x": f32(50) * 2}, {}),
    ("hardswish", node("HardSwish", ["x"]), {"x": f32(40) * 4}, {}),
    ("hardsigmoid", node("HardSigmoid", ["x"], alpha=0.3, beta=0.4), {"x": f32(40) * 4}, {}),
    ("leakyrelu", node("LeakyRelu", ["x"], alpha=0.2), {"x": f32(10)}, {}),
    ("elu", node("Elu", ["x"], alpha=0.7), {"x": f32(10)}, {}),
    ("softplus", node("Softplus", ["x"]), {"x": f32(10)}, {}),
    ("clip_inputs", node("Clip", ["x", "lo", "hi"]), {"x": f32(20) * 3}, {"lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}),
    ("exp_log_sqrt", node("Sqrt", ["x"]), {"x": np.abs(f32(10)) + 0.1}, {}),
    ("reciprocal", node("Reciprocal", ["x"]), {"x": np.abs(f32(10)) + 0.5}, {}),
    ("add_broadcast", node("Add", ["a", "b"]), {"a": f32(2, 3, 4), "b": f32(4)}, {}),
    ("sub", node("Sub", ["a", "b"]), {"a": f32(2, 3), "b": f32(2, 3)}, {}),
    ("mul_scalar", node("Mul", ["a", "b"]), {"a": f32(2, 3)}, {"b": np.array(3.0, np.float32)}),
    ("div", node("Div", ["a", "b"]), {"a": f32(2, 3), "b": np.abs(f32(2, 3)) + 1}, {}),
    ("pow", node("Pow", ["a", "b"]), {"a": np.abs(f32(5)) + 0.1}, {"b": np.array(2.0, np.float32)}),
    ("max_variadic", node("Max", ["a", "b", "c"]), {"a": f32(3), "b": f32(3), "c": f32(3)}, {}),
    ("min", node("Min", ["a", "b"]), {"a": f32(3, 1), "b": f32(4)}, {}),
    ("where", node("Where", ["c", "a", "b"]), {"c": rng.random((3, 4)) > 0.5, "a": f32(3, 4), "b": f32(4)}, {}),
    ("equal_less", node("Less", ["a", "b"]), {"a": f32(5), "b": f32(5)}, {}),
    ("cast_int", node("Cast", ["x"], to=7), {"x": f32(6) * 10}, {}),
    ("reshape", node("Reshape", ["x", "s"]), {"x": f32(2, 3, 4)}, {"s": i64(0, -1)}),
    ("flatten", node("Flatten", ["x"], axis=2), {"x": f32(2, 3, 4, 5)}, {}),
    ("transpose", node("Transpose", ["x"], perm=[0, 2, 3, 1]), {"x": f32(2, 3, 4, 5)}, {}),
    ("squeeze", node("Squeeze", ["x", "a"]), {"x": f32(2, 1, 3, 1)}, {"a": i64(1, 3)}),
    ("unsqueeze", node("Unsqueeze", ["x", "a"]), {"x": f32(2, 3)}, {"a": i64(0, -1)}),
    ("concat", node("Concat", ["a", "b"], axis=1), {"a": f32(2, 3), "b": f32(2, 5)}, {}),
    ("split", node("Split", ["x", "s"], ["y0", "y1"], axis=1), {"x": f32(2, 7)}, {"s": i64(3, 4)}),
    ("slice_steps", node("Slice", ["x", "st", "en", "ax", "sp"]), {"x": f32(5, 8)}, {"st": i64(1, -1), "en": i64(4, 0), "ax": i64(0, 1), "sp": i64(1, -2)}),
    ("gather", node("Gather", ["x", "i"], axis=1), {"x": f32(3, 5)}, {"i": i64(4, 0, 2)}),
    ("gather_scalar", node("Gather", ["x", "i"], axis=0), {"x": f32(5, 2)}, {"i": np.array(3, np.int64)}),
    ("pad_reflect", node("Pad", ["x", "p"], mode="reflect"), {"x": f32(1, 2, 4, 4)}, {"p": i64(0, 0, 1, 2, 0, 0, 2, 1)}),
    ("pad_constant", node("Pad", ["x", "p", "v"]), {"x": f32(2, 3)}, {"p": i64(1, 0, 0, 2), "v": np.array(1.5, np.float32)}),
    ("shape", node("Shape", ["x"]), {"x": f32(2, 3, 4)}, {}),
    ("expand", node("Expand", ["x", "s"]), {"x": f32(3, 1)}, {"s": i64(2, 3, 4)}),
    ("tile", node("Tile", ["x", "r"]), {"x": f32(2, 3)}, {"r": i64(2, 2)}),
    ("range", node("Range", ["a", "b", "d"]), {}, {"a": np.array(1, np.int64), "b": np.array(10, np.int64), "d": np.array(3, np.int64)}),
    ("topk", node("TopK", ["x", "k"], ["v", "i"], axis=-1), {"x": f32(3, 8)}, {"k": i64(3)}),
    ("constant_of_shape", node("ConstantOfShape", ["s"]), {"s": i64(2, 3)}, {}),
]

# Expected outputs of the reference
OUTPUTS = {"split": ["y0", "y1"], "topk": ["v", "i"]}
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["packed", "onednn", "numpy"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_onnxruntime(case, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Every kernel family: the packed dense kernel (float32 matmuls with constant weights),
    oneDNN where it takes the op (convolutions, and those matmuls without the packed kernel),
    and the im2col/GEMM/NumPy kernels a node without the onednn extra runs."""
    if backend != "packed":
        monkeypatch.setattr(sgemm, "AVAILABLE", False)
    if backend == "numpy":
        monkeypatch.setattr(onednn, "AVAILABLE", False)
    elif not onednn.AVAILABLE:
        pytest.skip("the onednn extra is not installed")
    else:
        monkeypatch.setattr(onednn, "MIN_DENSE_MACS", 0)  # test-sized matmuls would take the NumPy path
    cid, n, feeds, consts = case
    model = make_model([n], feeds, OUTPUTS.get(cid, ["y"]), consts)
    ref = run_ort(model, feeds)
    for executor in ("sequential", "dataflow"):
        got = run_kubetrt(model, feeds, executor)
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert g.shape == r.shape, (cid, executor, g.shape, r.shape)
            assert g.dtype == r.dtype, (cid, executor, g.dtype, r.dtype)
            np.testing.assert_allclose(g, r, **TOL, err_msg=f"{cid} ({executor})")


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in {"conv3x3_pad", "conv_depthwise", "softmax", "layernorm", "gather", "maxpool_pad", "gemm_transB"}], ids=lambda c: c[0])
def test_eager_api_uses_same_kernels(case) -> None:  # type: ignore[no-untyped-def]
    cid, n, feeds, consts = case
    model = make_model([n], feeds, ["y"], consts)
    ref = run_ort(model, feeds)[0]
    operands = [({**feeds, **consts})[name] for name in n.input]
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    got = ops.call(n.op_type, *operands, **attrs)
    np.testing.assert_allclose(got, ref, **TOL)


def test_eager_rejects_operands_that_do_not_fit() -> None:
    from kubetrt.runtime import InputError

    with pytest.raises(InputError, match="MatMul"):
        ops.MatMul(f32(2, 3), f32(4, 5))


def test_eager_unknown_op_lists_supported() -> None:
    with pytest.raises(AttributeError, match="supported: .*Conv"):
        ops.NoSuchOp  # noqa: B018


@pytest.mark.skipif(not __import__("kubetrt.runtime.kernels.jit", fromlist=["AVAILABLE"]).AVAILABLE, reason="numba is not installed")
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("channels", [3, 32, 100])
@pytest.mark.parametrize("vector_first", [False, True])
def test_per_channel_binary_takes_the_row_vector_kernel(op: str, channels: int, vector_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """NHWC activations scaled or shifted per channel (SE blocks, input normalization): the jitted
    row kernel, in place on a dying operand or into a fresh array, both operand orders, rows
    widened for a narrow channel count (3) or not (100 does not divide into wider rows)."""
    from kubetrt.runtime.kernels import jit

    calls: list[tuple[int, ...]] = []
    real = jit.rows_by_vector
    monkeypatch.setattr(jit, "rows_by_vector", lambda a, v, *rest: calls.append(a.shape) or real(a, v, *rest))
    x = f32(2, 30, 25, channels)  # 4500 elements and more: above the NumPy cut-off
    v = np.abs(f32(1, 1, 1, channels)) + 0.5 if op == "Div" else f32(1, 1, 1, channels)
    operands = ["v", "r"] if vector_first else ["r", "v"]
    if op == "Div" and vector_first:
        x = np.abs(x) + 0.5
    for nodes, outputs in (([node("Relu", ["x"], ["r"]), node(op, operands, ["y"])], ["y"]),  # r dies here: in place
                           ([node("Relu", ["x"], ["r"]), node(op, operands, ["y"])], ["y", "r"])):  # r is read after: a fresh array
        calls.clear()
        feeds = {"x": x}
        model = make_model(nodes, feeds, outputs, {"v": v})
        got, ref = run_kubetrt(model, feeds), run_ort(model, feeds)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
        assert calls == [x.shape]

