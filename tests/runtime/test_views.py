"""passes/views.py: reshape-only ops become one Reshape, chains collapse, round trips vanish;
every case runs against onnxruntime on the model as written."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime.onnx_import import from_proto
from kubetrt.runtime.program import compile_graph
from onnx_cases import make_model, node, run_kubetrt, run_ort, run_plan

rng = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def kernels_and_check(model, feeds) -> list[str]:  # type: ignore[no-untyped-def]
    for executor in ("sequential", "dataflow"):
        for got, want in zip(run_kubetrt(model, feeds, executor), run_ort(model, feeds)):
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return [k.op for k in compile_graph(from_proto(model)).kernels]


@pytest.mark.parametrize("dynamic_batch", [False, True])
def test_squeeze_excitation_view_chain_vanishes(dynamic_batch: bool) -> None:
    # tf2onnx's squeeze: pooled (N,C,1,1) -> Squeeze -> (N,C) -> Reshape back to (N,C,1,1) -> 1x1 conv
    nodes = [node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), node("GlobalAveragePool", ["c"], ["g"]),
             node("Squeeze", ["g", "axes"], ["s"]), node("Reshape", ["s", "shape"], ["r"]),
             node("Conv", ["r", "w1"], ["e"]), node("Sigmoid", ["e"], ["gate"]), node("Mul", ["c", "gate"], ["y"])]
    consts = {"w": f32(16, 3, 3, 3), "w1": f32(16, 16, 1, 1), "axes": i64(2, 3), "shape": i64(-1, 16, 1, 1)}
    feeds = {"x": f32(3, 3, 6, 6)}
    ops = kernels_and_check(make_model(nodes, feeds, ["y"], consts, dynamic_batch=dynamic_batch), feeds)
    pooled = ops.index("GlobalAveragePoolNHWC")
    assert ops[pooled + 1] == "FusedConvNHWC", ops  # the 1x1 conv reads the pooled tensor itself


def test_transpose_of_unit_axes_is_a_reshape_and_a_real_one_stays() -> None:
    nodes = [node("Transpose", ["x"], ["t"], perm=[0, 2, 1, 3]),  # (2,1,5,4) -> (2,5,1,4): unit axis moves
             node("Transpose", ["t"], ["y"], perm=[0, 3, 2, 1])]  # (2,5,1,4) -> (2,4,1,5): 5 and 4 swap
    feeds = {"x": f32(2, 1, 5, 4)}
    assert kernels_and_check(make_model(nodes, feeds, ["y"]), feeds) == ["Reshape", "Transpose"]


def test_a_round_trip_that_is_a_graph_output_keeps_its_value() -> None:
    nodes = [node("Flatten", ["x"], ["f"]), node("Reshape", ["f", "shape"], ["y"]), node("Relu", ["y"], ["z"])]
    feeds = {"x": f32(2, 3, 4)}
    ops = kernels_and_check(make_model(nodes, feeds, ["y", "z"], {"shape": i64(2, 3, 4)}), feeds)
    assert ops == ["Reshape", "Relu"], ops  # y is asked for by name, so one reshape back to it stays


def test_reshape_chain_reads_the_first_input() -> None:
    nodes = [node("Reshape", ["x", "s1"], ["a"]), node("Unsqueeze", ["a", "ax"], ["b"]), node("Reshape", ["b", "s2"], ["y"])]
    feeds = {"x": f32(4, 6)}
    consts = {"s1": i64(2, 12), "ax": i64(0), "s2": i64(3, 8)}
    assert kernels_and_check(make_model(nodes, feeds, ["y"], consts), feeds) == ["Reshape"]


def _transposes_returning_views(model, feeds) -> list[bool]:  # type: ignore[no-untyped-def]
    """For each Transpose the plan runs: whether its result shares its input's memory."""
    seen: list[bool] = []

    def on_step(op, args, out):  # type: ignore[no-untyped-def]
        if op == "Transpose":
            seen.append(np.shares_memory(out[0], args[0]))

    outputs, _ = run_plan(model, feeds, on_step)
    for got, want in zip(outputs, run_ort(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return seen


def test_a_transpose_only_matmuls_read_stays_a_view() -> None:
    """Attention's scores: q @ k^T, the transpose read only by the matmul, so never copied."""
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["q", "kt"], ["y"])]
    feeds = {"q": f32(4, 5, 8), "k": f32(4, 6, 8)}
    assert _transposes_returning_views(make_model(nodes, feeds, ["y"]), feeds) == [True]


def test_a_transpose_something_else_reads_or_that_moves_batch_axes_is_copied() -> None:
    nodes = [node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]), node("MatMul", ["q", "kt"], ["s"]),
             node("Relu", ["kt"], ["r"]), node("ReduceSum", ["r"], ["y2"], keepdims=0),
             node("Transpose", ["k"], ["kb"], perm=[2, 0, 1]), node("ReduceSum", ["kb"], ["y3"], keepdims=0)]
    feeds = {"q": f32(4, 5, 8), "k": f32(4, 6, 8)}
    assert _transposes_returning_views(make_model(nodes, feeds, ["s", "y2", "y3"]), feeds) == [False, False]
