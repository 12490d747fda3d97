"""The NHWC convolution-family fast paths (cache-tiled im2col GEMM, one-pass max pooling) give
onnxruntime's numbers, on every tiling shape: bands of rows, several images per tile, ragged ends."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime.kernels import conv_gemm, jit, nhwc, onednn
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(7)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def assert_same_as_ort(model, feeds) -> None:  # type: ignore[no-untyped-def]
    ref = run_ort(model, feeds)
    for executor in ("sequential", "dataflow"):
        for g, r in zip(run_kubetrt(model, feeds, executor), ref):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Tiles of a few KiB, so test-sized tensors take the tiled paths; records which ran.
    oneDNN is switched off: these tests are about the GEMM path it would otherwise replace."""
    monkeypatch.setattr(onednn, "AVAILABLE", False)
    calls: list[str] = []
    for name in ("tiled_conv", "tiled_matmul"):
        real = getattr(conv_gemm, name)
        monkeypatch.setattr(conv_gemm, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    monkeypatch.setattr(conv_gemm, "TILE_BYTES", 6 * 1024)
    monkeypatch.setattr(conv_gemm, "MIN_TILE_ROWS", 8)
    return calls


@pytest.mark.parametrize("activation", ["Relu", "Clip", "Sigmoid"])  # Sigmoid: the NumPy tile epilogue
@pytest.mark.parametrize("batch,hw,stride", [(1, 13, 1), (5, 6, 1), (3, 15, 2)])
def test_tiled_convolution_with_bias_residual_and_activation_matches_ort(small_tiles: list[str], activation: str, batch: int, hw: int, stride: int) -> None:
    # x -> conv(+bias) -> + shortcut conv -> activation -> pointwise conv(+bias) -> activation:
    # residuals, biases and activations land in the tile epilogues
    act = node("Clip", ["sum", "lo", "hi"], ["a"]) if activation == "Clip" else node(activation, ["sum"], ["a"])
    nodes = [
        node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[stride, stride]),
        node("Conv", ["x", "ws"], ["s"], strides=[stride, stride]),
        node("Add", ["c", "s"], ["sum"]),
        act,
        node("Conv", ["a", "wp", "bp"], ["p"]),
        node("Relu", ["p"], ["y"]),
    ]
    consts = {"w": f32(12, 5, 3, 3), "b": f32(12), "ws": f32(12, 5, 1, 1), "wp": f32(7, 12, 1, 1), "bp": f32(7),
              "lo": np.array(-0.5, np.float32), "hi": np.array(1.5, np.float32)}
    feeds = {"x": f32(batch, 5, hw, hw)}
    assert_same_as_ort(make_model(nodes, feeds, ["y"], consts), feeds)
    assert {"tiled_conv", "tiled_matmul"} <= set(small_tiles), f"tiled paths taken: {set(small_tiles)}"


def test_tile_plan_covers_every_output_row_once() -> None:
    for n, oh, ow, row_bytes in [(1, 56, 56, 56 * 576 * 4), (32, 7, 7, 7 * 4608 * 4), (3, 10, 4, 10), (7, 5, 3, 1 << 22)]:
        rows = []
        for b0, b1, i0, i1 in conv_gemm._blocks(n, oh, ow, row_bytes):
            assert b1 == b0 + 1 or (i0, i1) == (0, oh), "a tile spans images only when it takes them whole"
            rows += [(b, i) for b in range(b0, b1) for i in range(i0, i1)]
        assert sorted(rows) == [(b, i) for b in range(n) for i in range(oh)]


POOLS = [
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("MaxPool", {"kernel_shape": [2, 3], "strides": [1, 2], "pads": [0, 1, 1, 0], "dilations": [2, 1]}),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}),
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1, "ceil_mode": 1}),
    ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1}),
    ("GlobalAveragePool", {}),
    ("GlobalMaxPool", {}),
]


@pytest.mark.parametrize("path", ["onednn", "numba"])
@pytest.mark.parametrize("op,attrs", POOLS)
def test_nhwc_pooling_in_a_conv_chain_matches_ort(monkeypatch: pytest.MonkeyPatch, path: str, op: str, attrs: dict) -> None:
    """Pooling between convolutions runs in NHWC; oneDNN's pooling and the numba/NumPy kernels
    (without oneDNN) both give onnxruntime's numbers, ceil-mode overhang and padding counts included."""
    if path == "onednn" and not onednn.AVAILABLE:
        pytest.skip("oneDNN is not installed (the `onednn` extra): its pooling cannot run")
    if path == "numba":
        monkeypatch.setattr(onednn, "AVAILABLE", False)
    monkeypatch.setattr(nhwc, "ONE_THREAD_GLOBAL_AVERAGE", 0)  # the one-thread global average has its own test
    calls: list[str] = []
    real = onednn.Pool2D.bind  # each kernel binds oneDNN's pooling to the input shapes it sees
    monkeypatch.setattr(onednn.Pool2D, "bind", lambda self, *a: calls.append(self.name) or real(self, *a))
    nodes = [node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), node(op, ["c"], ["m"], **attrs),
             node("Conv", ["m", "w2"], ["y"])]
    consts = {"w": f32(6, 3, 3, 3), "w2": f32(4, 6, 1, 1)}
    feeds = {"x": f32(2, 3, 9, 10)}
    assert_same_as_ort(make_model(nodes, feeds, ["y"], consts), feeds)
    include_pad_overhang = attrs.get("count_include_pad") and attrs.get("ceil_mode")
    assert bool(calls) == (path == "onednn" and not include_pad_overhang), f"oneDNN pooling calls: {calls}"


@pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed: oneDNN or NumPy averages")
@pytest.mark.parametrize("batch,hw,channels", [(1, 7, 40), (1, 1, 8), (3, 5, 24)])
def test_a_small_global_average_is_one_pass_on_this_thread(monkeypatch: pytest.MonkeyPatch, batch: int, hw: int, channels: int) -> None:
    calls: list[tuple[int, ...]] = []
    real = jit.global_average_nhwc
    monkeypatch.setattr(jit, "global_average_nhwc", lambda x: calls.append(x.shape) or real(x))
    nodes = [node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), node("GlobalAveragePool", ["c"], ["y"])]
    feeds = {"x": f32(batch, 3, hw, hw)}
    model = make_model(nodes, feeds, ["y"], {"w": f32(channels, 3, 3, 3)})
    assert_same_as_ort(model, feeds)
    assert calls and set(calls) == {(batch, hw, hw, channels)}, calls
    calls.clear()
    monkeypatch.setattr(nhwc, "ONE_THREAD_GLOBAL_AVERAGE", batch * hw * hw * channels - 1)
    assert_same_as_ort(model, feeds)
    assert not calls, "one element over the limit: the pooling call or NumPy's GEMV"


@pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed: the NumPy kernels run instead")
def test_tap_range_is_exactly_the_taps_inside_the_input() -> None:
    for pos in range(6):
        for stride in (1, 2, 3):
            for dil in (1, 2, 3):
                for pad in range(4):
                    for k in (1, 2, 3, 5):
                        for size in (1, 4, 7):
                            inside = [t for t in range(k) if 0 <= pos * stride + t * dil - pad < size]
                            first, end = jit._taps(pos, stride, dil, pad, k, size)
                            assert list(range(first, end)) == inside, (pos, stride, dil, pad, k, size)
