"""Indexing kernels (CumSum, GatherND, ScatterND, ScatterElements, OneHot, Trilu, ReverseSequence,
NonMaxSuppression) against onnxruntime, in the forms tf2onnx emits and the spec's defaults."""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx
import pytest

from kubetrt.runtime import UnsupportedOpError, ops
from kubetrt.runtime.kernels import indexing
from kubetrt.runtime.kernels.registry import KernelSpec, lookup
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(7)
TOL = dict(rtol=1e-4, atol=1e-5)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def model(n: onnx.NodeProto, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray] | None = None,
          opset: int = 17, dynamic_batch: bool = False) -> onnx.ModelProto:
    """A single-node model; opset above the default for ops whose newer forms need it (reductions max/min)."""
    m = make_model([n], feeds, list(n.output), consts or {}, dynamic_batch=dynamic_batch)
    m.opset_import[0].version = opset
    return m


def assert_matches(m: onnx.ModelProto, feeds: dict[str, np.ndarray], executors: tuple[str, ...] = ("sequential", "dataflow")) -> None:
    ref = run_ort(m, feeds)
    for executor in executors:
        got = run_kubetrt(m, feeds, executor)
        assert len(got) == len(ref)
        for g, r in zip(got, ref):
            assert g.dtype == r.dtype and g.shape == r.shape, (executor, g.dtype, g.shape, r.dtype, r.shape)
            if r.dtype.kind == "f":
                np.testing.assert_allclose(g, r, **TOL, err_msg=executor)
            else:
                np.testing.assert_array_equal(g, r, err_msg=executor)


def scatter_nd_indices(shape: tuple[int, ...], k: int, n: int, unique: bool) -> np.ndarray:
    """n index tuples into the first k dims, some negative; unique where the reduction is none
    (duplicate targets are undefined by the spec then)."""
    cells = np.array(np.unravel_index(rng.choice(int(np.prod(shape[:k])), n, replace=not unique), shape[:k])).T
    neg = rng.random(cells.shape) < 0.3
    return np.where(neg, cells - np.array(shape[:k]), cells).astype(np.int64)


def scatter_elements_indices(shape: tuple[int, ...], dim: int, dtype: type = np.int64) -> np.ndarray:
    """Indices into an axis of size `dim`, negative ones included, duplicates likely (reductions)."""
    return rng.integers(-dim, dim, size=shape).astype(dtype)


BOOL = rng.random((4, 5)) > 0.5

