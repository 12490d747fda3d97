"""The packed dense kernel (runtime/kernels/sgemm.py) against float64 NumPy and, inside plans,
against onnxruntime: every tail of its tiles (rows, columns, K), bias, residual (fresh or summed in
place), the activations it fuses, the team and a team of one, threads sharing one kernel, and the
errors bad input gets. fp32 tolerance from the one table (runtime/accuracy.py)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.kernels import onednn, sgemm
from kubetrt.runtime.kernels.activations import scalar_form
from kubetrt.runtime.kernels.omp import TeamChoice
from kubetrt.runtime.kernels.registry import KernelSpec
from onnx_cases import make_model, node, run_ort, run_plan
from threads import on_threads

pytestmark = pytest.mark.skipif(not sgemm.AVAILABLE, reason="numba or libgomp is missing: oneDNN or NumPy runs dense layers")
TOL = tolerance_for("fp32", "host")
rng = np.random.default_rng(23)
# rows around the tile height (a lone row takes the one-row path), columns around the panel width, K around the unroll
SHAPES = [(1, 1, 1), (1, 64, 10), (1, 130, 33), (2, 7, 16), (3, 4, 17), (4, 64, 16), (5, 3, 31), (17, 96, 48), (64, 33, 100)]
ACTIVATIONS: list[tuple[str, Any]] = [("none", None), ("relu", ("Relu", {})), ("clip", ("Clip", {"min": -0.5, "max": 0.75})),
                                      ("gelu", ("Gelu", {}))]


@pytest.fixture
def packed_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Records the input shape of every call the packed kernel runs."""
    calls: list[tuple[int, ...]] = []
    real = sgemm.PackedDense.__call__

    def spy(self: sgemm.PackedDense, a: np.ndarray, *rest: Any, **kw: Any) -> np.ndarray:
        calls.append(a.shape)
        return real(self, a, *rest, **kw)
    monkeypatch.setattr(sgemm.PackedDense, "__call__", spy)
    return calls


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def reference(a: np.ndarray, w: np.ndarray, bias: np.ndarray | None, residual: np.ndarray | None, act: Any) -> np.ndarray:
    y = a.astype(np.float64) @ w.astype(np.float64)
    y += 0 if bias is None else bias
    y += 0 if residual is None else residual
    if act is not None and act[0] == "Gelu":
        return 0.5 * y * (1.0 + np.vectorize(math.erf)(y / math.sqrt(2.0)))
    form = scalar_form(act)
    assert form is not None
    return np.clip(y, form[1], form[2]) if act is not None else y


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=TOL.rtol, atol=TOL.atol)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("act_name,act", ACTIVATIONS, ids=[a for a, _ in ACTIVATIONS])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_matches_float64(m: int, k: int, n: int, act_name: str, act: Any, with_bias: bool) -> None:
    a, w = f32(m, k), f32(k, n)
    bias = f32(n) if with_bias else None
    dense = sgemm.PackedDense(w, bias, scalar_form(act), residual=False)
    y = dense(a)
    assert y.shape == (m, n) and y.dtype == np.float32
    close(y, reference(a, w, bias, None, act))


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "fresh"])
def test_residual_is_summed_and_only_overwritten_when_allowed(in_place: bool) -> None:
    a, w, bias, residual = f32(2, 9, 20), f32(20, 24), f32(24), f32(2, 9, 24)
    kept = residual.copy()
    dense = sgemm.PackedDense(w, bias, scalar_form(("Relu", {})), residual=True)
    y = dense(a, residual, overwrite_residual=in_place)
    assert y.shape == (2, 9, 24)
    close(y, reference(a.reshape(-1, 20), w, bias, kept.reshape(-1, 24), ("Relu", {})).reshape(2, 9, 24))
    assert (y is residual) == in_place
    if not in_place:
        np.testing.assert_array_equal(residual, kept)


def test_a_team_of_one_gives_the_same_bits_as_the_team(monkeypatch: pytest.MonkeyPatch) -> None:
    # each tile is summed by one thread in one order, whichever thread takes it
    a, w, bias = f32(37, 70), f32(70, 45), f32(45)
    results = []
    for serial in (False, True):
        monkeypatch.setattr(TeamChoice, "pick", lambda self, s=serial: s)
        results.append(sgemm.PackedDense(w, bias, scalar_form(None), residual=False)(a))
    np.testing.assert_array_equal(results[0], results[1])


def test_nan_and_infinities_pass_through_as_in_float_arithmetic() -> None:
    a, w = f32(5, 8), f32(8, 3)
    a[1, 2], a[3, 0] = np.nan, np.inf
    w[:, 2] = np.abs(w[:, 2])  # column 2 of row 3 is +inf times positives: +inf
    y = sgemm.PackedDense(w, None, scalar_form(("Relu", {})), residual=False)(a)
    assert np.isnan(y[1]).all() and y[3, 2] == np.inf
    finite = [0, 2, 4]
    close(y[finite], reference(a[finite], w, None, None, ("Relu", {})))


