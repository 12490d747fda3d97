"""Winograd F(4x4, 3x3) for 3x3 stride-1 float32 convolutions (runtime/kernels/winograd.py).
Watched by what it changes: the transforms are the minimal filtering algorithm (its float64
reference equals a direct convolution); the kernel equals that reference for edge tiles, odd
sizes, batches, padding on either side, tails of blocks and any team size; plans bind it for the
layers it gains on, and only those, with onnxruntime's results (fp32 tolerance from the one
table, runtime/accuracy.py)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.kernels import omp, winograd
from kubetrt.runtime.onnx_import import from_proto
from onnx_cases import make_model, node, run_ort

pytestmark = pytest.mark.skipif(not winograd.AVAILABLE, reason="Winograd's kernels need the onednn extra, numba and libgomp")
TOL = tolerance_for("fp32", "host")
rng = np.random.default_rng(43)
RELU = ("eltwise_relu", 0.0, 0.0)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def direct(x: np.ndarray, w: np.ndarray, pads: tuple[int, int, int, int]) -> np.ndarray:
    """NHWC x, OIHW w, pads (top, left, bottom, right): a float64 convolution, tap by tap."""
    top, left, bottom, right = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (top, bottom), (left, right), (0, 0)))
    oh, ow = xp.shape[1] - 2, xp.shape[2] - 2
    y = np.zeros((x.shape[0], oh, ow, w.shape[0]))
    for i in range(3):
        for j in range(3):
            y += xp[:, i:i + oh, j:j + ow] @ w[:, :, i, j].T.astype(np.float64)
    return y


@pytest.mark.parametrize("shape", [(1, 8, 8, 16, 16), (2, 9, 13, 32, 16), (1, 6, 5, 16, 32)])
@pytest.mark.parametrize("pads", [(1, 1, 1, 1), (0, 0, 0, 0), (2, 0, 0, 2)])
def test_the_transforms_are_minimal_filtering(shape: tuple[int, ...], pads: tuple[int, int, int, int]) -> None:
    n, h, wd, c, o = shape
    x, w = f32(n, h, wd, c), f32(o, c, 3, 3)
    want = direct(x, w, pads)
    got = winograd.reference(x, w, pads[0], pads[1], *want.shape[1:3])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


CASES = {  # n, h, w, c, o, pads (top, left, bottom, right), activation
    "56x56, SAME": (1, 56, 56, 64, 64, (1, 1, 1, 1), RELU),
    "odd sizes, batch 2": (2, 13, 17, 64, 48, (1, 1, 1, 1), ("eltwise_clip", 0.0, 6.0)),
    "VALID": (1, 12, 12, 64, 32, (0, 0, 0, 0), None),
    "pads on one side": (1, 11, 10, 80, 16, (0, 2, 2, 0), RELU),
    "channels in no whole vector": (1, 14, 15, 72, 40, (1, 1, 1, 1), RELU),
    "many blocks, a short last one": (3, 26, 26, 64, 64, (1, 1, 1, 1), RELU),
    "two blocks, the last one short": (1, 27, 26, 64, 64, (1, 1, 1, 1), RELU),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("team", [1, 2])
def test_the_kernel_is_the_reference_on_any_team(name: str, team: int) -> None:
    n, h, wd, c, o, (top, left, bottom, right), act = CASES[name]
    x, w, bias = f32(n, h, wd, c), f32(o, c, 3, 3) / np.float32(np.sqrt(9 * c)), f32(o)
    oh, ow = h + top + bottom - 2, wd + left + right - 2
    site = winograd.WinogradConv(w, bias, act, name).site(x.shape, oh, ow, top, left)
    with omp.TeamOf(team):
        got = site(x)
    lo, hi = winograd.clamp_of(act)  # type: ignore[misc]
    want = np.clip(direct(x, w, (top, left, bottom, right)) + bias, lo, hi)
    assert got.shape == (n, oh, ow, o) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=TOL.rtol, atol=TOL.atol)


def test_a_site_names_what_it_was_bound_to() -> None:
    site = winograd.WinogradConv(f32(16, 64, 3, 3), None, None, "conv_a").site((1, 8, 8, 64), 8, 8, 1, 1)
    with pytest.raises(ValueError, match=r"Conv conv_a: bound to float32 inputs of shape \[1, 8, 8, 64\], got float32\[1, 9, 8, 64\]"):
        site(f32(1, 9, 8, 64))
    with pytest.raises(ValueError, match="activation .*eltwise_swish.* is not a clamp"):
        winograd.WinogradConv(f32(16, 64, 3, 3), None, ("eltwise_swish", 1.0, 0.0), "conv_b")


def test_only_winograd_s_form_applies() -> None:
    w = f32(64, 64, 3, 3)
    assert winograd.applies(w, 1, [1, 1], [1, 1], RELU, False)
    assert winograd.applies(w, 1, [1, 1], [1, 1], ("eltwise_clip_v2", 0.0, 6.0), False)
    assert not winograd.applies(w, 1, [2, 2], [1, 1], RELU, False)  # stride
    assert not winograd.applies(w, 1, [1, 1], [2, 2], RELU, False)  # dilation
    assert not winograd.applies(f32(64, 32, 3, 3), 2, [1, 1], [1, 1], RELU, False)  # groups
    assert not winograd.applies(w, 1, [1, 1], [1, 1], RELU, True)  # a residual sum
    assert not winograd.applies(w, 1, [1, 1], [1, 1], ("eltwise_swish", 1.0, 0.0), False)
    assert not winograd.applies(w, 1, [1, 1], [1, 1], ("eltwise_relu", 0.1, 0.0), False)  # leaky
    assert winograd.applies(f32(32, 16, 3, 3), 1, [1, 1], [1, 1], RELU, False)  # a small CNN's second layer
    assert not winograd.applies(f32(16, 8, 3, 3), 1, [1, 1], [1, 1], RELU, False)  # few input channels
    assert not winograd.applies(f32(16, 3, 3, 3), 1, [1, 1], [1, 1], RELU, False)  # an RGB input
    assert not winograd.applies(f32(64, 64, 5, 5), 1, [1, 1], [1, 1], RELU, False)
    assert not winograd.applies(w.astype(np.float64), 1, [1, 1], [1, 1], RELU, False)


def test_blocks_even_out_over_the_team() -> None:
    for tiles in (196, 49, 16, 1000):
        per = winograd.block_tiles(64, 64, tiles, 2)
        blocks = -(-tiles // per)
        assert blocks % 2 == 0 and per * (blocks - 1) < tiles <= per * blocks


def test_the_switch_turns_winograd_off() -> None:
    assert winograd.winograd_enabled({}) and not winograd.winograd_enabled({winograd.WINOGRAD_ENV: "0"})
    with pytest.raises(ValueError, match="KUBETRT_WINOGRAD='on': expected 1"):
        winograd.winograd_enabled({winograd.WINOGRAD_ENV: "on"})


def two_convolutions(h: int, c: int, stride: int = 1) -> Any:
    """Conv 3x3 (c to 64) + ReLU, then Conv 3x3 (64 to 32) with a bias, SAME."""
    nodes = [node("Conv", ["x", "w0"], ["a0"], pads=[1, 1, 1, 1], strides=[stride, stride]), node("Relu", ["a0"], ["a"]),
             node("Conv", ["a", "w1", "b1"], ["y"], pads=[1, 1, 1, 1])]
    consts = {"w0": f32(64, c, 3, 3) * 0.1, "w1": f32(32, 64, 3, 3) * 0.05, "b1": f32(32)}
    return make_model(nodes, {"x": f32(1, c, h, h)}, ["y"], consts, dynamic_batch=True)


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[int, ...]]]:
    """The layers plans bind Winograd's form for, by name and input shape."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    site = winograd.WinogradConv.site

    def spy(self: winograd.WinogradConv, x_shape: tuple[int, ...], *args: int) -> winograd.WinogradSite:
        seen.append((self.name, tuple(x_shape)))
        return site(self, x_shape, *args)
    monkeypatch.setattr(winograd.WinogradConv, "site", spy)
    return seen


