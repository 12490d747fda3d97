"""Resize (opset 11-19 forms), DepthToSpace and SpaceToDepth against onnxruntime: every mode,
coordinate transform and nearest rounding, scales and sizes, opset 18's axes and aspect-ratio
policies, tf_crop_and_resize, and the forms tf2onnx emits for Keras UpSampling2D/tf.image.resize."""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import onnx
import pytest

from kubetrt.runtime import UnsupportedOpError, ops
from kubetrt.runtime.kernels import resize
from kubetrt.runtime.kernels.registry import KernelSpec, lookup
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(5)
TOL = dict(rtol=1e-4, atol=1e-5)
EMPTY = np.array([], np.float32)
TRANSFORMS = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric"]


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def model(n: onnx.NodeProto, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray] | None = None,
          opset: int = 17, dynamic_batch: bool = False) -> onnx.ModelProto:
    m = make_model([n], feeds, list(n.output), consts or {}, dynamic_batch=dynamic_batch)
    m.opset_import[0].version = opset
    return m


def opset_for(transform: str) -> int:
    """half_pixel_symmetric is opset 19's; tf_half_pixel_for_nn left the spec in opset 18."""
    return {"half_pixel_symmetric": 19, "tf_half_pixel_for_nn": 13}.get(transform, 17)


def assert_matches(m: onnx.ModelProto, feeds: dict[str, np.ndarray], executors: tuple[str, ...] = ("sequential",)) -> None:
    ref = run_ort(m, feeds)
    for executor in executors:
        got = run_kubetrt(m, feeds, executor)
        for g, r in zip(got, ref):
            assert g.dtype == r.dtype and g.shape == r.shape, (executor, g.dtype, g.shape, r.dtype, r.shape)
            np.testing.assert_allclose(g, r, **TOL, err_msg=executor)


def scales_case(mode: str, transform: str, scales: list[float], x: np.ndarray | None = None, **attrs: Any) -> None:
    x = f32(2, 3, 7, 9) if x is None else x
    n = node("Resize", ["x", "roi", "scales"], mode=mode, coordinate_transformation_mode=transform, **attrs)
    assert_matches(model(n, {"x": x}, {"roi": EMPTY, "scales": np.array(scales, np.float32)}, opset_for(transform)), {"x": x})


UP_DOWN = [[1, 1, 2, 2], [1, 1, 0.6, 1.7], [1, 1, 3, 1.5], [1, 1, 1, 2.5]]