def test_threads_sharing_one_kernel_get_their_own_results() -> None:
    w, bias = f32(48, 40), f32(40)
    dense = sgemm.PackedDense(w, bias, scalar_form(None), residual=False)

    def work(a: np.ndarray) -> None:
        for _ in range(50):
            close(dense(a), reference(a, w, bias, None, None))
    on_threads(work, [f32(m, 48) for m in (1, 7, 33, 64)])


def test_bad_input_is_named() -> None:
    dense = sgemm.PackedDense(f32(6, 4), None, scalar_form(None), residual=True, name="fc")
    with pytest.raises(ValueError, match=r"MatMul fc: expected a float32 input of shape \[\.\.\., 6\], got float32 of shape \(3, 5\)"):
        dense(f32(3, 5), f32(3, 4))
    with pytest.raises(ValueError, match=r"MatMul fc: expected a float32 input .* got float64"):
        dense(np.zeros((3, 6)), f32(3, 4))
    with pytest.raises(ValueError, match="built with a residual sum, but no residual was passed"):
        dense(f32(3, 6))
    with pytest.raises(ValueError, match=r"residual float32\[3, 5\] does not fit the output float32\[3, 4\]"):
        dense(f32(3, 6), f32(3, 5))


@pytest.mark.parametrize("batch", [1, 4], ids=["few-rows", "many-rows"])
def test_plans_run_dense_layers_of_few_rows_on_it_and_match_onnxruntime(batch: int, packed_calls: list[tuple[int, ...]]) -> None:
    # dense + bias + ReLU, then a second dense whose residual is the first one's output (rank 3)
    nodes = [node("MatMul", ["x", "w1"], ["m1"]), node("Add", ["m1", "b1"], ["a1"]), node("Relu", ["a1"], ["h"]),
             node("MatMul", ["h", "w2"], ["m2"]), node("Add", ["m2", "h"], ["y"])]
    feeds = {"x": f32(batch, 13, 64)}
    model = make_model(nodes, feeds, ["y"], {"w1": f32(64, 96), "b1": f32(96), "w2": f32(96, 96)})
    (got,), ops = run_plan(model, feeds)
    close(got, run_ort(model, feeds)[0])
    assert ops == ["FusedMatMul", "FusedMatMul"], ops
    few = batch * 13 <= sgemm.MAX_ROWS
    assert few == (batch == 1)
    assert packed_calls == ([(batch, 13, 64), (batch, 13, 96)] if few or not onednn.AVAILABLE else []), packed_calls


def test_a_batch_one_classifier_head_runs_here_however_small(packed_calls: list[tuple[int, ...]]) -> None:
    nodes = [node("MatMul", ["x", "w"], ["m"]), node("Add", ["m", "b"], ["y"])]
    feeds = {"x": f32(1, 64)}
    model = make_model(nodes, feeds, ["y"], {"w": f32(64, 10), "b": f32(10)})
    close(run_plan(model, feeds)[0][0], run_ort(model, feeds)[0])
    assert packed_calls == [(1, 64)]


def test_a_residual_that_is_also_an_output_is_not_overwritten() -> None:
    # s feeds the second layer's fused residual sum and is itself a graph output
    nodes = [node("MatMul", ["x", "w1"], ["s"]), node("MatMul", ["s", "w2"], ["m"]), node("Add", ["m", "s"], ["y"])]
    feeds = {"x": f32(3, 40)}
    model = make_model(nodes, feeds, ["y", "s"], {"w1": f32(40, 24), "w2": f32(24, 24)})
    for got, want in zip(run_plan(model, feeds)[0], run_ort(model, feeds)):
        close(got, want)


def spec(act: Any, w: np.ndarray, bias: np.ndarray | None = None) -> KernelSpec:
    f = np.dtype(np.float32)
    return KernelSpec("FusedMatMul", "fc", {"activation": act}, [None, w, bias], [(None, w.shape[0]), w.shape, None],
                      [f, w.dtype, f], present=[True, True, bias is not None])


def test_it_takes_only_what_it_computes_as_specified() -> None:
    w = f32(4, 4)
    assert isinstance(sgemm.dense_for_node(spec(("Relu", {}), w, f32(4)), w), sgemm.PackedDense)
    assert sgemm.dense_for_node(spec(("Sigmoid", {}), w), w) is None, "an activation numba does not apply"
    assert sgemm.dense_for_node(spec(None, w), None) is None, "weights computed at run time"
    w16 = w.astype(np.float16)
    assert sgemm.dense_for_node(spec(None, w16), w16) is None, "float16 weights"
    assert sgemm.dense_for_node(spec(None, w, f32(5)), w) is None, "a bias of another width"
