"""passes/fusion.py's folds of a transformer's loose elementwise ops into the kernels beside them:
the scores' scalar scale into Softmax, the feed-forward residual (behind a Reshape) into its
matmul. Each case runs against onnxruntime on the model as written and reads the plan's kernels
to see what folded and what did not."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from onnx_cases import make_model, node, plan_ops_matching_ort

rng = np.random.default_rng(23)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def kernels_and_check(model: Any, feeds: dict[str, np.ndarray]) -> list[str]:
    return plan_ops_matching_ort(model, feeds, tol=1e-5)


@pytest.mark.parametrize("op,c,softmax", [("Mul", 0.25, "Softmax"), ("Div", 8.0, "Softmax"), ("Mul", -1.5, "Softmax"),
                                          ("Mul", 0.5, "LogSoftmax")])
def test_a_scalar_scale_folds_into_the_softmax(op: str, c: float, softmax: str) -> None:
    nodes = [node("MatMul", ["q", "k"], ["s"]), node(op, ["s", "c"], ["scaled"]), node(softmax, ["scaled"], ["y"], axis=-1)]
    feeds = {"q": f32(2, 3, 5, 4) * 3, "k": f32(2, 3, 4, 5) * 3}
    ops = kernels_and_check(make_model(nodes, feeds, ["y"], {"c": np.array(c, np.float32)}), feeds)
    assert op not in ops and softmax in ops


def test_a_scale_read_elsewhere_or_not_scalar_stays() -> None:
    nodes = [node("Mul", ["x", "c"], ["scaled"]), node("Softmax", ["scaled"], ["y"], axis=-1),
             node("Mul", ["x", "v"], ["per_column"]), node("Softmax", ["per_column"], ["y2"], axis=-1)]
    feeds = {"x": f32(4, 6)}
    consts = {"c": np.array([0.5], np.float32), "v": f32(6)}
    ops = kernels_and_check(make_model(nodes, feeds, ["y", "scaled", "y2"], consts), feeds)
    assert ops.count("Mul") == 2  # `scaled` is an output too; `v` is one scale per column


@pytest.mark.parametrize("batch", [1, 3])
def test_the_residual_behind_a_reshape_folds_into_the_matmul(batch: int) -> None:
    # x (N, S, D) -> rows (N*S, D) @ W -> back to (N, S, D) -> + x
    nodes = [node("Reshape", ["x", "rows"], ["xr"]), node("MatMul", ["xr", "w"], ["m"]), node("Add", ["m", "b"], ["mb"]),
             node("Reshape", ["mb", "back"], ["mr"]), node("Add", ["x", "mr"], ["y"])]
    feeds = {"x": f32(batch, 5, 8)}
    consts = {"rows": np.array([-1, 8], np.int64), "w": f32(8, 8), "b": f32(8), "back": np.array([-1, 5, 8], np.int64)}
    ops = kernels_and_check(make_model(nodes, feeds, ["y"], consts, dynamic_batch=True), feeds)
    assert "Add" not in ops and ops.count("FusedMatMul") == 1


def test_a_reshaped_result_read_elsewhere_keeps_its_add() -> None:
    nodes = [node("MatMul", ["x", "w"], ["m"]), node("Reshape", ["m", "back"], ["mr"]), node("Add", ["r", "mr"], ["y"]),
             node("Relu", ["mr"], ["y2"])]
    feeds = {"x": f32(6, 8), "r": f32(2, 3, 8)}
    consts = {"w": f32(8, 8), "back": np.array([2, 3, 8], np.int64)}
    ops = kernels_and_check(make_model(nodes, feeds, ["y", "y2"], consts), feeds)
    assert "Add" in ops
