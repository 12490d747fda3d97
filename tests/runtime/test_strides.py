"""passes/strides.py: a stride that 1x1 convolutions take moves to the convolutions that make what
they read. Each case runs the host plan against onnxruntime on the model as written, and watches
the kernel calls to see how many pixels each convolution really computed."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from onnx_cases import make_model, node, run_ort, run_plan

rng = np.random.default_rng(31)
C = 16  # channels: whole blocks, so a batch from the blocked threshold up runs the blocked kernels


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def conv(x: str, y: str, k: int, relu: bool = True, residual: str | None = None, stride: int = 1, out: int = C, **attrs: Any) -> list[onnx.NodeProto]:
    """Conv (+ residual Add) (+ Relu) named after `y`, weights `w_<y>`: fusion makes one FusedConv of it."""
    pad = k // 2
    nodes = [node("Conv", [x, f"w_{y}", f"b_{y}"], [f"{y}_c"], strides=[stride, stride],
                  **({"pads": [pad] * 4} if "auto_pad" not in attrs else {}), **attrs)]
    if residual is not None:
        nodes.append(node("Add", [f"{y}_c", residual], [f"{y}_a"]))
    last = nodes[-1].output[0]
    nodes.append(node("Relu", [last], [y]) if relu else node("Identity", [last], [y]))
    return nodes


def model_of(nodes: list[onnx.NodeProto], consts: dict[str, np.ndarray], batch: int, size: int, outputs: list[str]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    feeds = {"x": f32(batch, C, size, size)}
    return make_model(nodes, feeds, outputs, consts), feeds


def conv_consts(specs: dict[str, tuple[int, int, int]]) -> dict[str, np.ndarray]:
    """Weights and biases per conv name: (out channels, in channels, kernel)."""
    consts: dict[str, np.ndarray] = {}
    for y, (o, i, k) in specs.items():
        consts[f"w_{y}"] = f32(o, i, k, k) / float(np.sqrt(i * k * k))
        consts[f"b_{y}"] = f32(o) * 0.1
    return consts


def run_watched(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> tuple[dict[str, list[tuple[int, ...]]], list[str]]:
    """Output shapes of each kernel op's calls, in NHWC or blocked form as the kernels wrote them,
    after the plan's outputs matched onnxruntime's."""
    calls: dict[str, list[tuple[int, ...]]] = {}
    outputs, ops = run_plan(model, feeds, lambda op, args, out: calls.setdefault(op, []).append(tuple(out[0].shape)))
    for got, want in zip(outputs, run_ort(model, feeds)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    return calls, ops


def pixels(shape: tuple[int, ...]) -> int:
    """Spatial positions of an NHWC (N, H, W, C) or blocked (N, C/b, H, W, b) result."""
    return shape[1] * shape[2] if len(shape) == 4 else shape[2] * shape[3]


def stage_transition(size: int) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    """ResNet v1's last block of a stage and the next stage's first: 1x1, 3x3, 1x1 + identity,
    then the two stride-2 1x1 convolutions (main path and shortcut) that read its sum."""
    nodes = (conv("x", "a", 1) + conv("a", "b", 3) + conv("b", "t", 1, residual="x")
             + conv("t", "main", 1, stride=2) + conv("t", "short", 1, relu=False, stride=2, out=2 * C))
    return nodes, conv_consts({"a": (C, C, 1), "b": (C, C, 3), "t": (C, C, 1), "main": (C, C, 1), "short": (2 * C, C, 1)})


@pytest.mark.parametrize("batch,size", [(1, 14), (1, 15), (8, 14), (8, 15)])
def test_the_last_block_computes_only_what_the_strided_readers_read(batch: int, size: int, monkeypatch: pytest.MonkeyPatch, blocked_from_8: int) -> None:
    from kubetrt.runtime.passes import blocked

    monkeypatch.setattr(blocked, "CONVS_PER_REORDER", 1)  # so small a region pays for its reorders: batch 8 runs blocked
    nodes, consts = stage_transition(size)
    calls, ops = run_watched(*model_of(nodes, consts, batch, size, ["main", "short"]))
    convs = calls["FusedConvNHWC"]
    assert all(len(s) == (5 if batch >= 8 else 4) for s in convs)
    half = (size + 1) // 2
    assert [pixels(s) for s in convs].count(size * size) == 1  # only the block's first 1x1 reads the whole input
    assert sorted(pixels(s) for s in convs)[:4] == [half * half] * 4  # the 3x3, the residual 1x1 and both readers
    assert [pixels(s) for s in calls["MaxPoolNHWC"]] == [half * half]  # the identity, subsampled once


def test_a_value_read_whole_elsewhere_keeps_its_strides() -> None:
    nodes, consts = stage_transition(14)
    nodes.append(node("GlobalAveragePool", ["t"], ["pooled"]))
    calls, _ = run_watched(*model_of(nodes, consts, 1, 14, ["main", "short", "pooled"]))
    assert [pixels(s) for s in calls["FusedConvNHWC"]].count(14 * 14) == 3 and "MaxPoolNHWC" not in calls


def test_a_1x1_whose_input_has_other_readers_takes_the_stride_itself() -> None:
    # b is a graph output too, so the 3x3 must compute all of it; the 1x1 after it strides instead
    nodes = conv("x", "b", 3) + conv("b", "t", 1) + conv("t", "main", 1, stride=2)
    calls, _ = run_watched(*model_of(nodes, conv_consts({"b": (C, C, 3), "t": (C, C, 1), "main": (C, C, 1)}), 1, 14, ["main", "b"]))
    assert [pixels(s) for s in calls["FusedConvNHWC"]] == [14 * 14, 7 * 7, 7 * 7] and "MaxPoolNHWC" not in calls


def test_same_padding_is_left_alone() -> None:
    # SAME padding depends on the stride: the 3x3 keeps stride 1 and the reader keeps its stride
    nodes = conv("x", "b", 3, auto_pad="SAME_UPPER") + conv("b", "main", 1, stride=2)
    calls, _ = run_watched(*model_of(nodes, conv_consts({"b": (C, C, 3), "main": (C, C, 1)}), 1, 14, ["main"]))
    assert [pixels(s) for s in calls["FusedConvNHWC"]] == [14 * 14, 7 * 7]
