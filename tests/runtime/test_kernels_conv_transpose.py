"""ConvTranspose (1-D to 3-D) against onnxruntime: every attribute, the forms tf2onnx emits for Keras
Conv{1,2,3}DTranspose (explicit pads, output_shape when the input size is dynamic), the spec's
defaults, and the kernel's own paths (direct interleave, phase buffers, batched GEMM, depthwise)."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from kubetrt.runtime import UnsupportedOpError, ops
from kubetrt.runtime.kernels import conv_transpose, parallel
from kubetrt.runtime.kernels.registry import KernelSpec, lookup
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(11)
TOL = dict(rtol=1e-4, atol=1e-5)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def ct_model(x: np.ndarray, w: np.ndarray, bias: bool = True, dynamic_batch: bool = False, weights_input: bool = False,
             **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    group = attrs.get("group", 1)
    consts = {} if weights_input else {"w": w}
    feeds = {"x": x, "w": w} if weights_input else {"x": x}
    inputs = ["x", "w"]
    if bias:
        consts["b"] = f32(w.shape[1] * group)
        inputs.append("b")
    return make_model([node("ConvTranspose", inputs, **attrs)], feeds, ["y"], consts, dynamic_batch=dynamic_batch), feeds


def assert_matches(m: onnx.ModelProto, feeds: dict[str, np.ndarray], executors: tuple[str, ...] = ("sequential",)) -> None:
    ref = run_ort(m, feeds)[0]
    for executor in executors:
        got = run_kubetrt(m, feeds, executor)[0]
        assert got.shape == ref.shape and got.dtype == ref.dtype, (executor, got.shape, ref.shape)
        np.testing.assert_allclose(got, ref, **TOL, err_msg=executor)


# (id, x shape, w shape, attributes)
CASES: list[tuple[str, tuple[int, ...], tuple[int, ...], dict[str, Any]]] = [
    # Keras Conv2DTranspose via tf2onnx: explicit pads, SAME k=3 s=2 and VALID k=2 s=2
    ("keras_same_k3s2", (2, 6, 5, 6), (6, 4, 3, 3), dict(strides=[2, 2], pads=[0, 0, 1, 1])),
    ("keras_valid_k2s2", (2, 6, 5, 6), (6, 4, 2, 2), dict(strides=[2, 2], pads=[0, 0, 0, 0])),
    ("defaults_k3", (2, 3, 5, 6), (3, 4, 3, 3), {}),
    ("stride1_pads", (1, 3, 5, 6), (3, 2, 3, 3), dict(pads=[1, 1, 1, 1])),
    ("same_upper", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_UPPER")),
    ("same_lower", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], auto_pad="SAME_LOWER")),
    ("valid", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], auto_pad="VALID")),
    ("output_shape", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], output_shape=[10, 12])),
    ("output_shape_same_upper", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], output_shape=[10, 12], auto_pad="SAME_UPPER")),
    ("output_shape_same_lower", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], output_shape=[9, 11], auto_pad="SAME_LOWER")),
    ("output_shape_past_natural", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], output_shape=[12, 13])),
    ("output_shape_overrides_pads", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], output_shape=[10, 12], pads=[2, 2, 2, 2])),
    ("dilated", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 3], dilations=[2, 2], pads=[1, 2, 0, 1])),
    ("dilation_eq_stride", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[2, 2], dilations=[2, 2])),
    ("output_padding", (1, 4, 5, 6), (4, 3, 3, 3), dict(strides=[3, 2], output_padding=[2, 1], pads=[1, 0, 2, 1])),
    ("kernel_lt_stride", (1, 4, 5, 6), (4, 3, 2, 2), dict(strides=[3, 3], output_padding=[1, 2])),
    ("k5_s3_asym", (1, 4, 5, 6), (4, 3, 5, 4), dict(strides=[3, 2], pads=[1, 0, 2, 3], kernel_shape=[5, 4])),
    ("grouped", (2, 4, 5, 6), (4, 3, 3, 3), dict(group=2, strides=[2, 2], pads=[1, 1, 1, 1])),
    ("depthwise", (2, 6, 5, 6), (6, 1, 3, 3), dict(group=6, strides=[2, 2], pads=[1, 1, 0, 0])),
    ("depthwise_multiplier", (2, 3, 5, 6), (3, 2, 3, 3), dict(group=3, strides=[2, 2])),
    ("one_input_channel", (2, 1, 5, 6), (1, 3, 3, 3), dict(strides=[2, 2])),
    ("gan_1x1_to_4x4_batch", (16, 8, 1, 1), (8, 5, 4, 4), {}),
    ("small_input_batch_s2", (6, 8, 3, 3), (8, 5, 3, 3), dict(strides=[2, 2], pads=[1, 1, 0, 0])),
    ("1d", (2, 4, 7), (4, 5, 3), dict(strides=[2], pads=[1, 0])),
    ("1d_k4s2", (2, 4, 7), (4, 5, 4), dict(strides=[2], pads=[1, 1])),
    ("1d_same_upper", (2, 4, 7), (4, 5, 3), dict(strides=[3], auto_pad="SAME_UPPER")),
    ("3d_k3s2", (1, 3, 3, 4, 5), (3, 2, 3, 3, 3), dict(strides=[2, 2, 2], pads=[1, 0, 1, 0, 1, 0])),
    ("3d_k2s2", (2, 3, 3, 4, 5), (3, 2, 2, 2, 2), dict(strides=[2, 2, 2])),
    ("3d_mixed", (1, 2, 3, 4, 3), (2, 3, 2, 3, 4), dict(strides=[1, 2, 3], dilations=[2, 1, 1], output_padding=[0, 1, 2], group=2)),
]


@pytest.mark.parametrize("cid,xs,ws,attrs", CASES, ids=[c[0] for c in CASES])
def test_conv_transpose_matches_onnxruntime(cid: str, xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any]) -> None:
    m, feeds = ct_model(f32(*xs), f32(*ws), **attrs)
    assert_matches(m, feeds)


@pytest.mark.parametrize("cid", ["keras_same_k3s2", "keras_valid_k2s2", "grouped", "depthwise"])
def test_without_bias_both_executors(cid: str) -> None:
    _, xs, ws, attrs = next(c for c in CASES if c[0] == cid)
    m, feeds = ct_model(f32(*xs), f32(*ws), bias=False, **attrs)
    assert_matches(m, feeds, ("sequential", "dataflow"))


def test_dynamic_batch_and_two_batch_sizes() -> None:
    m, _ = ct_model(f32(2, 6, 5, 6), f32(6, 4, 3, 3), dynamic_batch=True, strides=[2, 2], pads=[0, 0, 1, 1])
    for n in (1, 3):
        x = f32(n, 6, 5, 6)
        assert_matches(m, {"x": x}, ("sequential", "dataflow"))


def test_weights_as_a_runtime_input() -> None:
    for attrs in (dict(strides=[2, 2], pads=[0, 0, 1, 1]), dict(group=2, strides=[2, 1]), dict(group=4, strides=[2, 2])):
        m, feeds = ct_model(f32(2, 4, 5, 6), f32(4, 3, 3, 3), weights_input=True, **attrs)
        assert_matches(m, feeds)


def test_dynamic_input_size_with_output_shape() -> None:
    """tf2onnx writes output_shape when the input's spatial size is unknown at conversion."""
    x = f32(1, 4, 5, 6)
    n = node("ConvTranspose", ["x", "w"], strides=[2, 2], output_shape=[10, 12])
    graph = onnx.helper.make_graph([n], "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, "H", "W"])],
                                   [onnx.helper.make_empty_tensor_value_info("y")], [onnx.numpy_helper.from_array(f32(4, 3, 3, 3), "w")])
    m = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    m.ir_version = 8
    assert_matches(m, {"x": x})


