"""passes/concat_chains.py: a chain of channel Concats (a DenseNet block) grows one buffer, each
Concat writing only its new channels, and the batch normalizations read the chain's views where
they lie. Checked against onnxruntime on the model as written, and by watching the kernels' calls."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.kernels import channel_affine, jit
from onnx_cases import make_model, node, run_ort, run_plan

rng = np.random.default_rng(5)
GROWTH = 4


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def dense_block(layers: int, stem: int = 8) -> tuple[list[Any], dict[str, np.ndarray], str]:
    """Keras' DenseNet block as a converter hands it over (NCHW after the input's Transpose): each
    layer is BN (Mul, Add) -> ReLU -> 1x1 conv -> ReLU -> 3x3 conv, its output concatenated to its input."""
    nodes = [node("Transpose", ["x"], ["t"], perm=[0, 3, 1, 2]), node("Conv", ["t", "w0"], ["h0"], pads=[1, 1, 1, 1])]
    consts = {"w0": f32(stem, 3, 3, 3)}
    width, h = stem, "h0"
    for i in range(layers):
        consts |= {f"s{i}": np.abs(f32(1, width, 1, 1)) + 0.5, f"b{i}": f32(1, width, 1, 1),
                   f"wa{i}": f32(8, width, 1, 1) * 0.3, f"wb{i}": f32(GROWTH, 8, 3, 3) * 0.3}
        nodes += [node("Mul", [h, f"s{i}"], [f"m{i}"]), node("Add", [f"m{i}", f"b{i}"], [f"n{i}"]),
                  node("Relu", [f"n{i}"], [f"r{i}"]), node("Conv", [f"r{i}", f"wa{i}"], [f"a{i}"]),
                  node("Relu", [f"a{i}"], [f"ra{i}"]), node("Conv", [f"ra{i}", f"wb{i}"], [f"g{i}"], pads=[1, 1, 1, 1]),
                  node("Concat", [h, f"g{i}"], [f"h{i + 1}"], axis=1)]
        width, h = width + GROWTH, f"h{i + 1}"
    return nodes, consts, h


def watched(model: Any, feeds: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[tuple[str, tuple, tuple]]]:
    calls: list[tuple[str, tuple, tuple]] = []
    got, _ = run_plan(model, feeds, on_step=lambda op, args, outs: calls.append((op, args, outs)))
    return got, calls


def matches_ort(model: Any, batch: int, size: int = 6) -> list[tuple[str, tuple, tuple]]:
    feeds = {"x": f32(batch, size, size, 3)}
    got, calls = watched(model, feeds)
    for g, want in zip(got, run_ort(model, feeds)):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    return calls


@pytest.mark.parametrize("batch", [1, 3])
def test_a_dense_block_grows_one_buffer(batch: int) -> None:
    nodes, consts, last = dense_block(4)
    head = [node("Transpose", [last], ["y"], perm=[0, 2, 3, 1])]
    calls = matches_ort(make_model(nodes + head, {"x": f32(1, 6, 6, 3)}, ["y"], consts, dynamic_batch=True), batch)
    concats = [outs[0] for op, _, outs in calls if op == "Concat"]
    assert len(concats) == 4
    final = concats[-1]
    assert final.flags.c_contiguous and final.shape[-1] == 8 + 4 * GROWTH
    for view in concats[:-1]:  # the earlier ones are the final one's leading channels, not copies
        assert not view.flags.c_contiguous and np.shares_memory(view, final)
        np.testing.assert_array_equal(view, final[..., :view.shape[-1]])
    # each layer's batch normalization read its Concat's view as it lies, without a copy
    strided = [args[0] for op, args, _ in calls if op == "MulAdd" and not args[0].flags.c_contiguous]
    assert len(strided) == 3 and all(np.shares_memory(a, final) for a in strided)


def test_a_view_read_by_a_convolution_ends_the_chain() -> None:
    nodes, consts, last = dense_block(3)
    # h2 also goes to a convolution directly, which needs its channels contiguous: the chain stops at h2
    consts["wc"] = f32(2, 8 + 2 * GROWTH, 1, 1)
    nodes += [node("Conv", ["h2", "wc"], ["side"]), node("Transpose", ["side"], ["y2"], perm=[0, 2, 3, 1]),
              node("Transpose", [last], ["y"], perm=[0, 2, 3, 1])]
    calls = matches_ort(make_model(nodes, {"x": f32(1, 6, 6, 3)}, ["y", "y2"], consts, dynamic_batch=True), 2)
    concats = [outs[0] for op, _, outs in calls if op == "Concat"]
    assert [c.flags.c_contiguous for c in concats] == [False, True, True]
    assert np.shares_memory(concats[0], concats[1]) and not np.shares_memory(concats[1], concats[2])


def test_an_in_place_reader_of_the_last_waits_for_the_earlier_views_readers() -> None:
    """The ReLU of the final Concat may not write in place while a later normalization still reads
    an earlier view of the same buffer: the values it reads would have lost their negatives."""
    nodes, consts, last = dense_block(2)
    consts |= {"k": f32(1, 8 + GROWTH, 1, 1), "c": f32(1, 8 + GROWTH, 1, 1)}
    nodes += [node("Relu", [last], ["rl"]), node("Transpose", ["rl"], ["y"], perm=[0, 2, 3, 1]),
              node("Mul", ["h1", "k"], ["late_m"]), node("Add", ["late_m", "c"], ["late"]),
              node("Transpose", ["late"], ["y2"], perm=[0, 2, 3, 1])]
    calls = matches_ort(make_model(nodes, {"x": f32(1, 6, 6, 3)}, ["y", "y2"], consts, dynamic_batch=True), 2)
    concats = [outs[0] for op, _, outs in calls if op == "Concat"]
    assert np.shares_memory(concats[0], concats[1])  # the chain still grew; the ReLU wrote elsewhere


def test_an_intermediate_output_is_not_a_view() -> None:
    nodes, consts, last = dense_block(2)
    nodes += [node("Transpose", [last], ["y"], perm=[0, 2, 3, 1]), node("Transpose", ["h1"], ["y1"], perm=[0, 2, 3, 1])]
    calls = matches_ort(make_model(nodes, {"x": f32(1, 6, 6, 3)}, ["y", "y1"], consts, dynamic_batch=True), 1)
    concats = [outs[0] for op, _, outs in calls if op == "Concat"]
    assert all(c.flags.c_contiguous for c in concats)


def test_row_stride_and_place_columns() -> None:
    buf = np.zeros((2, 3, 4, 10), np.float32)
    view = buf[..., 2:6]
    assert jit.row_stride(view) == 10 and jit.row_stride(buf[..., :3]) == 10 and jit.row_stride(buf[:, :, 1]) == 40
    src = f32(2, 3, 4, 4)
    jit.place_columns(src, buf, 2)
    np.testing.assert_array_equal(buf[..., 2:6], src)
    assert not buf[..., :2].any() and not buf[..., 6:].any()
    assert jit.row_stride(buf[:, ::2, :, :3]) is None  # rows not evenly spaced
    assert jit.row_stride(buf[..., ::2]) is None and jit.row_stride(buf[:, :, ::-1, :3]) is None
    assert jit.row_stride(np.broadcast_to(f32(3), (4, 3))) is None  # one row seen four times
    scale, shift = np.abs(f32(4)), f32(4)
    np.testing.assert_allclose(jit.rows_affine(view, scale, shift, relu=True),
                               np.maximum(src * scale + shift, 0), rtol=1e-6, atol=1e-6)


def test_a_large_blocks_normalizations_run_on_the_team(team_affine_rows: list[int]) -> None:
    """From channel_affine.TEAM_MIN_ELEMENTS up, each layer's normalization reads its view of the
    buffer on the OpenMP team, and the block still matches onnxruntime."""
    nodes, consts, last = dense_block(3)
    head = [node("Transpose", [last], ["y"], perm=[0, 2, 3, 1])]
    size = 48  # 48x48 pixels of 8 channels: the first normalization's 18432 elements reach the team
    assert size * size * 8 >= channel_affine.TEAM_MIN_ELEMENTS
    calls = matches_ort(make_model(nodes + head, {"x": f32(1, size, size, 3)}, ["y"], consts, dynamic_batch=True), 1, size)
    strided = [args[0] for op, args, _ in calls if op == "MulAdd" and not args[0].flags.c_contiguous]
    assert len(strided) == 2
    # the stem's contiguous 8 channels in rows joined to 256 floats, then the views' pixel rows
    assert team_affine_rows == [size * size * 8 // 256, size * size, size * size]
