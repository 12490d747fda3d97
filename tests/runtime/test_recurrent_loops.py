"""Keras GRU layers, which tf2onnx leaves as ONNX Loops, run as GRU nodes (passes/recurrent_loops.py).

That the rewritten models still match TensorFlow is test_model_families' check (gru, gru_text,
bidirectional at several batch sizes, fp32 host tolerance); here: which loops are rewritten, and
that loops the pass cannot prove to be a GRU cell stay loops."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.graph import Graph, Node
from kubetrt.runtime.onnx_import import load_onnx
from kubetrt.runtime.passes import optimize


def graph_of(zoo: Any, name: str) -> Graph:
    return load_onnx(zoo.package(name) / "model.onnx")


def ops(graph: Graph, *names: str) -> list[Node]:
    return [n for n in graph.nodes if n.op in names]


@pytest.mark.parametrize(("name", "reset_after"), [("gru_text", [1]), ("gru", [1, 0]), ("bidirectional", [1, 1])])
def test_keras_gru_loops_become_gru_nodes(zoo: Any, name: str, reset_after: list[int]) -> None:
    before = graph_of(zoo, name)
    assert len(ops(before, "Loop")) == len(reset_after), "the export no longer writes Keras' GRU as a Loop"
    after = optimize(before)
    assert not ops(after, "Loop")
    assert [n.attrs["linear_before_reset"] for n in ops(after, "GRU")] == reset_after


def _loop_body(graph: Graph) -> tuple[Node, Graph]:
    (loop,) = ops(graph, "Loop")
    body = loop.attrs["body"]
    assert isinstance(body, Graph)
    return loop, body


def test_a_cell_with_another_activation_stays_a_loop(zoo: Any) -> None:
    """The body's candidate activation swapped for ReLU: same structure, a different cell, which
    only the probe can tell apart."""
    graph = graph_of(zoo, "gru_text")
    _, body = _loop_body(graph)
    (tanh,) = ops(body, "Tanh")
    tanh.op = "Relu"
    assert ops(optimize(graph), "Loop")


def test_a_loop_that_never_runs_stays_a_loop(zoo: Any) -> None:
    graph = graph_of(zoo, "gru_text")
    loop, _ = _loop_body(graph)
    graph.constants["never"] = np.array(False)
    loop.inputs[1] = "never"
    assert ops(optimize(graph), "Loop")


def test_a_trip_count_known_only_at_run_time_stays_a_loop(zoo: Any) -> None:
    graph = graph_of(zoo, "gru_text")
    loop, _ = _loop_body(graph)
    graph.constants.pop(loop.inputs[0], None)  # M becomes a graph input: unknown until a request
    from kubetrt.runtime.graph import ValueInfo

    graph.inputs.append(ValueInfo(loop.inputs[0], np.dtype(np.int64), ()))
    assert ops(optimize(graph), "Loop")
