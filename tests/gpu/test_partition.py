"""Partitioning into TensorRT-able and fallback segments, checked end to end against TF's golden
outputs: supported segments are exported to ONNX and run by onnxruntime (where TensorRT would run
them), fallback segments run on the host runtime, chained by the SegmentRunner."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers import OrtExecutable, check_all_batches, fresh, load
from kubetrt.runtime.devices.host import RUNTIME as HOST
from kubetrt.runtime.graph import Graph, Node, ValueInfo
from kubetrt.runtime.partition import (
    SegmentRunner,
    export_segment,
    partition,
    segment_graph,
)

CASES = [
    ("small_cnn", {"GlobalAveragePool"}, 3),
    ("small_cnn", {"Softmax"}, 2),
    ("transformer", {"Softmax", "Erf"}, 5),
    ("mlp", {"Relu"}, 5),
    ("two_in_two_out", {"Gather"}, 2),
]


def _check_structure(graph: Graph, segs: list) -> None:
    seen = [n.name for s in segs for n in s.nodes]
    assert sorted(seen) == sorted(n.name for n in graph.nodes), "every node in exactly one segment"
    available = {v.name for v in graph.inputs}
    for s in segs:
        assert set(s.inputs) <= available, f"segment {s.index} reads values no earlier segment produced"
        available |= set(s.outputs)
        assert all(a.supported != b.supported for a, b in zip(segs, segs[1:])), "adjacent segments of one kind were not merged"
    assert {o.name for o in graph.outputs} <= available


@pytest.mark.parametrize("name,reject,n_segments", CASES)
def test_partitioned_segments_chain_to_golden(zoo, name: str, reject: set[str], n_segments: int) -> None:
    graph, golden = load(zoo.package(name))
    segs = partition(graph, lambda n: n.op not in reject)
    assert len(segs) == n_segments
    _check_structure(graph, segs)
    for s in segs:
        assert s.supported == all(n.op not in reject for n in s.nodes)
    exes = []
    for s in segs:
        model = export_segment(graph, s)
        onnx.checker.check_model(model, full_check=True)
        assert [v.name for v in model.graph.input] == s.inputs and [v.name for v in model.graph.output] == s.outputs
        exes.append(OrtExecutable(model) if s.supported else HOST.prepare(segment_graph(graph, s), {}))
    check_all_batches(SegmentRunner(graph, segs, exes).run, graph, golden, 1e-4)


def test_whole_graph_is_one_segment_when_all_supported(zoo) -> None:
    graph, golden = load(zoo.package("small_cnn"))
    segs = partition(graph, lambda n: True)
    assert len(segs) == 1 and segs[0].supported and segs[0].inputs == ["image"]
    check_all_batches(SegmentRunner(graph, segs, [OrtExecutable(export_segment(graph, segs[0]))]).run, graph, golden, 1e-4)


def test_min_segment_size_sends_short_runs_to_fallback(zoo) -> None:
    graph, _ = load(zoo.package("mlp"))
    segs = partition(graph, lambda n: n.op != "Relu", min_segment_size=2)
    # MatMul | Relu | MatMul | Relu | MatMul,Softmax -> the single MatMuls fall back and merge
    assert [(s.supported, len(s.nodes)) for s in segs] == [(False, 4), (True, 2)]


def _diamond() -> Graph:
    """a -> A(sup) -> B(unsup) -> C(sup), and A -> C directly: grouping {A, C} would be a cycle."""
    nodes = [
        Node("Relu", "A", ["x"], ["a"]),
        Node("Neg", "B", ["a"], ["b"]),
        Node("Add", "C", ["a", "b"], ["c"]),
    ]
    return Graph(nodes, [ValueInfo("x", np.dtype(np.float32), (-1, 4))], [ValueInfo("c", np.dtype(np.float32), (-1, 4))], {})


def test_partition_never_groups_across_a_fallback_dependency() -> None:
    graph = _diamond()
    segs = partition(graph, lambda n: n.op != "Neg")
    assert [s.node_names for s in segs] == [["A"], ["B"], ["C"]]
    assert segs[2].inputs == ["a", "b"]
    x = np.array([[-1.0, 2.0, -3.0, 4.0]], np.float32)
    exes = [OrtExecutable(export_segment(graph, s)) for s in segs]
    (c,) = SegmentRunner(graph, segs, exes).run([x])
    np.testing.assert_array_equal(c, np.maximum(x, 0) - np.maximum(x, 0))


def test_partition_prefers_extending_the_current_segment() -> None:
    """Two independent branches: supported nodes of both end up in one segment, not interleaved."""
    nodes = [
        Node("Relu", "A1", ["x"], ["a1"]), Node("Neg", "B1", ["x"], ["b1"]),
        Node("Relu", "A2", ["a1"], ["a2"]), Node("Neg", "B2", ["b1"], ["b2"]),
        Node("Add", "J", ["a2", "b2"], ["y"]),
    ]
    graph = Graph(nodes, [ValueInfo("x", np.dtype(np.float32), (-1, 3))], [ValueInfo("y", np.dtype(np.float32), (-1, 3))], {})
    segs = partition(graph, lambda n: n.op != "Neg")
    assert [s.node_names for s in segs] == [["A1", "A2"], ["B1", "B2"], ["J"]]


def test_fused_nodes_cannot_be_exported() -> None:
    graph = Graph([Node("FusedConv", "f", ["x", "w"], ["y"], {"activation": ("Relu", {})})],
                  [ValueInfo("x", np.dtype(np.float32), (-1, 1, 4, 4))], [ValueInfo("y", np.dtype(np.float32), None)],
                  {"w": np.ones((1, 1, 1, 1), np.float32)})
    with pytest.raises(ValueError, match="partition the graph before optimizing"):
        export_segment(graph, partition(graph, lambda n: True)[0])


def test_runner_frees_values_after_their_last_reader(zoo) -> None:
    graph, golden = load(zoo.package("small_cnn"))
    segs = partition(fresh(graph), lambda n: n.op != "GlobalAveragePool")
    runner = SegmentRunner(graph, segs, [HOST.prepare(segment_graph(graph, s), {}) for s in segs])
    assert runner.frees[1] == segs[1].inputs  # the GAP input dies in the fallback segment
    check_all_batches(runner.run, graph, golden, 1e-4)
