"""The oneDNN convolution and matmul paths against onnxruntime: padding, strides, dilation, groups,
depthwise, fused bias/residual/activation, batch changes on one compiled model, and threads sharing
a primitive. fp32 tolerance rtol/atol 1e-4, as for the other kernels."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest

from kubetrt.runtime.kernels import onednn, sgemm
from onnx_cases import make_model, node, run_kubetrt, run_ort
from threads import on_threads

needs_onednn = pytest.mark.skipif(not onednn.AVAILABLE, reason="the onednn extra is not installed: the GEMM path runs instead")
rng = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def assert_same_as_ort(model, feeds, executors=("sequential", "dataflow")) -> None:  # type: ignore[no-untyped-def]
    ref = run_ort(model, feeds)
    for executor in executors:
        got = run_kubetrt(model, feeds, executor)
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_dev_environment_has_onednn_on_x86() -> None:
    """The dev extra installs onednn on x86_64, so the model tests against TensorFlow run this path."""
    if platform.machine() != "x86_64":
        pytest.skip("onednn wheels exist for x86_64 only; the GEMM path is the one here")
    if os.environ.get("KUBETRT_CONV", "auto").lower() == "gemm":
        pytest.skip("KUBETRT_CONV=gemm turns oneDNN off for this run")
    assert onednn.AVAILABLE


CASES = {
    "3x3 same, bias, relu": ([node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"], ["y"])],
                             {"w": f32(8, 5, 3, 3), "b": f32(8)}, (5, 9, 11)),
    "stride 2, asymmetric pads, clip 0..6": ([node("Conv", ["x", "w"], ["c"], pads=[0, 1, 1, 0], strides=[2, 2]),
                                              node("Clip", ["c", "lo", "hi"], ["y"])],
                                             {"w": f32(6, 4, 3, 3), "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}, (4, 10, 9)),
    "dilation 2, 5x3 kernel": ([node("Conv", ["x", "w", "b"], ["y"], pads=[4, 2, 4, 2], dilations=[2, 1])],
                               {"w": f32(7, 3, 5, 3), "b": f32(7)}, (3, 12, 8)),
    "two groups": ([node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], group=2), node("Relu", ["c"], ["y"])],
                   {"w": f32(6, 2, 3, 3), "b": f32(6)}, (4, 7, 7)),
    "depthwise stride 2 + clip": ([node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2], group=8),
                                   node("Clip", ["c", "lo", "hi"], ["y"])],
                                  {"w": f32(8, 1, 3, 3), "b": f32(8), "lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}, (8, 11, 11)),
    "same_upper stride 2": ([node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])],
                            {"w": f32(5, 3, 3, 3)}, (3, 8, 7)),
    "residual + relu": ([node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), node("Conv", ["x", "ws"], ["s"]),
                         node("Add", ["c", "s"], ["sum"]), node("Relu", ["sum"], ["y"])],
                        {"w": f32(6, 4, 3, 3), "b": f32(6), "ws": f32(6, 4, 1, 1)}, (4, 6, 6)),
}


MATMUL_CASES = {
    "bias + relu": ([node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["a"]), node("Relu", ["a"], ["y"])],
                    {"w": f32(24, 16), "b": f32(16)}, (24,)),
    "rank 3, bias + residual": ([node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["a"]), node("Add", ["a", "x"], ["y"])],
                                {"w": f32(12, 12), "b": f32(12)}, (5, 12)),
    "clip, no bias": ([node("MatMul", ["x", "w"], ["m"]), node("Clip", ["m", "lo", "hi"], ["y"])],
                      {"w": f32(9, 7), "lo": np.array(-1, np.float32), "hi": np.array(1, np.float32)}, (9,)),
}


@needs_onednn
@pytest.mark.parametrize("kind,case", [("Conv", c) for c in CASES] + [("MatMul", c) for c in MATMUL_CASES])
@pytest.mark.parametrize("batch", [1, 3])
def test_matches_ort(onednn_calls: list, kind: str, case: str, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(onednn, "MIN_DENSE_MACS", 0)  # test-sized matmuls would take the NumPy path
    monkeypatch.setattr(sgemm, "AVAILABLE", False)  # float32 dense layers go to the packed kernel first
    nodes, consts, per_item_shape = (CASES if kind == "Conv" else MATMUL_CASES)[case]
    feeds = {"x": f32(batch, *per_item_shape)}
    assert_same_as_ort(make_model(nodes, feeds, ["y"], consts), feeds)
    assert any(k == kind for k, _ in onednn_calls), f"no {kind} ran through oneDNN"


@needs_onednn
def test_only_matmuls_worth_a_onednn_call_take_it(onednn_calls: list, monkeypatch: pytest.MonkeyPatch) -> None:
    # a 64 -> 10 classifier head stays in NumPy; a 256 -> 512 layer goes to oneDNN
    monkeypatch.setattr(sgemm, "AVAILABLE", False)  # float32 dense layers go to the packed kernel first
    for k, n, expect in ((64, 10, False), (256, 512, True)):
        onednn_calls.clear()
        nodes = [node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["y"])]
        feeds = {"x": f32(1, k)}
        assert_same_as_ort(make_model(nodes, feeds, ["y"], {"w": f32(k, n), "b": f32(n)}), feeds)
        assert bool(onednn_calls) == expect, (k, n, onednn_calls)


@needs_onednn
@pytest.mark.parametrize("batch,onednn_runs_it", [(1, False), (20, True)])
def test_pointwise_convolution_of_1x1_maps_is_a_numpy_gemv_until_the_batch_is_large(batch: int, onednn_runs_it: bool, onednn_calls: list) -> None:
    # a squeeze-and-excitation squeeze: conv -> global pool -> 1x1 conv (+ReLU) on 1x1 maps
    nodes = [node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), node("GlobalAveragePool", ["c"], ["g"]),
             node("Conv", ["g", "w1", "b1"], ["s"]), node("Relu", ["s"], ["y"])]
    feeds = {"x": f32(batch, 8, 5, 5)}
    assert_same_as_ort(make_model(nodes, feeds, ["y"], {"w": f32(64, 8, 3, 3), "w1": f32(64, 64, 1, 1), "b1": f32(64)}), feeds)
    on_one_pixel = [shape for kind, shape in onednn_calls if kind == "Conv" and shape[1:3] == (1, 1)]
    assert bool(on_one_pixel) == onednn_runs_it, onednn_calls
    assert any(shape[1:3] == (5, 5) for _, shape in onednn_calls)  # the 3x3 convolution stays in oneDNN


@needs_onednn
def test_matmul_of_two_activations_keeps_numpy(onednn_calls: list) -> None:
    # attention-style a @ b with no constant operand: nothing to pre-pack, so NumPy runs it
    nodes = [node("MatMul", ["x", "z"], ["m"]), node("Relu", ["m"], ["y"])]
    feeds = {"x": f32(2, 3, 8), "z": f32(2, 8, 5)}
    assert_same_as_ort(make_model(nodes, feeds, ["y"]), feeds)
    assert onednn_calls == []


@needs_onednn
def test_float_dense_is_an_optimized_inner_product_with_its_post_ops() -> None:
    # (K, N) weights described as an (N, K) inner product: a 3-D input's rows, bias, residual and
    # activation all land in one call, and the library picks a real kernel, not its reference one
    w, bias = f32(96, 40), f32(40)
    dense = onednn.Dense(w, bias, ("eltwise_relu", 0.0, 0.0), residual=True, name="fc")
    a, residual = f32(4, 8, 96), f32(4, 8, 40)
    got = dense(a, residual)
    np.testing.assert_allclose(got, np.maximum(a @ w + bias + residual, 0), rtol=1e-5, atol=1e-5)
    assert dense.inner_product
    assert not dense.implementation((32,)).startswith("ref"), dense.implementation((32,))


@needs_onednn
def test_matmul_with_the_wrong_inner_size_is_a_clear_error() -> None:
    dense = onednn.Dense(f32(6, 4), None, None, residual=False, name="fc")
    with pytest.raises(ValueError, match=r"MatMul fc: expected a float32 input of shape \[\.\.\., 6\]"):
        dense(f32(3, 5))


@needs_onednn
def test_residual_that_is_also_an_output_is_not_overwritten(onednn_calls: list) -> None:
    # s feeds the fused residual sum and is itself a graph output: the sum must not land in s
    nodes = [node("Conv", ["x", "ws"], ["s"]), node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             node("Add", ["c", "s"], ["sum"]), node("Relu", ["sum"], ["y"])]
    feeds = {"x": f32(2, 3, 6, 6)}
    assert_same_as_ort(make_model(nodes, feeds, ["y", "s"], {"w": f32(4, 3, 3, 3), "ws": f32(4, 3, 1, 1)}), feeds)
    assert len(onednn_calls) >= 4


@needs_onednn
@pytest.mark.parametrize("also_output", [False, True])
def test_a_dying_residual_takes_the_sum_in_place(also_output: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # r dies at the fused sum, whose result then lands in r's own buffer: no copy of the residual;
    # r read afterwards (here: a graph output) keeps its values
    shared: list[bool] = []
    real = onednn.Site.__call__

    def spy(self: onednn.Site, x, residual=None, overwrite_residual=False):  # type: ignore[no-untyped-def]
        out = real(self, x, residual, overwrite_residual)
        if residual is not None:
            shared.append(np.shares_memory(out, residual))
        return out
    monkeypatch.setattr(onednn.Site, "__call__", spy)
    nodes = [node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"], ["r"]),
             node("Conv", ["r", "w2"], ["e"]), node("Conv", ["e", "w3"], ["d"], pads=[1, 1, 1, 1]), node("Add", ["d", "r"], ["y"])]
    feeds = {"x": f32(2, 8, 6, 6)}
    consts = {"w1": f32(8, 8, 3, 3), "w2": f32(8, 8, 1, 1), "w3": f32(8, 8, 3, 3)}
    model = make_model(nodes, feeds, ["y", "r"] if also_output else ["y"], consts)
    assert_same_as_ort(model, feeds, executors=("sequential",))
    assert shared == [not also_output]


@needs_onednn
def test_activation_onednn_cannot_fuse_keeps_the_gemm_path(onednn_calls: list) -> None:
    nodes = [node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), node("Sigmoid", ["c"], ["y"])]
    feeds = {"x": f32(2, 3, 5, 5)}
    assert_same_as_ort(make_model(nodes, feeds, ["y"], {"w": f32(4, 3, 3, 3), "b": f32(4)}), feeds)
    assert onednn_calls == []


@needs_onednn
def test_one_model_serves_several_batch_sizes() -> None:
    """Primitives are per input shape; the reordered weights are shared between them."""
    from kubetrt.runtime.devices.host import RUNTIME
    from kubetrt.runtime.onnx_import import from_proto

    consts = {"w": f32(8, 4, 3, 3), "b": f32(8)}
    nodes = [node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), node("Relu", ["c"], ["y"])]
    model = make_model(nodes, {"x": f32(1, 4, 6, 6)}, ["y"], consts, dynamic_batch=True)
    exe = RUNTIME.prepare(from_proto(model), {"executor": "sequential"})
    for batch in (1, 5, 1, 2):
        x = f32(batch, 4, 6, 6)
        np.testing.assert_allclose(exe.run([x])[0], run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-4)


@needs_onednn
def test_threads_sharing_one_convolution_get_their_own_results() -> None:
    w, bias = f32(16, 8, 3, 3), f32(16)
    conv = onednn.Conv2D(w, bias, 1, [1, 1], [1, 1], ("eltwise_relu", 0.0, 0.0), residual=False)
    inputs = [f32(2, 12, 12, 8) for _ in range(6)]
    expected = [conv(x, 12, 12, [1, 1], [1, 1]).copy() for x in inputs]
    got: dict[int, list[np.ndarray]] = {}

    def work(t: int) -> None:
        got[t] = [conv(x, 12, 12, [1, 1], [1, 1]) for x in inputs for _ in range(3)][::3]
    on_threads(work, list(range(4)))
    for t in range(4):
        for g, e in zip(got[t], expected):
            np.testing.assert_array_equal(g, e)


@needs_onednn
def test_residual_convolution_without_its_residual_is_a_clear_error() -> None:
    conv = onednn.Conv2D(f32(4, 3, 1, 1), None, 1, [1, 1], [1, 1], None, residual=True)
    with pytest.raises(ValueError, match="residual"):
        conv(f32(1, 5, 5, 3), 5, 5, [0, 0], [0, 0])


def test_kubetrt_conv_gemm_turns_onednn_off() -> None:
    code = "from kubetrt.runtime.kernels import onednn; print(onednn.AVAILABLE)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KUBETRT_CONV": "gemm"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@needs_onednn
@pytest.mark.parametrize("given,expected", [(None, "10000"), ("500", "500")])
def test_openmp_spin_is_shortened_unless_the_operator_set_it(given: str | None, expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    code = "import os; from kubetrt.runtime.kernels import onednn; print(onednn.AVAILABLE, os.environ['GOMP_SPINCOUNT'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", expected]


@needs_onednn
@pytest.mark.parametrize("layout,shape", [("nhwc", (1, 5, 5, 4)), ("nchw", (1, 4, 5, 5))])
def test_convolution_with_the_wrong_channel_count_is_a_clear_error(layout: str, shape: tuple[int, ...]) -> None:
    conv = onednn.Conv2D(f32(6, 3, 1, 1), None, 1, [1, 1], [1, 1], None, residual=False, layout=layout, name="c1")
    with pytest.raises(ValueError, match="Conv c1: input has 4 channels, weights expect 3"):
        conv(f32(*shape), 5, 5, [0, 0], [0, 0])


DW_KEY = (1, 12, 12, 12, 12, 1, 1, 1, 1, onednn._PLAIN)  # one 12x12 NHWC image, SAME padding


def depthwise(w: np.ndarray, b: np.ndarray) -> onednn.Conv2D:
    return onednn.Conv2D(w, b, w.shape[0], [1, 1], [1, 1], ("eltwise_relu", 0.0, 0.0), False, name="dw")


def depthwise_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    y = sum(xp[:, i:i + 12, j:j + 12] * w[:, 0, i, j] for i in range(3) for j in range(3))
    return np.maximum(y + b, 0)


@needs_onednn
@pytest.mark.parametrize("offered", [True, False])
def test_a_float_depthwise_convolution_takes_the_preferred_kernel(offered: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    w, b, x = f32(32, 1, 3, 3) * 0.3, f32(32), f32(1, 12, 12, 32)
    with monkeypatch.context() as m:
        m.setattr(onednn, "PREFERRED_OVER", {})
        first = depthwise(w, b).implementation(DW_KEY)  # oneDNN's own first choice
    prefix = first.split(":")[0] + ":"
    wanted = onednn.PREFERRED_OVER.get(prefix)
    if not offered:  # a preference oneDNN cannot meet leaves its first choice
        monkeypatch.setattr(onednn, "PREFERRED_OVER", {prefix: "no_such_kernel:"})
        wanted = None
    conv = depthwise(w, b)
    got = conv.bind(x.shape, 12, 12, [1, 1], [1, 1])(x)
    name = conv.implementation(DW_KEY)
    assert name.startswith(wanted) if wanted else name == first, (first, name)
    np.testing.assert_allclose(got, depthwise_reference(x, w, b), rtol=1e-4, atol=1e-4)
