"""A convolution and the pooling that reads it (passes/conv_pool.py). A 3x3 convolution's 2x2 max
pooling made in its Winograd tiles (kernels/winograd.py): the pooled kernel equals the
convolution's clamped results pooled (edge tiles, a last tile one pooled column wide, batches, any
team size); plans of Conv + ReLU + MaxPool run one pooled step with onnxruntime's results; every
pattern the pass must leave alone (a second reader, other windows, odd sides, too few tiles,
Winograd off) keeps its MaxPool and onnxruntime's results. An average pooling of a 1x1
convolution's results runs first: the convolution then reads the pooled pixels, with
onnxruntime's results, and the patterns that do not commute keep their order. fp32 tolerance from
the one table (runtime/accuracy.py)."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.kernels import nhwc, omp, winograd
from kubetrt.runtime.kernels.registry import KernelSpec, lookup, op_def
from kubetrt.runtime.onnx_import import from_proto
from kubetrt.runtime.passes import optimize
from onnx_cases import make_model, node, run_ort, run_plan

pytestmark = pytest.mark.skipif(not winograd.AVAILABLE, reason="Winograd's kernels need the onednn extra, numba and libgomp")
TOL = tolerance_for("fp32", "host")
rng = np.random.default_rng(45)
RELU = ("eltwise_relu", 0.0, 0.0)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def pooled(y: np.ndarray) -> np.ndarray:
    n, h, w, c = y.shape
    return y[:, :h // 2 * 2, :w // 2 * 2].reshape(n, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


CASES = {  # n, h, w, c, o, pad, activation
    "32x32, SAME (a small CNN's second layer)": (1, 32, 32, 16, 32, 1, RELU),
    "a last tile one pooled column wide, batch 2": (2, 14, 18, 32, 16, 1, ("eltwise_clip", 0.0, 6.0)),
    "VALID, no activation": (1, 12, 14, 16, 40, 0, None),
    "many blocks, a short last one": (3, 26, 26, 64, 64, 1, RELU),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("team", [1, 2])
def test_the_pooled_kernel_is_the_pooled_convolution(name: str, team: int) -> None:
    n, h, wd, c, o, pad, act = CASES[name]
    x, w, bias = f32(n, h, wd, c), f32(o, c, 3, 3) / np.float32(np.sqrt(9 * c)), f32(o)
    oh, ow = h + 2 * pad - 2, wd + 2 * pad - 2
    conv = winograd.WinogradConv(w, bias, act, name)
    with omp.TeamOf(team):
        whole = conv.site(x.shape, oh, ow, pad, pad)(x)
        got = conv.site(x.shape, oh, ow, pad, pad, pool=True)(x)
    assert got.shape == (n, oh // 2, ow // 2, o) and got.dtype == np.float32
    np.testing.assert_allclose(got, pooled(whole), rtol=TOL.rtol, atol=TOL.atol)


def test_a_pooled_kernel_refuses_odd_sides() -> None:
    conv = winograd.WinogradConv(f32(16, 16, 3, 3), None, RELU, "conv_odd")
    with pytest.raises(ValueError, match="Conv conv_odd: a 2x2 pooling of 15x16 results needs even sides"):
        conv.call((1, 15, 16, 16), 15, 16, 1, 1, pool=True)


def conv_pool(h: int, w: int, c: int = 16, pool: dict[str, Any] | None = None, also_out: bool = False) -> onnx.ModelProto:
    """Conv 3x3 (c to 32, SAME) + bias + ReLU, then MaxPool (2x2, stride 2 unless `pool` says)."""
    attrs = pool or {"kernel_shape": [2, 2], "strides": [2, 2]}
    nodes = [node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"], ["a"]),
             node("MaxPool", ["a"], ["y"], **attrs)]
    consts = {"w": f32(32, c, 3, 3) * 0.1, "b": f32(32)}
    return make_model(nodes, {"x": f32(1, c, h, w)}, ["y", "a"] if also_out else ["y"], consts, dynamic_batch=True)


def ops_after_optimizing(model: onnx.ModelProto) -> list[tuple[str, bool]]:
    return [(n.op, bool(n.attrs.get(nhwc.MAX_POOL_2X2))) for n in optimize(from_proto(model)).nodes]


@pytest.fixture
def pooled_sites(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each Winograd site a plan binds pools its results."""
    seen: list[bool] = []
    site = winograd.WinogradConv.site

    def spy(self: winograd.WinogradConv, *args: Any) -> winograd.WinogradSite:
        made = site(self, *args)
        seen.append(made.shape[1] < args[1])  # fewer result rows than the convolution's
        return made
    monkeypatch.setattr(winograd.WinogradConv, "site", spy)
    return seen


@pytest.mark.parametrize("batch", [1, 3])
def test_a_plan_pools_in_the_tiles_with_onnxruntime_s_results(batch: int, pooled_sites: list[bool]) -> None:
    model = conv_pool(24, 28)
    assert [op for op, _ in ops_after_optimizing(model)].count("MaxPoolNHWC") == 0
    assert ("FusedConvNHWC", True) in ops_after_optimizing(model)
    x = f32(batch, 16, 24, 28)
    for _ in range(3):  # the first call runs step by step, later ones as a chain
        (got,), ops = run_plan(model, {"x": x})
        np.testing.assert_allclose(got, run_ort(model, {"x": x})[0], rtol=TOL.rtol, atol=TOL.atol)
    assert "MaxPoolNHWC" not in ops and pooled_sites and all(pooled_sites)