def run_plan(model: Any, x: np.ndarray) -> list[np.ndarray]:
    plan = RUNTIME.prepare(from_proto(model), {})
    return [plan.run([x])[0] for _ in range(4)]  # the first runs step by step, later ones as a chain


def test_a_plan_runs_its_3x3_layers_as_winograd_s_with_onnxruntime_s_results(bound: list[tuple[str, tuple[int, ...]]]) -> None:
    model, x = two_convolutions(24, 64), f32(2, 64, 24, 24)
    got = run_plan(model, x)
    assert {name for name, _ in bound} == {"conv_a0", "conv_y"}
    want = run_ort(model, {"x": x})[0]
    for y in got:
        np.testing.assert_allclose(y, want, rtol=TOL.rtol, atol=TOL.atol)


def test_plans_keep_the_direct_kernel_where_winograd_would_lose(bound: list[tuple[str, tuple[int, ...]]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = two_convolutions(8, 16)  # 4 tiles; and 16 input channels on the first layer
    run_plan(model, f32(1, 16, 8, 8))
    assert bound == []
    model = two_convolutions(48, 16, stride=2)  # the first layer strided, the second's 36 tiles enough
    x = f32(1, 16, 48, 48)
    got = run_plan(model, x)
    assert [name for name, _ in bound] == ["conv_y"]
    np.testing.assert_allclose(got[-1], run_ort(model, {"x": x})[0], rtol=TOL.rtol, atol=TOL.atol)
    bound.clear()
    monkeypatch.setattr(winograd, "ENABLED", False)
    run_plan(model, x)
    assert bound == []