@pytest.mark.parametrize("transform", TRANSFORMS + ["tf_half_pixel_for_nn"])
@pytest.mark.parametrize("rounding", ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
def test_nearest(transform: str, rounding: str) -> None:
    for scales in UP_DOWN:
        if transform == "half_pixel_symmetric" and scales[2] == 0.6:
            # Its first coordinate lands within float noise of a half; onnxruntime's build rounds
            # it one way, float32 arithmetic the other: a tie, not a semantic difference.
            continue
        scales_case("nearest", transform, scales, nearest_mode=rounding)


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_linear(transform: str) -> None:
    for scales in UP_DOWN:
        scales_case("linear", transform, scales)


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("a,exclude", [(-0.75, 0), (-0.5, 1), (-0.5, 0)])
def test_cubic(transform: str, a: float, exclude: int) -> None:
    for scales in UP_DOWN[:3]:
        scales_case("cubic", transform, scales, cubic_coeff_a=a, exclude_outside=exclude)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_long_last_axis_uses_gathers(mode: str) -> None:
    """A last axis past DENSE_TAP_SPAN per tap resizes by gathers, not the dense GEMM."""
    x = f32(1, 2, 5, 140)
    assert 140 > resize.DENSE_TAP_SPAN * 4
    scales_case(mode, "half_pixel", [1, 1, 1.4, 1.5], x=x)
    scales_case(mode, "align_corners", [1, 1, 2, 0.5], x=x)


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
@pytest.mark.parametrize("transform", ["half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"])
def test_sizes(mode: str, transform: str) -> None:
    x = f32(2, 3, 7, 9)
    for sizes in ([2, 3, 14, 18], [2, 3, 5, 4], [2, 3, 13, 11], [2, 3, 1, 1]):
        n = node("Resize", ["x", "roi", "", "sizes"], mode=mode, coordinate_transformation_mode=transform)
        assert_matches(model(n, {"x": x}, {"roi": EMPTY, "sizes": np.array(sizes, np.int64)}), {"x": x})


# tf2onnx's forms (opset 13): x NCHW, an empty roi, constant scales or runtime sizes
KERAS = {
    "upsampling2d_nearest": dict(mode="nearest", coordinate_transformation_mode="tf_half_pixel_for_nn", nearest_mode="floor"),
    "image_resize_nearest_align": dict(mode="nearest", coordinate_transformation_mode="align_corners", nearest_mode="round_prefer_ceil"),
    "upsampling2d_bilinear": dict(mode="linear", coordinate_transformation_mode="half_pixel", nearest_mode="floor"),
    "v1_resize_bilinear": dict(mode="linear", coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    "image_resize_bicubic": dict(mode="cubic", coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.5, exclude_outside=1),
}


@pytest.mark.parametrize("case", list(KERAS))
def test_keras_forms_both_executors_dynamic_batch(case: str) -> None:
    x = f32(2, 4, 6, 8)
    n = node("Resize", ["x", "roi", "scales"], **KERAS[case])
    m = model(n, {"x": x}, {"roi": EMPTY, "scales": np.array([1, 1, 2, 2], np.float32)}, opset=13, dynamic_batch=True)
    for batch in (2, 3):
        assert_matches(m, {"x": f32(batch, 4, 6, 8)}, ("sequential", "dataflow"))


@pytest.mark.parametrize("case", list(KERAS))
def test_keras_forms_with_runtime_sizes(case: str) -> None:
    """A dynamic input size: tf2onnx computes sizes with Shape/Slice/Concat; here a graph input."""
    x = f32(1, 4, 6, 8)
    n = node("Resize", ["x", "roi", "scales", "sizes"], **KERAS[case])
    m = model(n, {"x": x, "sizes": np.array([1, 4, 12, 20], np.int64)}, {"roi": EMPTY, "scales": EMPTY}, opset=13)
    for sizes in ([1, 4, 12, 20], [1, 4, 9, 5]):
        assert_matches(m, {"x": x, "sizes": np.array(sizes, np.int64)})


def test_large_batch_resizes_in_chunks() -> None:
    x = f32(4, 16, 64, 64)
    assert 4 * 16 * 128 * 128 * 4 > resize.CHUNK_BYTES
    for case in ("upsampling2d_nearest", "upsampling2d_bilinear"):
        n = node("Resize", ["x", "roi", "scales"], **KERAS[case])
        assert_matches(model(n, {"x": x}, {"roi": EMPTY, "scales": np.array([1, 1, 2, 2], np.float32)}, opset=13), {"x": x})


@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_tf_crop_and_resize(mode: str) -> None:
    x = f32(2, 3, 7, 9)
    roi = np.array([0, 0, -0.2, 0.1, 1, 1, 0.9, 1.3], np.float32)  # parts outside the image: extrapolated
    n = node("Resize", ["x", "roi", "", "sizes"], mode=mode, coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-3.0)
    assert_matches(model(n, {"x": x}, {"roi": roi, "sizes": np.array([2, 3, 6, 5], np.int64)}), {"x": x})


def test_tf_crop_and_resize_with_runtime_roi() -> None:
    """As in tf2onnx's CropAndResize loop: the roi is computed per box at run time."""
    x = f32(1, 3, 8, 8)
    n = node("Resize", ["x", "roi", "", "sizes"], mode="linear", coordinate_transformation_mode="tf_crop_and_resize")
    m = model(n, {"x": x, "roi": np.array([0, 0, 0.1, 0.2, 1, 1, 0.6, 0.9], np.float32)}, {"sizes": np.array([1, 3, 5, 4], np.int64)})
    for roi in ([0, 0, 0.1, 0.2, 1, 1, 0.6, 0.9], [0, 0, 0.5, 0.0, 1, 1, 1.2, 0.5]):
        assert_matches(m, {"x": x, "roi": np.array(roi, np.float32)})


@pytest.mark.parametrize("policy", ["stretch", "not_larger", "not_smaller"])
@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_opset18_axes_and_aspect_ratio_policy(policy: str, mode: str) -> None:
    x = f32(2, 3, 7, 9)
    n = node("Resize", ["x", "", "", "sizes"], mode=mode, axes=[2, 3], keep_aspect_ratio_policy=policy)
    assert_matches(model(n, {"x": x}, {"sizes": np.array([10, 20], np.int64)}, opset=18), {"x": x})


def test_opset18_axes_with_scales_in_any_order() -> None:
    x = f32(2, 3, 7, 9)
    n = node("Resize", ["x", "", "scales"], mode="linear", axes=[3, 2])
    assert_matches(model(n, {"x": x}, {"scales": np.array([2.0, 1.5], np.float32)}, opset=18), {"x": x})


def test_trilinear_and_nearest_3d() -> None:
    x = f32(2, 3, 4, 5, 6)
    for mode in ("linear", "nearest"):
        n = node("Resize", ["x", "", "scales"], mode=mode)
        assert_matches(model(n, {"x": x}, {"scales": np.array([1, 1, 2, 1.5, 0.5], np.float32)}, opset=18), {"x": x})


def test_nearest_keeps_integer_types() -> None:
    x = rng.integers(0, 255, size=(1, 3, 5, 6)).astype(np.uint8)
    n = node("Resize", ["x", "roi", "scales"], mode="nearest")
    assert_matches(model(n, {"x": x}, {"roi": EMPTY, "scales": np.array([1, 1, 2, 3], np.float32)}), {"x": x})


def test_integer_upscale_takes_the_copy_path() -> None:
    attrs = resize.ResizeAttrs("nearest", "tf_half_pixel_for_nn", "floor", -0.75, False, 0.0, None, "stretch")
    assert resize.axis_taps(attrs, 3, 8, 16, 2.0, (0.0, 1.0)).repeat == 2
    assert resize.axis_taps(attrs, 3, 8, 12, 1.5, (0.0, 1.0)).repeat == 0


def test_shape_function() -> None:
    shape_fn = lookup("Resize").shape_fn
    scales = np.array([1, 1, 2, 1.5], np.float32)
    spec = KernelSpec("Resize", "r", {}, [None, None, scales], [(-1, 3, 7, -1), (0,), (4,)], [np.dtype(np.float32)] * 3, present=[True] * 3)
    assert shape_fn(spec) == [((-1, 3, 14, -1), np.float32)]
    spec.consts[2] = None  # runtime scales: the rank is all that is known
    assert shape_fn(spec) == [((-1, -1, -1, -1), np.float32)]
    spec.shapes[0] = None
    assert shape_fn(spec) == [(None, np.float32)]


def test_eager_api() -> None:
    x = f32(1, 2, 4, 5)
    scales = np.array([1, 1, 2, 2], np.float32)
    n = node("Resize", ["x", "roi", "scales"], mode="linear")
    ref = run_ort(model(n, {"x": x}, {"roi": EMPTY, "scales": scales}), {"x": x})[0]
    np.testing.assert_allclose(ops.Resize(x, EMPTY, scales, mode="linear"), ref, **TOL)


def _resize_spec(attrs: dict[str, Any], n_inputs: int = 3, dtype: Any = np.float32) -> KernelSpec:
    consts: list[np.ndarray | None] = [None, EMPTY, np.array([1, 1, 2, 2], np.float32)][:n_inputs]
    return KernelSpec("Resize", "up1", attrs, consts, [(1, 2, 3, 4), (0,), (4,)][:n_inputs],
                      [np.dtype(dtype), np.dtype(np.float32), np.dtype(np.float32)][:n_inputs], present=[True] * n_inputs)


@pytest.mark.parametrize("attrs,n_inputs,dtype,message", [
    (dict(mode="area"), 3, np.float32, "mode='area' is not supported; supported: nearest, linear, cubic"),
    (dict(coordinate_transformation_mode="center"), 3, np.float32, "coordinate_transformation_mode='center' is not supported"),
    (dict(nearest_mode="round"), 3, np.float32, "nearest_mode='round' is not supported"),
    (dict(mode="linear", antialias=1), 3, np.float32, r"antialias=1 \(opset 18\) is not supported"),
    (dict(keep_aspect_ratio_policy="fit"), 3, np.float32, "keep_aspect_ratio_policy='fit' is not supported"),
    ({}, 2, np.float32, r"with two inputs \(the opset-10 form"),
    (dict(mode="linear"), 3, np.int32, "mode='linear' on int32 input is not supported"),
])
def test_resize_refuses_naming_the_node(attrs: dict[str, Any], n_inputs: int, dtype: Any, message: str) -> None:
    with pytest.raises(UnsupportedOpError, match=f"node 'up1': Resize {message}"):
        lookup("Resize").factory(_resize_spec(attrs, n_inputs, dtype))


def test_resize_refusal_reaches_the_compiler() -> None:
    x = f32(1, 2, 4, 5)
    n = node("Resize", ["x", "roi", "scales"], mode="linear", antialias=1)
    with pytest.raises(UnsupportedOpError, match="node 'resize_y': Resize antialias=1"):
        run_kubetrt(model(n, {"x": x}, {"roi": EMPTY, "scales": np.array([1, 1, 0.5, 0.5], np.float32)}, opset=18), {"x": x})


@pytest.mark.parametrize("b,mode", list(itertools.product([2, 3], ["DCR", "CRD"])))
def test_depth_to_space(b: int, mode: str) -> None:
    x = f32(2, 2 * b * b, 3, 4)
    assert_matches(model(node("DepthToSpace", ["x"], blocksize=b, mode=mode), {"x": x}, dynamic_batch=True), {"x": x}, ("sequential", "dataflow"))


@pytest.mark.parametrize("b", [2, 3])
def test_space_to_depth(b: int) -> None:
    x = f32(2, 3, 2 * b, 3 * b)
    assert_matches(model(node("SpaceToDepth", ["x"], blocksize=b), {"x": x}, dynamic_batch=True), {"x": x}, ("sequential", "dataflow"))


def test_depth_space_round_trip_and_refusals() -> None:
    x = f32(1, 8, 3, 5)
    np.testing.assert_array_equal(ops.SpaceToDepth(ops.DepthToSpace(x, blocksize=2), blocksize=2), x)
    spec = KernelSpec("DepthToSpace", "d2s", {"blocksize": 2, "mode": "RCD"}, [None], [(1, 8, 3, 5)], [np.dtype(np.float32)], present=[True])
    with pytest.raises(UnsupportedOpError, match="node 'd2s': DepthToSpace mode='RCD' is not supported; supported: DCR, CRD"):
        lookup("DepthToSpace").factory(spec)
    spec = KernelSpec("SpaceToDepth", "s2d", {"blocksize": 0}, [None], [(1, 8, 4, 4)], [np.dtype(np.float32)], present=[True])
    with pytest.raises(UnsupportedOpError, match="node 's2d': SpaceToDepth blocksize=0"):
        lookup("SpaceToDepth").factory(spec)