# (id, node, runtime inputs, constant initializers, opset)
CASES: list[tuple[str, onnx.NodeProto, dict[str, np.ndarray], dict[str, np.ndarray], int]] = [
    # CumSum: tf.cumsum(x, axis, exclusive, reverse) with the axis a constant (int32 or int64)
    *[(f"cumsum_ex{e}_rev{r}", node("CumSum", ["x", "a"], exclusive=e, reverse=r), {"x": f32(3, 5, 4)}, {"a": np.array(1, np.int32)}, 17)
      for e in (0, 1) for r in (0, 1)],
    ("cumsum_axis_last_neg", node("CumSum", ["x", "a"]), {"x": f32(2, 7)}, {"a": i64(-1)}, 17),
    ("cumsum_axis0_excl_rev_1d_axis", node("CumSum", ["x", "a"], exclusive=1, reverse=1), {"x": f32(6, 3)}, {"a": i64(0)}, 17),
    ("cumsum_int32", node("CumSum", ["x", "a"], exclusive=1), {"x": rng.integers(-50, 50, (4, 6)).astype(np.int32)}, {"a": np.array(1, np.int64)}, 17),
    ("cumsum_int64_rev", node("CumSum", ["x", "a"], reverse=1), {"x": rng.integers(-50, 50, (4, 6))}, {"a": np.array(0, np.int64)}, 17),
    ("cumsum_float64", node("CumSum", ["x", "a"]), {"x": f32(3, 4).astype(np.float64)}, {"a": np.array(1, np.int32)}, 17),
    ("cumsum_runtime_axis", node("CumSum", ["x", "a"]), {"x": f32(3, 4), "a": np.array(0, np.int64)}, {}, 17),
    ("cumsum_len1_excl", node("CumSum", ["x", "a"], exclusive=1), {"x": f32(3, 1)}, {"a": np.array(1, np.int64)}, 17),
    # GatherND: tf.gather_nd(params, indices, batch_dims)
    ("gathernd_rows", node("GatherND", ["x", "i"]), {"x": f32(5, 4, 3)}, {"i": np.array([[1], [-1], [0]], np.int64)}, 17),
    ("gathernd_pairs", node("GatherND", ["x", "i"]), {"x": f32(5, 4, 3)}, {"i": np.array([[[1, 2], [4, -1]], [[0, 0], [-5, 3]]], np.int64)}, 17),
    ("gathernd_elements", node("GatherND", ["x", "i"]), {"x": f32(5, 4, 3)}, {"i": np.array([[4, 3, 2], [0, -4, 1]], np.int64)}, 17),
    ("gathernd_batch1", node("GatherND", ["x", "i"], batch_dims=1), {"x": f32(3, 5, 4)}, {"i": rng.integers(0, 4, (3, 2, 2))}, 17),
    ("gathernd_batch1_scalar_index", node("GatherND", ["x", "i"], batch_dims=1), {"x": f32(3, 5)}, {"i": rng.integers(-5, 5, (3, 1))}, 17),
    ("gathernd_batch2", node("GatherND", ["x", "i"], batch_dims=2), {"x": f32(2, 3, 5, 4)}, {"i": rng.integers(0, 4, (2, 3, 6, 1))}, 17),
    ("gathernd_bool", node("GatherND", ["x", "i"]), {"x": BOOL}, {"i": np.array([[3, 1], [0, 4]], np.int64)}, 17),
    ("gathernd_int64_runtime_indices", node("GatherND", ["x", "i"]), {"x": rng.integers(0, 9, (4, 3)), "i": np.array([[2], [3]], np.int64)}, {}, 17),
    # ScatterND: tensor_scatter_nd_update / _add / _max / _min, scatter_nd onto zeros
    ("scatternd_update_rows", node("ScatterND", ["x", "i", "u"]), {"x": f32(6, 4)}, {"i": scatter_nd_indices((6, 4), 1, 3, True), "u": f32(3, 4)}, 17),
    ("scatternd_update_elements", node("ScatterND", ["x", "i", "u"]), {"x": f32(4, 5, 3), "u": f32(2, 3)}, {"i": scatter_nd_indices((4, 5, 3), 3, 6, True).reshape(2, 3, 3)}, 17),
    ("scatternd_update_slices", node("ScatterND", ["x", "i", "u"]), {"x": f32(4, 5, 3)}, {"i": scatter_nd_indices((4, 5, 3), 2, 4, True), "u": f32(4, 3)}, 17),
    ("scatternd_add_dupes", node("ScatterND", ["x", "i", "u"], reduction="add"), {"x": f32(5, 3)}, {"i": np.array([[1], [-4], [0], [1]], np.int64), "u": f32(4, 3)}, 17),
    ("scatternd_mul_dupes", node("ScatterND", ["x", "i", "u"], reduction="mul"), {"x": f32(5, 3)}, {"i": np.array([[2, 1], [2, 1], [4, 0]], np.int64), "u": f32(3)}, 17),
    ("scatternd_max", node("ScatterND", ["x", "i", "u"], reduction="max"), {"x": f32(5, 3)}, {"i": np.array([[1], [3], [1]], np.int64), "u": f32(3, 3)}, 18),
    ("scatternd_min", node("ScatterND", ["x", "i", "u"], reduction="min"), {"x": f32(5, 3)}, {"i": np.array([[1], [3], [1]], np.int64), "u": f32(3, 3)}, 18),
    ("scatternd_bool", node("ScatterND", ["x", "i", "u"]), {"x": BOOL}, {"i": np.array([[0], [2]], np.int64), "u": ~BOOL[:2]}, 17),
    ("scatternd_int32_add", node("ScatterND", ["x", "i", "u"], reduction="add"), {"x": rng.integers(0, 9, (4, 3)).astype(np.int32)}, {"i": np.array([[3], [3]], np.int64), "u": np.ones((2, 3), np.int32)}, 17),
    ("scatternd_runtime_updates", node("ScatterND", ["x", "i", "u"]), {"x": f32(6), "i": np.array([[5], [0]], np.int64), "u": f32(2)}, {}, 17),
    # ScatterElements: axis, reductions, int32/int64 indices
    ("scatterelem_axis0", node("ScatterElements", ["x", "i", "u"]), {"x": f32(4, 3)}, {"i": np.array([[1, 0, 2], [3, -1, 0]], np.int64), "u": f32(2, 3)}, 17),
    ("scatterelem_axis1_int32", node("ScatterElements", ["x", "i", "u"], axis=1), {"x": f32(3, 5)}, {"i": np.array([[4, 0], [-5, 2], [1, 3]], np.int32), "u": f32(3, 2)}, 17),
    ("scatterelem_axis_neg_3d", node("ScatterElements", ["x", "i", "u"], axis=-1), {"x": f32(2, 3, 6)}, {"i": np.array([[[5, 0], [2, 1], [3, 4]], [[0, 1], [4, 5], [2, 3]]], np.int64), "u": f32(2, 3, 2)}, 17),
    ("scatterelem_add", node("ScatterElements", ["x", "i", "u"], axis=0, reduction="add"), {"x": f32(3, 4)}, {"i": scatter_elements_indices((5, 4), 3), "u": f32(5, 4)}, 17),
    ("scatterelem_mul", node("ScatterElements", ["x", "i", "u"], axis=1, reduction="mul"), {"x": f32(3, 4)}, {"i": scatter_elements_indices((3, 6), 4, np.int32), "u": f32(3, 6)}, 17),
    ("scatterelem_max", node("ScatterElements", ["x", "i", "u"], axis=1, reduction="max"), {"x": f32(3, 4)}, {"i": scatter_elements_indices((2, 5), 4), "u": f32(2, 5)}, 18),
    ("scatterelem_min", node("ScatterElements", ["x", "i", "u"], axis=0, reduction="min"), {"x": f32(3, 4)}, {"i": scatter_elements_indices((4, 4), 3), "u": f32(4, 4)}, 18),
    ("scatterelem_bool", node("ScatterElements", ["x", "i", "u"], axis=1), {"x": BOOL}, {"i": np.array([[4], [0], [2], [1]], np.int64), "u": np.ones((4, 1), bool)}, 17),
    # OneHot: tf.one_hot(indices, depth, on, off, axis)
    ("onehot_default_axis", node("OneHot", ["i", "d", "v"]), {"i": np.array([[0, 2, -1], [5, -4, 1]], np.int64)}, {"d": i64(4), "v": np.array([0.0, 1.0], np.float32)}, 17),
    ("onehot_axis0", node("OneHot", ["i", "d", "v"], axis=0), {"i": np.array([[0, 2, -1], [3, -3, 1]], np.int64)}, {"d": i64(3), "v": np.array([-1.0, 2.5], np.float32)}, 17),
    ("onehot_axis1_3d", node("OneHot", ["i", "d", "v"], axis=1), {"i": rng.integers(-6, 6, (2, 3, 2))}, {"d": i64(5), "v": np.array([0.0, 1.0], np.float32)}, 17),
    ("onehot_int32_indices", node("OneHot", ["i", "d", "v"]), {"i": np.array([1, 0, 7, -2], np.int32)}, {"d": np.array([3], np.int32), "v": np.array([0.0, 1.0], np.float32)}, 17),
    ("onehot_int64_values", node("OneHot", ["i", "d", "v"], axis=-2), {"i": np.array([[1, 0], [2, 2]], np.int64)}, {"d": np.array(3, np.int64), "v": np.array([5, 9], np.int64)}, 17),
    ("onehot_float_indices", node("OneHot", ["i", "d", "v"]), {"i": np.array([1.0, 0.0, 2.0, -1.0], np.float32)}, {"d": np.array([3.0], np.float32), "v": np.array([0.0, 1.0], np.float32)}, 17),
    # Trilu: tf.linalg.band_part lowers to it
    ("trilu_upper_default", node("Trilu", ["x"]), {"x": f32(4, 5)}, {}, 17),
    ("trilu_lower", node("Trilu", ["x"], upper=0), {"x": f32(5, 4)}, {}, 17),
    *[(f"trilu_upper{u}_k{k}", node("Trilu", ["x", "k"], upper=u), {"x": f32(2, 3, 4, 5)}, {"k": np.array(k, np.int64)}, 17)
      for u in (0, 1) for k in (-2, 1, 7, -9)],
    ("trilu_int64", node("Trilu", ["x", "k"], upper=0), {"x": rng.integers(0, 9, (3, 3))}, {"k": np.array(-1, np.int64)}, 17),
    ("trilu_bool", node("Trilu", ["x"]), {"x": BOOL}, {}, 17),
    # ReverseSequence: tf.reverse_sequence(seq_axis, batch_axis)
    ("revseq_time_major", node("ReverseSequence", ["x", "l"]), {"x": f32(5, 4, 3)}, {"l": i64(5, 0, 3, 1)}, 17),
    ("revseq_batch_major", node("ReverseSequence", ["x", "l"], batch_axis=0, time_axis=1), {"x": f32(3, 6, 2, 2)}, {"l": i64(2, 6, 4)}, 17),
    ("revseq_2d_runtime_lens", node("ReverseSequence", ["x", "l"], batch_axis=0, time_axis=1), {"x": f32(3, 4), "l": i64(4, 1, 3)}, {}, 17),
    ("revseq_int64_data", node("ReverseSequence", ["x", "l"]), {"x": rng.integers(0, 9, (4, 2))}, {"l": i64(4, 2)}, 17),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_onnxruntime(case: tuple[str, onnx.NodeProto, dict[str, np.ndarray], dict[str, np.ndarray], int]) -> None:
    _, n, feeds, consts, opset = case
    assert_matches(model(n, feeds, consts, opset), feeds)


@pytest.mark.parametrize("case", [
    ("CumSum", node("CumSum", ["x", "a"], reverse=1), {"x": f32(3, 4)}, {"a": i64(0)}),
    ("GatherND", node("GatherND", ["x", "i"], batch_dims=1), {"x": f32(3, 5, 2)}, {"i": rng.integers(0, 5, (3, 4, 1))}),
    ("ScatterND", node("ScatterND", ["x", "i", "u"], reduction="add"), {"x": f32(3, 4)}, {"i": np.array([[0, 1], [0, 1]], np.int64), "u": f32(2)}),
    ("ScatterElements", node("ScatterElements", ["x", "i", "u"], axis=1), {"x": f32(3, 4)}, {"i": np.array([[3], [0], [1]], np.int64), "u": f32(3, 1)}),
    ("Trilu", node("Trilu", ["x", "k"]), {"x": f32(3, 4, 4)}, {"k": np.array(1, np.int64)}),
    ("ReverseSequence", node("ReverseSequence", ["x", "l"], batch_axis=0, time_axis=1), {"x": f32(3, 4)}, {"l": i64(4, 2, 1)}),
], ids=lambda c: c[0])
def test_dynamic_batch(case: tuple[str, onnx.NodeProto, dict[str, np.ndarray], dict[str, np.ndarray]]) -> None:
    """The batch dim unknown at compile time: shapes come from the operands at run time."""
    _, n, feeds, consts = case
    assert_matches(model(n, feeds, consts, dynamic_batch=True), feeds)


def test_onehot_depth_computed_at_run_time() -> None:
    feeds = {"i": np.array([[2, 0], [1, -1]], np.int64), "d": i64(3)}
    n = node("OneHot", ["i", "d", "v"], axis=1)
    assert_matches(model(n, feeds, {"v": np.array([0, 1], np.float32)}), feeds)


# ---------------------------------------------------------------- NonMaxSuppression

def nms_inputs(batches: int, classes: int, n: int, center: bool, ties: bool = False) -> dict[str, np.ndarray]:
    """Clustered boxes so that suppression happens; corners sometimes flipped; scores with ties."""
    centers = rng.random((batches, 4, 2)).astype(np.float32)[:, rng.integers(0, 4, n)] + 0.05 * f32(batches, n, 2)
    size = (0.1 + 0.3 * rng.random((batches, n, 2))).astype(np.float32)
    if center:
        boxes = np.concatenate([centers[..., ::-1], size], axis=-1)  # [x_center, y_center, width, height]
    else:
        lo, hi = centers - size / 2, centers + size / 2
        boxes = np.concatenate([lo, hi], axis=-1)  # [y1, x1, y2, x2]
        flip = rng.random((batches, n)) < 0.3
        boxes[flip] = boxes[flip][:, [2, 3, 0, 1]]
    scores = rng.random((batches, classes, n)).astype(np.float32)
    if ties:
        scores = np.round(scores * 4) / 4
    return {"boxes": boxes.astype(np.float32), "scores": scores.astype(np.float32)}


NMS_CASES = [
    ("corners", 0, 2, 3, 40, i64(10), np.array([0.5], np.float32), np.array([0.2], np.float32), False),
    ("center", 1, 1, 2, 60, i64(100), np.array(0.3, np.float32), np.array(0.0, np.float32), False),
    ("ties", 0, 1, 2, 50, i64(20), np.array([0.4], np.float32), None, True),
    ("no_score_threshold_all_kept", 0, 2, 1, 30, i64(1000), np.array([1.0], np.float32), None, False),
    ("iou_zero", 1, 1, 1, 40, i64(50), np.array([0.0], np.float32), np.array([0.5], np.float32), False),
    ("max_one", 0, 2, 2, 25, i64(1), np.array([0.5], np.float32), np.array([0.1], np.float32), False),
    ("max_zero", 0, 1, 1, 10, i64(0), np.array([0.5], np.float32), None, False),
    ("max_negative", 0, 1, 1, 10, i64(-3), np.array([0.5], np.float32), None, False),
    ("many_boxes", 0, 1, 3, 1500, i64(200), np.array([0.5], np.float32), np.array([0.05], np.float32), True),
]


@pytest.mark.parametrize("case", NMS_CASES, ids=[c[0] for c in NMS_CASES])
def test_non_max_suppression_matches_onnxruntime_exactly(case: tuple[Any, ...]) -> None:
    """Same rows in the same order: batch, class, then selection order (ties: lower box first)."""
    _, cpb, batches, classes, n, max_out, iou, score, ties = case
    feeds = nms_inputs(batches, classes, n, bool(cpb), ties)
    consts = {"m": max_out, "iou": iou} | ({"st": score} if score is not None else {})
    nd = node("NonMaxSuppression", ["boxes", "scores", "m", "iou"] + (["st"] if score is not None else []), center_point_box=cpb)
    m = model(nd, feeds, consts)
    assert_matches(m, feeds)
    assert run_ort(m, feeds)[0].shape[0] > 0 or max_out[0] <= 0


def test_non_max_suppression_across_small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of a few candidates and tiny suppression steps: kept boxes of one block must remove
    their overlaps from every later block, as the one-box-at-a-time greedy does."""
    monkeypatch.setattr(indexing, "NMS_BLOCK", 5)
    monkeypatch.setattr(indexing, "NMS_CELLS", 7)
    feeds = nms_inputs(2, 2, 120, False, ties=True)
    n = node("NonMaxSuppression", ["boxes", "scores", "m", "iou"])
    m = model(n, feeds, {"m": i64(1000), "iou": np.array([0.3], np.float32)})
    assert_matches(m, feeds)
    assert 20 < run_ort(m, feeds)[0].shape[0] < 480  # suppression happened, and not everywhere


def test_non_max_suppression_beyond_the_first_sorted_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Heavy suppression and scores tied across the cut of the first sorted run: the selection
    goes on into the second run in the exact score-then-index order."""
    monkeypatch.setattr(indexing, "NMS_BLOCK", 4)
    feeds = nms_inputs(1, 3, 400, False, ties=True)
    feeds["scores"] = np.round(feeds["scores"] * 10) / 10
    n = node("NonMaxSuppression", ["boxes", "scores", "m", "iou"])
    m = model(n, feeds, {"m": i64(40), "iou": np.array([0.05], np.float32)})
    assert_matches(m, feeds)
    per_class = np.bincount(run_ort(m, feeds)[0][:, 1], minlength=3)
    assert 0 < per_class.min() and per_class.max() < 40  # under the limit: every candidate, both runs, was visited


def test_non_max_suppression_optional_inputs() -> None:
    """Omitted max_output_boxes_per_class means 0 (nothing selected); an omitted iou_threshold is 0."""
    feeds = nms_inputs(1, 2, 20, False)
    assert_matches(model(node("NonMaxSuppression", ["boxes", "scores"]), feeds), feeds)
    n = node("NonMaxSuppression", ["boxes", "scores", "m", "", "st"])
    m = model(n, feeds, {"m": i64(5), "st": np.array([0.3], np.float32)})
    assert_matches(m, feeds)
    assert run_ort(m, feeds)[0].shape[0] > 2


@pytest.mark.parametrize("iou", [0.5, 1.0])
def test_non_max_suppression_keeps_an_overlap_equal_to_the_threshold(iou: float) -> None:
    """IoU exactly at the threshold does not suppress (strictly greater does), as in onnxruntime."""
    boxes = np.array([[[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0.5, 1], [1, 0, 0, 1]]], np.float32)  # the last: flipped corners
    feeds = {"boxes": boxes, "scores": np.array([[[0.9, 0.8, 0.7, 0.6]]], np.float32)}
    n = node("NonMaxSuppression", ["boxes", "scores", "m", "iou"])
    m = model(n, feeds, {"m": i64(10), "iou": np.array([iou], np.float32)})
    assert_matches(m, feeds)
    assert run_ort(m, feeds)[0][:, 2].tolist() == ([0, 2] if iou == 0.5 else [0, 1, 2, 3])


def test_non_max_suppression_runtime_thresholds_and_dynamic_batch() -> None:
    feeds = nms_inputs(3, 2, 30, False) | {"m": i64(4), "iou": np.array([0.4], np.float32)}
    n = node("NonMaxSuppression", ["boxes", "scores", "m", "iou"])
    assert_matches(model(n, feeds, dynamic_batch=True), feeds)


# ---------------------------------------------------------------- refusals, shapes, eager, in place

BAD = [
    ("CumSum", node("CumSum", ["x", "a"], exclusive=2), {"x": f32(3)}, {"a": i64(0)}, "exclusive=2"),
    ("GatherND", node("GatherND", ["x", "i"], batch_dims=-1), {"x": f32(3, 2)}, {"i": np.array([[0]], np.int64)}, "batch_dims=-1"),
    ("ScatterND", node("ScatterND", ["x", "i", "u"], reduction="sub"), {"x": f32(3)}, {"i": np.array([[0]], np.int64), "u": f32(1)}, "reduction='sub'"),
    ("ScatterElements", node("ScatterElements", ["x", "i", "u"], axis=2), {"x": f32(3, 2)}, {"i": np.array([[0]], np.int64), "u": f32(1, 1)}, "axis 2 for rank-2 data"),
    ("OneHot", node("OneHot", ["i", "d", "v"], axis=3), {"i": np.array([[0]], np.int64)}, {"d": i64(2), "v": np.array([0, 1], np.float32)}, "axis 3 for rank-2 indices"),
    ("Trilu", node("Trilu", ["x"], upper=3), {"x": f32(3, 3)}, {}, "upper=3"),
    ("ReverseSequence", node("ReverseSequence", ["x", "l"], batch_axis=2, time_axis=0), {"x": f32(3, 2, 2)}, {"l": i64(1, 1)}, "batch_axis=2, time_axis=0"),
    ("NonMaxSuppression", node("NonMaxSuppression", ["b", "s"], center_point_box=2), {"b": f32(1, 3, 4), "s": f32(1, 1, 3)}, {}, "center_point_box=2"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[0])
def test_bad_attribute_is_refused_naming_the_node(case: tuple[str, onnx.NodeProto, dict[str, np.ndarray], dict[str, np.ndarray], str]) -> None:
    op, n, feeds, consts, given = case
    m = make_model([n], feeds, list(n.output), consts)
    with pytest.raises(UnsupportedOpError, match=re.escape(f"node {n.name!r} ({op}): {given}") + ".*supported: "):
        run_kubetrt(m, feeds)


def test_unknown_attribute_is_refused() -> None:
    """An attribute a later opset adds must not be dropped silently."""
    spec = KernelSpec("Trilu", "t1", {"upper": 1, "diagonal_mode": 2}, [None], [(3, 3)], [np.dtype(np.float32)], present=[True])
    with pytest.raises(UnsupportedOpError, match=r"node 't1' \(Trilu\): attributes \['diagonal_mode'\] are not understood"):
        lookup("Trilu").factory(spec)


def test_float64_boxes_are_refused() -> None:
    spec = KernelSpec("NonMaxSuppression", "nms", {}, [None, None], [(1, 3, 4), (1, 1, 3)], [np.dtype(np.float64), np.dtype(np.float32)], present=[True, True])
    with pytest.raises(UnsupportedOpError, match="node 'nms' .*boxes of dtype float64; supported: float32"):
        lookup("NonMaxSuppression").factory(spec)


def test_out_of_range_indices_are_errors() -> None:
    with pytest.raises(IndexError, match="out of range"):
        ops.GatherND(f32(3, 2), np.array([[3]], np.int64))
    with pytest.raises(IndexError, match="out of range"):
        ops.ScatterElements(f32(3, 2), np.array([[0, -4]], np.int64), f32(1, 2))
    with pytest.raises(ValueError, match=r"sequence_lens \[3, 5\] must be 2 lengths in \[0, 4\]"):
        ops.ReverseSequence(f32(4, 2), i64(3, 5))


OPS = ["CumSum", "GatherND", "ScatterND", "ScatterElements", "OneHot", "Trilu", "ReverseSequence", "NonMaxSuppression"]


@pytest.mark.parametrize("op", OPS)
def test_shape_functions_take_unknown_shapes(op: str) -> None:
    n_in = {"CumSum": 2, "GatherND": 2, "OneHot": 3, "Trilu": 2, "ReverseSequence": 2, "NonMaxSuppression": 5}.get(op, 3)
    for shapes in ([None] * n_in, [(-1, -1, -1)] * n_in):
        spec = KernelSpec(op, "s", {}, [None] * n_in, list(shapes), [None] * n_in, present=[True] * n_in)
        (out,) = lookup(op).shape_fn(spec)
        assert out[0] is None or len(out[0]) >= 1


def test_shape_functions_know_static_shapes() -> None:
    f32t = np.dtype(np.float32)
    g = KernelSpec("GatherND", "g", {"batch_dims": 1}, [None, None], [(2, 5, 4, 3), (-1, 6, 2)], [f32t, np.dtype(np.int64)], present=[True, True])
    assert lookup("GatherND").shape_fn(g) == [((2, 6, 3), f32t)]
    o = KernelSpec("OneHot", "o", {"axis": 1}, [None, i64(7), None], [(4, 2), (1,), (2,)], [np.dtype(np.int64), np.dtype(np.int64), f32t], present=[True] * 3)
    assert lookup("OneHot").shape_fn(o) == [((4, 7, 2), f32t)]


def test_eager_api_checks_outputs_against_shape_functions() -> None:
    x, i = f32(2, 5, 3), rng.integers(0, 5, (2, 4, 1))
    got = ops.GatherND(x, i, batch_dims=1)
    np.testing.assert_array_equal(got, np.take_along_axis(x, i, axis=1))
    np.testing.assert_array_equal(ops.OneHot(i64(0, 2), i64(3), np.array([0, 1], np.int64)), [[1, 0, 0], [0, 0, 1]])


def test_scatter_writes_into_a_dying_data_operand() -> None:
    """Where the compiler lets it overwrite the data operand, no copy is made."""
    data, idx, upd = f32(5, 3), np.array([[4], [1]], np.int64), f32(2, 3)
    expected = data.copy()
    expected[[4, 1]] = upd
    spec = KernelSpec("ScatterND", "s", {}, [None] * 3, [data.shape, idx.shape, upd.shape], [data.dtype, idx.dtype, upd.dtype],
                      inplace=frozenset({0}), present=[True] * 3)
    (out,) = lookup("ScatterND").factory(spec)(data, idx, upd)
    assert out is data
    np.testing.assert_array_equal(out, expected)
    spec.inplace = frozenset()
    fresh = f32(5, 3)
    (out,) = lookup("ScatterND").factory(spec)(fresh, idx, upd)
    assert out is not fresh


@pytest.mark.parametrize("inplace", [frozenset(), frozenset({0})])
def test_trilu_in_place_only_where_allowed(inplace: frozenset[int]) -> None:
    x = f32(2, 4, 4)
    before = x.copy()
    spec = KernelSpec("Trilu", "t", {"upper": 0}, [None], [x.shape], [x.dtype], inplace=inplace, present=[True])
    (y,) = lookup("Trilu").factory(spec)(x)
    np.testing.assert_array_equal(y, np.tril(before))
    assert (y is x) == bool(inplace)
    if not inplace:
        np.testing.assert_array_equal(x, before)
