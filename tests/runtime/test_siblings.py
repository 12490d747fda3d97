"""passes/siblings.py: dense layers reading the same activations run as one wider matmul and a
Split. Each case runs the optimized plan against onnxruntime on the model as written, and reads
the plan's kernels to see what merged and what did not."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.onnx_import import from_proto
from kubetrt.runtime.passes import optimize
from onnx_cases import make_model, node, plan_ops_matching_ort

rng = np.random.default_rng(11)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def check(model: Any, feeds: dict[str, np.ndarray]) -> list[str]:
    return plan_ops_matching_ort(model, feeds, tol=1e-4)


def projections(bias: tuple[bool, bool, bool] = (True, False, True), acts: tuple[str | None, ...] = (None, None, None),
                outputs: tuple[str, ...] = ("y",), x_shape: tuple[int, ...] = (2, 5, 16)) -> tuple[Any, dict[str, np.ndarray]]:
    """q, k, v = x @ W_i (+ b_i) (-> act); y = q * k + v: three dense layers on one input."""
    nodes, inits = [], {}
    for i, (name, has_bias, act) in enumerate(zip("qkv", bias, acts)):
        inits[f"w{name}"] = f32(16, 8 + 4 * i if name != "k" else 8)
        width = inits[f"w{name}"].shape[1]
        nodes.append(node("MatMul", ["x", f"w{name}"], [f"{name}0"]))
        cur = f"{name}0"
        if has_bias:
            inits[f"b{name}"] = f32(width)
            nodes.append(node("Add", [cur, f"b{name}"], [f"{name}1"]))
            cur = f"{name}1"
        if act:
            nodes.append(node(act, [cur], [f"{name}2"]))
            cur = f"{name}2"
        nodes.append(node("Identity", [cur], [name]))
    inits["wk"] = f32(16, 8)
    nodes += [node("Slice", ["q", "zero", "eight", "last"], ["q8"]), node("Slice", ["v", "zero", "eight", "last"], ["v8"]),
              node("Mul", ["q8", "k"], ["qk"]), node("Add", ["qk", "v8"], ["y"])]
    inits.update(zero=np.array([0], np.int64), eight=np.array([8], np.int64), last=np.array([-1], np.int64))
    x = f32(*x_shape)
    return make_model(nodes, {"x": x}, list(outputs), inits, dynamic_batch=True), {"x": x}


def test_three_projections_run_as_one_matmul_and_a_split() -> None:
    model, feeds = projections()
    ops = check(model, feeds)
    assert ops.count("FusedMatMul") == 1 and ops.count("Split") == 1


def test_projections_that_are_graph_outputs_keep_their_values() -> None:
    model, feeds = projections(outputs=("y", "q", "k", "v"))
    ops = check(model, feeds)
    assert ops.count("FusedMatMul") == 1


def test_a_shared_activation_merges_and_different_ones_do_not() -> None:
    model, feeds = projections(acts=("Relu", "Relu", "Relu"))
    assert check(model, feeds).count("FusedMatMul") == 1
    model, feeds = projections(acts=("Relu", None, "Relu"))
    ops = check(model, feeds)
    assert ops.count("FusedMatMul") == 2 and ops.count("Split") == 1  # q and v merge; k stays alone


@pytest.mark.parametrize("batch", [1, 7])
def test_merged_plan_serves_every_batch(batch: int) -> None:
    model, _ = projections()
    x = f32(batch, 5, 16)
    check(model, {"x": x})


def test_weights_computed_at_run_time_or_a_residual_stop_a_merge() -> None:
    x, w = f32(3, 16), f32(16, 8)
    nodes = [node("MatMul", ["x", "w"], ["a"]), node("MatMul", ["x", "wv"], ["b"]),  # wv: an input, not a constant
             node("MatMul", ["x", "w"], ["c0"]), node("Add", ["c0", "r"], ["c"]),  # r: an input, a residual sum
             node("Add", ["a", "b"], ["ab"]), node("Add", ["ab", "c"], ["y"])]
    model = make_model(nodes, {"x": x, "wv": f32(16, 8), "r": f32(3, 8)}, ["y"], {"w": w})
    graph = optimize(from_proto(model))
    assert not any(n.op == "Split" for n in graph.nodes)


def test_split_shapes_are_inferred_for_what_follows() -> None:
    model, feeds = projections()
    graph = optimize(from_proto(model))
    split = next(n for n in graph.nodes if n.op == "Split")
    assert [graph.values[o].shape for o in split.outputs] == [(-1, 5, 8), (-1, 5, 8), (-1, 5, 16)]