def test_negative_pads_follow_the_spec() -> None:
    """onnxruntime refuses negative pads; the spec's formula (and its reference) extends the output."""
    m, feeds = ct_model(f32(1, 4, 5, 6), f32(4, 3, 3, 3), strides=[2, 2], pads=[0, -1, 1, -2])
    ref = ReferenceEvaluator(m).run(None, feeds)[0]
    got = run_kubetrt(m, feeds)[0]
    assert got.shape == ref.shape == (1, 3, 10, 16)
    np.testing.assert_allclose(got, ref, **TOL)


def test_same_with_kernel_below_stride_appends_like_output_padding() -> None:
    """SAME_UPPER with k=1 s=2 (TensorFlow's SAME): the spec's in*stride output, the extra row and
    column at the end, as TensorFlow computes it; onnxruntime gives the smaller natural size here,
    so the reference is onnxruntime with output_padding."""
    x, w = f32(1, 4, 5, 6), f32(4, 3, 1, 1)
    m, feeds = ct_model(x, w, bias=False, strides=[2, 2], auto_pad="SAME_UPPER")
    ref_model, _ = ct_model(x, w, bias=False, strides=[2, 2], output_padding=[1, 1])
    ref = run_ort(ref_model, feeds)[0]
    got = run_kubetrt(m, feeds)[0]
    assert got.shape == ref.shape == (1, 3, 10, 12)
    np.testing.assert_allclose(got, ref, **TOL)