LEFT_ALONE = {
    "the convolution's result is read elsewhere too": dict(also_out=True),
    "3x3 windows": dict(pool={"kernel_shape": [3, 3], "strides": [2, 2]}),
    "stride 1": dict(pool={"kernel_shape": [2, 2], "strides": [1, 1]}),
    "padded windows": dict(pool={"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    "ceil mode": dict(pool={"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    "odd sides": dict(h=25),
    "too few tiles at batch 1": dict(h=8, w=8),
}


@pytest.mark.parametrize("name", LEFT_ALONE)
def test_the_pass_leaves_other_poolings_alone_with_onnxruntime_s_results(name: str) -> None:
    case = dict(LEFT_ALONE[name])
    h, w = case.pop("h", 24), case.pop("w", 28)  # 42 tiles at batch 1: only the case's own reason refuses
    model = conv_pool(h, w, **case)
    ops = ops_after_optimizing(model)
    assert ("MaxPoolNHWC", False) in ops and not any(pooling for _, pooling in ops)
    x = f32(2, 16, h, w)
    got, _ = run_plan(model, {"x": x})
    for g, want in zip(got, run_ort(model, {"x": x})):
        np.testing.assert_allclose(g, want, rtol=TOL.rtol, atol=TOL.atol)


def test_with_winograd_off_the_pooling_stays_its_own_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(winograd, "ENABLED", False)
    assert ("MaxPoolNHWC", False) in ops_after_optimizing(conv_pool(24, 28))


@pytest.mark.parametrize("onednn_on", [True, False])
def test_a_pooled_convolution_off_the_tiles_pools_after_it(onednn_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's own fallback, for a marked node Winograd does not take (a 5x5 one here): the
    convolution, then the pooling, in the one step."""
    from kubetrt.runtime.kernels import onednn

    if not onednn_on:
        monkeypatch.setattr(onednn, "AVAILABLE", False)
    x, w, b = f32(2, 11, 12, 8), f32(8, 8, 5, 5) * 0.1, f32(8)
    shapes = [x.shape, w.shape, b.shape]
    spec = KernelSpec("FusedConvNHWC", "conv5", {"pads": [2, 2, 2, 2], nhwc.MAX_POOL_2X2: 1}, [None, w, b], shapes,
                      [np.dtype(np.float32)] * 3, present=[True, True, True])
    plain = KernelSpec("FusedConvNHWC", "conv5", {"pads": [2, 2, 2, 2]}, [None, w, b], shapes, [np.dtype(np.float32)] * 3,
                       present=[True, True, True])
    kernel = lookup("FusedConvNHWC")
    assert op_def("FusedConvNHWC").shape_fn(spec) == [((2, 5, 6, 8), np.dtype(np.float32))]
    (got,) = kernel.factory(spec)(x, w, b)
    (whole,) = kernel.factory(plain)(x, w, b)
    assert got.shape == (2, 5, 6, 8)
    np.testing.assert_array_equal(got, pooled(whole))


def pointwise_pool(pool: str = "AveragePool", pool_attrs: dict[str, Any] | None = None, conv_attrs: dict[str, Any] | None = None,
                   kernel: int = 1, relu: bool = False, also_out: bool = False) -> onnx.ModelProto:
    """Conv (24 to 16, `kernel` square) + bias [+ ReLU], then a pooling (2x2, stride 2 unless `pool_attrs` says)."""
    nodes = [node("Conv", ["x", "w", "b"], ["c"], **(conv_attrs or {}))]
    if relu:
        nodes.append(node("Relu", ["c"], ["r"]))
    nodes.append(node(pool, ["r" if relu else "c"], ["y"], **(pool_attrs or {"kernel_shape": [2, 2], "strides": [2, 2]})))
    consts = {"w": f32(16, 24, kernel, kernel) * 0.2, "b": f32(16)}
    return make_model(nodes, {"x": f32(1, 24, 12, 10)}, ["y", "c"] if also_out else ["y"], consts, dynamic_batch=True)


def conv_inputs(model: onnx.ModelProto, x: np.ndarray) -> list[tuple[int, ...]]:
    """The shapes the plan's convolutions read, after checking its outputs against onnxruntime's."""
    seen: list[tuple[int, ...]] = []
    got, _ = run_plan(model, {"x": x}, on_step=lambda op, args, out: seen.append(args[0].shape) if op == "FusedConvNHWC" else None)
    for g, want in zip(got, run_ort(model, {"x": x})):
        np.testing.assert_allclose(g, want, rtol=TOL.rtol, atol=TOL.atol)
    return seen


@pytest.mark.parametrize("batch", [1, 3])
def test_a_pointwise_convolution_reads_the_pooled_pixels_with_onnxruntime_s_results(batch: int) -> None:
    model = pointwise_pool()
    ops = [op for op, _ in ops_after_optimizing(model)]
    assert ops.index("AveragePoolNHWC") < ops.index("FusedConvNHWC")
    assert conv_inputs(model, f32(batch, 24, 12, 10)) == [(batch, 6, 5, 24)]


NOT_COMMUTING = {
    "an activation between": dict(relu=True),
    "a 3x3 convolution": dict(kernel=3, conv_attrs={"pads": [1, 1, 1, 1]}),
    "a strided convolution": dict(conv_attrs={"strides": [2, 2]}),
    "padded windows counting the padding": dict(pool_attrs={"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                                            "count_include_pad": 1}),
    "a max pooling": dict(pool="MaxPool"),
    "the convolution's result is read elsewhere too": dict(also_out=True),
}


@pytest.mark.parametrize("name", NOT_COMMUTING)
def test_a_convolution_the_pooling_does_not_commute_with_keeps_its_order(name: str) -> None:
    model = pointwise_pool(**NOT_COMMUTING[name])
    shapes = conv_inputs(model, f32(2, 24, 12, 10))
    assert shapes == [(2, 12, 10, 24)]  # the whole image, before any pooling