def test_split_across_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several pool threads: output-channel chunks at batch 1, batch items otherwise."""
    monkeypatch.setattr(parallel, "THREADS", 4)
    monkeypatch.setattr(parallel, "MIN_FLOPS_PER_THREAD", 1)
    for xs, ws, attrs in (((1, 6, 5, 6), (6, 8, 3, 3), dict(strides=[2, 2], pads=[0, 0, 1, 1])),
                          ((3, 6, 5, 6), (6, 4, 2, 2), dict(strides=[2, 2])),
                          ((1, 6, 5, 6), (6, 2, 3, 3), dict(group=6, strides=[2, 2]))):
        m, feeds = ct_model(f32(*xs), f32(*ws), **attrs)
        assert_matches(m, feeds, ("sequential", "dataflow"))


def test_plans_take_the_direct_path_only_without_overlap() -> None:
    """k <= s: every tap has its own phase, the GEMM output is interleaved as is; k > s: phase buffers."""
    plan = conv_transpose.make_plan((5, 6), (2, 2), [2, 2], [1, 1], [0, 0], [10, 12])
    assert plan.direct and not plan.fill and plan.in_pad == (0, 0)
    plan = conv_transpose.make_plan((5, 6), (3, 3), [2, 2], [1, 1], [0, 0], [10, 12])
    assert not plan.direct and not plan.fill and plan.in_pad == (0, 1)
    plan = conv_transpose.make_plan((5, 6), (3, 3), [2, 2], [2, 2], [0, 0], [13, 15])  # odd phases take no tap
    assert plan.fill


def test_eager_api() -> None:
    x, w, b = f32(2, 4, 5, 6), f32(4, 3, 3, 3), f32(3)
    m = make_model([node("ConvTranspose", ["x", "w", "b"], strides=[2, 2], pads=[0, 0, 1, 1])], {"x": x}, ["y"], {"w": w, "b": b})
    np.testing.assert_allclose(ops.ConvTranspose(x, w, b, strides=[2, 2], pads=[0, 0, 1, 1]), run_ort(m, {"x": x})[0], **TOL)


def _spec(attrs: dict[str, Any], xs: tuple[int, ...] = (1, 4, 5, 6), ws: tuple[int, ...] = (4, 3, 3, 3),
          dtype: Any = np.float32) -> KernelSpec:
    w = np.zeros(ws, np.float32)
    return KernelSpec("ConvTranspose", "up3", attrs, [None, w], [xs, ws], [np.dtype(dtype), w.dtype], present=[True, True])


@pytest.mark.parametrize("attrs,dtype,message", [
    (dict(auto_pad="SAME"), np.float32, "auto_pad='SAME' is not supported; supported: NOTSET, SAME_UPPER, SAME_LOWER, VALID"),
    (dict(auto_pad="VALID", pads=[1, 1, 1, 1]), np.float32, "pads=.* with auto_pad=VALID"),
    (dict(strides=[2, 2, 2]), np.float32, r"strides=\[2, 2, 2\] has 3 values; a 2-D transposed convolution takes 2"),
    (dict(group=0), np.float32, "group=0"),
    (dict(kernel_shape=[2, 2]), np.float32, "kernel_shape=.* differs from the weights'"),
    ({}, np.int32, "on int32 inputs is not supported; supported: floating point"),
])
def test_bad_attributes_are_refused_naming_the_node(attrs: dict[str, Any], dtype: Any, message: str) -> None:
    with pytest.raises(UnsupportedOpError, match=f"node 'up3': ConvTranspose {message}"):
        lookup("ConvTranspose").factory(_spec(attrs, dtype=dtype))


def test_refusal_reaches_the_compiler_with_the_node_name() -> None:
    m, feeds = ct_model(f32(1, 4, 5, 6), f32(4, 3, 3, 3), auto_pad="SAME")
    with pytest.raises(UnsupportedOpError, match="node 'convtranspose_y': ConvTranspose auto_pad='SAME'"):
        run_kubetrt(m, feeds)


def test_shape_function_tolerates_unknowns() -> None:
    shape_fn = lookup("ConvTranspose").shape_fn
    spec = KernelSpec("ConvTranspose", "u", {"strides": [2, 2]}, [None, None], [None, None], [None, None], present=[True, True])
    assert shape_fn(spec) == [(None, None)]
    spec.shapes = [(-1, 4, -1, 6), (4, 3, 3, 3)]
    assert shape_fn(spec) == [((-1, 3, -1, -1), None)]
    spec.shapes = [(-1, 4, 5, 6), None]
    assert shape_fn(spec) == [((-1, -1, -1, -1), None)]
    spec.shapes = [(2, 4, 5, 6), (4, 3, 3, 3)]
    assert shape_fn(spec) == [((2, 3, 11, 13), None)]
