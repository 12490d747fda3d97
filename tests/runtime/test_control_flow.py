"""Control flow (If, Loop, Scan) against onnxruntime: sub-graphs compiled once, captures of outer
values as explicit operands, outputs that never alias what a later kernel may overwrite, the
export back to ONNX, and a real tf2onnx while_loop with a tf.cond inside."""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from kubetrt.runtime import RuntimeModelError, UnsupportedOpError, ops
from kubetrt.runtime.devices.cuda import CudaRuntime, NumpyStandIn
from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.executor import SequentialPlan
from kubetrt.runtime.graph import CAPTURES, Graph
from kubetrt.runtime.kernels import control_flow
from kubetrt.runtime.onnx_export import graph_to_onnx
from kubetrt.runtime.onnx_import import from_proto
from kubetrt.runtime.partition import SegmentRunner, export_segment, partition, segment_graph
from kubetrt.runtime.program import compile_graph
from onnx_cases import make_model, node, run_kubetrt, run_ort

TOL = dict(rtol=1e-4, atol=1e-5)
rng = np.random.default_rng(7)
EXECUTORS = ["sequential", "dataflow"]


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def vi(name: str, elem: int, shape: list[Any] | None) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def const(name: str, value: Any, dtype: Any = np.float32) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"const_{name}",
                            value=onnx.numpy_helper.from_array(np.array(value, dtype), name))


def check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], executor: str = "sequential") -> list[np.ndarray]:
    want = run_ort(model, feeds)
    got = run_kubetrt(model, feeds, executor)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_allclose(g, w, **TOL)
    return got


# ---------------------------------------------------------------------------- models

def counting_body(shape: list[Any] | None = None) -> onnx.GraphProto:
    """acc' = acc * w + u + i (w: an outer initializer, u: an outer computed value); scan outputs
    acc' * 2 and the iteration number; cond passes through. `shape`: what the body declares for acc."""
    nodes = [
        helper.make_node("Cast", ["i"], ["fi"], name="b_cast", to=T.FLOAT),
        helper.make_node("Mul", ["acc", "w"], ["aw"], name="b_mul"),
        helper.make_node("Add", ["aw", "u"], ["awu"], name="b_add_u"),
        helper.make_node("Add", ["awu", "fi"], ["acc_out"], name="b_add_i"),
        const("two", 2.0),
        helper.make_node("Mul", ["acc_out", "two"], ["s"], name="b_scan"),
        helper.make_node("Identity", ["c"], ["c_out"], name="b_cond"),
        helper.make_node("Identity", ["i"], ["i_out"], name="b_iter"),
    ]
    return helper.make_graph(nodes, "body", [vi("i", T.INT64, []), vi("c", T.BOOL, []), vi("acc", T.FLOAT, shape)],
                             [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, shape), vi("s", T.FLOAT, shape),
                              vi("i_out", T.INT64, [])])


def counting_loop(m: int | None, cond: bool | None, dynamic_batch: bool = False,
                  shape: list[Any] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Loop with a trip count, a constant condition, or both, over `counting_body`."""
    inits: dict[str, np.ndarray] = {"w": np.array([0.5, -1.0, 2.0], np.float32)}
    if m is not None:
        inits["M"] = np.array(m, np.int64)
    if cond is not None:
        inits["C"] = np.array(cond)
    nodes = [node("Mul", ["x", "half"], ["u"]),
             helper.make_node("Loop", ["M" if m is not None else "", "C" if cond is not None else "", "x"],
                              ["acc_final", "scan", "iters"], name="loop", body=counting_body(shape))]
    inits["half"] = np.array(0.5, np.float32)
    feeds = {"x": f32(2, 3)}
    return make_model(nodes, feeds, ["acc_final", "scan", "iters"], inits, dynamic_batch), feeds


def while_body() -> onnx.GraphProto:
    """acc' = acc + step; continue while max(acc') < limit (an outer initializer)."""
    nodes = [
        helper.make_node("Add", ["acc", "step"], ["acc_out"], name="w_add"),
        helper.make_node("ReduceMax", ["acc_out"], ["mx"], name="w_max", keepdims=0),
        helper.make_node("Less", ["mx", "limit"], ["c_out"], name="w_less"),
    ]
    return helper.make_graph(nodes, "while", [vi("i", T.INT64, []), vi("c", T.BOOL, []), vi("acc", T.FLOAT, None)],
                             [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, None)])


def while_loop(m: int | None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """cond computed from the input (a while loop); with `m`, also bounded by a trip count."""
    inits = {"limit": np.array(4.0, np.float32), "step": np.array(0.75, np.float32), "zero": np.array(-100.0, np.float32)}
    if m is not None:
        inits["M"] = np.array(m, np.int64)
    nodes = [node("ReduceSum", ["x"], ["sum"], keepdims=0), node("Greater", ["sum", "zero"], ["c0"]),
             helper.make_node("Loop", ["M" if m is not None else "", "c0", "x"], ["y"], name="loop", body=while_body())]
    feeds = {"x": f32(3, 2)}
    return make_model(nodes, feeds, ["y"], inits), feeds


# ---------------------------------------------------------------------------- Loop

LOOPS = {"trip_count": lambda: counting_loop(4, None), "cond": lambda: while_loop(None), "both": lambda: counting_loop(3, True)}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("kind", LOOPS)
def test_loop_carried_values_and_scan_outputs_match_onnxruntime(kind: str, executor: str) -> None:
    model, feeds = LOOPS[kind]()
    check(model, feeds, executor)


@pytest.mark.parametrize("m,expected", [(None, None), (2, 2), (50, None)], ids=["cond_only", "trip_count_first", "cond_first"])
def test_loop_ends_on_whichever_of_trip_count_and_body_condition_comes_first(m: int | None, expected: int | None) -> None:
    model, feeds = while_loop(m)
    (y,) = check(model, feeds)
    steps = np.round((y - feeds["x"]) / 0.75).astype(int)
    assert len(set(steps.ravel())) == 1
    if expected is not None:
        assert steps.flat[0] == expected


@pytest.mark.parametrize("m,cond,shape,empty", [
    (0, None, None, (0,)),  # element shape unknown: rank 1, as onnxruntime
    (5, False, ["N", 3], (0, 0, 3)),  # known: its dims, unknown ones 0
    (0, None, [2, 3], (0, 2, 3)),
], ids=["trip_count_0", "cond_false", "static_shape"])
def test_loop_with_zero_iterations_gives_the_initial_values_and_empty_scans(m: int, cond: bool | None, shape: list[Any] | None,
                                                                            empty: tuple[int, ...]) -> None:
    model, feeds = counting_loop(m, cond, dynamic_batch=True, shape=shape)
    acc, scan, iters = check(model, feeds)
    assert scan.shape == empty and scan.dtype == np.float32
    assert iters.shape == (0,) and iters.dtype == np.int64
    assert not np.shares_memory(acc, feeds["x"])
    np.testing.assert_array_equal(acc, feeds["x"])


@pytest.mark.parametrize("executor", EXECUTORS)
def test_loop_with_dynamic_batch(executor: str) -> None:
    model, _ = counting_loop(3, None, dynamic_batch=True, shape=["N", 3])
    graph = from_proto(model)
    exe = RUNTIME.prepare(graph, {"executor": executor})
    for batch in (1, 5):
        x = f32(batch, 3)
        want = run_ort(model, {"x": x})
        for g, w in zip(exe.run([x]), want):
            np.testing.assert_allclose(g, w, **TOL)
    assert graph.values["acc_final"].shape == (-1, 3)
    assert graph.values["scan"].shape == (-1, -1, 3) and graph.values["iters"].shape == (-1,)


def test_iteration_number_goes_in_with_the_rank_the_body_declares() -> None:
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"], name="b_c"), helper.make_node("Identity", ["i"], ["i_out"], name="b_i")],
        "body", [vi("i", T.INT64, [1]), vi("c", T.BOOL, [1])], [vi("c_out", T.BOOL, [1]), vi("i_out", T.INT64, [1])])
    model = make_model([helper.make_node("Loop", ["M", ""], ["iters"], name="loop", body=body)], {}, ["iters"],
                       {"M": np.array(3, np.int64)})
    (iters,) = check(model, {})
    assert iters.shape == (3, 1)


# ---------------------------------------------------------------------------- If

def if_model(nested: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """y = If(sum(x) > 0): then a Loop (nested) or x * k, else -x; both branches read x and k
    (an outer initializer) from the outer scope, the nested Loop's body from two scopes out."""
    if nested:
        body = helper.make_graph(
            [helper.make_node("Mul", ["acc", "k"], ["ak"], name="nb_mul"), helper.make_node("Add", ["ak", "x"], ["acc_out"], name="nb_add"),
             helper.make_node("Identity", ["c"], ["c_out"], name="nb_c")],
            "nested_body", [vi("i", T.INT64, []), vi("c", T.BOOL, []), vi("acc", T.FLOAT, None)],
            [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, None)])
        then = helper.make_graph([helper.make_node("Loop", ["M", "", "x"], ["t"], name="inner_loop", body=body)],
                                 "then", [], [vi("t", T.FLOAT, None)])
    else:
        then = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["t"], name="then_mul")], "then", [], [vi("t", T.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="else_neg")], "else", [], [vi("e", T.FLOAT, None)])
    nodes = [node("ReduceSum", ["x"], ["sum"], keepdims=0), node("Greater", ["sum", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other)]
    inits = {"zero": np.array(0.0, np.float32), "k": np.array(0.5, np.float32), "M": np.array(3, np.int64)}
    return make_model(nodes, {"x": f32(2, 3)}, ["y"], inits), {}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "loop_in_if"])
def test_if_takes_the_branch_its_condition_names(nested: bool, executor: str) -> None:
    model, _ = if_model(nested)
    x = f32(2, 3)
    for sign in (1.0, -1.0):
        feeds = {"x": (sign * np.abs(x)).astype(np.float32)}
        check(model, feeds, executor)


def test_captures_are_explicit_operands_and_subgraph_inputs() -> None:
    graph = from_proto(if_model(nested=True)[0])
    (if_node,) = [n for n in graph.nodes if n.op == "If"]
    # the union of both branches' captures in first-use order (else_branch is the first attribute)
    assert if_node.inputs == ["c", "x", "M", "k"] and if_node.captures == 3
    then, other = if_node.attrs["then_branch"], if_node.attrs["else_branch"]
    assert [v.name for v in then.inputs] == [v.name for v in other.inputs] == ["x", "M", "k"]
    (inner,) = then.nodes  # the nested body's captures (k, x) became the inner Loop's operands, then the branch's
    assert inner.inputs == ["M", "", "x", "k", "x"] and inner.captures == 2
    assert [v.name for v in inner.attrs["body"].inputs] == ["i", "c", "acc", "k", "x"]


def test_if_condition_must_be_one_element() -> None:
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"], name="t")], "then", [], [vi("t", T.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="e")], "else", [], [vi("e", T.FLOAT, None)])
    model = make_model([helper.make_node("If", ["c", ], ["y"], name="if", then_branch=then, else_branch=other)],
                       {"c": np.array([True, False]), "x": f32(2)}, ["y"])
    (y,) = run_kubetrt(model, {"c": np.array([True]), "x": np.ones(2, np.float32)})
    np.testing.assert_array_equal(y, [1.0, 1.0])
    with pytest.raises(Exception, match="If condition must have exactly one element"):
        run_kubetrt(model, {"c": np.array([True, False]), "x": np.ones(2, np.float32)})


# ---------------------------------------------------------------------------- outputs never alias

def outer_value_if(through: str | None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """t = x + 1 is read by the If (whose then-branch returns t, `through` an op that may hand its
    operand back, or directly) and later by Mul; Relu may overwrite the If's output in place,
    which must not reach t."""
    then = helper.make_graph([] if through is None else [helper.make_node(through, ["t"], ["tt"], name="tt")], "then", [],
                             [vi("t" if through is None else "tt", T.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["t"], ["e"], name="e")], "else", [], [vi("e", T.FLOAT, None)])
    nodes = [node("Add", ["x", "one"], ["t"]),
             helper.make_node("If", ["c"], ["o"], name="if", then_branch=then, else_branch=other),
             node("Relu", ["o"], ["r"]), node("Mul", ["t", "three"], ["m"])]
    feeds = {"x": -np.abs(f32(4)) - 2, "c": np.array(True)}
    return make_model(nodes, feeds, ["r", "m"], {"one": np.array(1.0, np.float32), "three": np.array(3.0, np.float32)}), feeds


@pytest.mark.parametrize("through", ["Identity", "Sum"])
def test_if_returning_an_outer_value_yields_a_copy(through: str) -> None:
    model, feeds = outer_value_if(through)
    prog = compile_graph(from_proto(copy.deepcopy(model)), subgraph_plan=SequentialPlan)
    assert any(k.op == "Relu" and k.inplace for k in prog.kernels), "the test needs Relu to run in place"
    check(model, feeds)


def test_if_returning_an_outer_value_directly_yields_a_copy() -> None:
    """An outer value as the branch's output itself, which onnxruntime refuses to load."""
    model, feeds = outer_value_if(None)
    r, m = run_kubetrt(model, feeds)
    np.testing.assert_array_equal(r, np.zeros(4, np.float32))
    np.testing.assert_allclose(m, (feeds["x"] + 1) * 3, **TOL)
    exported = graph_to_onnx(from_proto(model))  # exports with an Identity onnxruntime accepts
    for g, w in zip(run_ort(exported, feeds), (r, m)):
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("m", [0, 2])
def test_loop_passing_a_value_through_yields_a_copy(m: int) -> None:
    body = helper.make_graph([helper.make_node("Identity", ["c"], ["c_out"], name="b_c")], "body",
                             [vi("i", T.INT64, []), vi("c", T.BOOL, []), vi("v", T.FLOAT, None)],
                             [vi("c_out", T.BOOL, []), vi("v", T.FLOAT, None)])
    nodes = [node("Add", ["x", "one"], ["t"]), helper.make_node("Loop", ["M", "", "t"], ["o"], name="loop", body=body),
             node("Relu", ["o"], ["r"]), node("Mul", ["t", "three"], ["m"])]
    feeds = {"x": -np.abs(f32(4)) - 2}
    inits = {"one": np.array(1.0, np.float32), "three": np.array(3.0, np.float32), "M": np.array(m, np.int64)}
    check(make_model(nodes, feeds, ["r", "m"], inits), feeds)


# ---------------------------------------------------------------------------- Scan

def scan_model(in_axes: list[int] | None, in_dirs: list[int] | None, out_axes: list[int] | None, out_dirs: list[int] | None,
               dynamic_batch: bool = False) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """state' = state + a_t * b_t; outputs state' * w (w outer) and a_t - state'; a is (N, T, 4) or
    (T, N, 4) along in_axes[0], b is (T, 4) or (4, T) along in_axes[1]. None: the attribute is
    left out (the spec's default, 0s)."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["a_t", "b_t"], ["ab"], name="s_mul"), helper.make_node("Add", ["s", "ab"], ["s_out"], name="s_add"),
         helper.make_node("Mul", ["s_out", "w"], ["y1"], name="s_w"), helper.make_node("Sub", ["a_t", "s_out"], ["y2"], name="s_sub")],
        "scan_body", [vi("s", T.FLOAT, ["N", 4]), vi("a_t", T.FLOAT, ["N", 4]), vi("b_t", T.FLOAT, [4])],
        [vi("s_out", T.FLOAT, ["N", 4]), vi("y1", T.FLOAT, ["N", 4]), vi("y2", T.FLOAT, ["N", 4])])
    axes = in_axes or [0, 0]
    a = f32(2, 5, 4) if axes[0] in (1, -2) else f32(5, 2, 4)
    b = f32(5, 4) if axes[1] in (0, -2) else f32(4, 5)
    feeds = {"s0": f32(2, 4), "a": a, "b": b}
    attrs = {k: v for k, v in [("scan_input_axes", in_axes), ("scan_input_directions", in_dirs),
                               ("scan_output_axes", out_axes), ("scan_output_directions", out_dirs)] if v is not None}
    scan = helper.make_node("Scan", ["s0", "a", "b"], ["s_final", "y1s", "y2s"], name="scan", body=body, num_scan_inputs=2, **attrs)
    return make_model([scan], feeds, ["s_final", "y1s", "y2s"], {"w": f32(4)}, dynamic_batch), feeds


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("in_axes,in_dirs,out_axes,out_dirs", [
    (None, None, None, None),
    ([1, 0], [0, 0], [0, 0], [0, 0]),
    ([1, 0], [1, 0], [1, 0], [0, 1]),
    ([-2, 1], [0, 1], [-1, 2], [1, 0]),
], ids=["defaults", "forward", "reverse_input_and_output", "negative_axes"])
def test_scan_axes_and_directions_match_onnxruntime(in_axes: list[int] | None, in_dirs: list[int] | None,
                                                    out_axes: list[int] | None, out_dirs: list[int] | None, executor: str) -> None:
    model, feeds = scan_model(in_axes, in_dirs, out_axes, out_dirs)
    check(model, feeds, executor)


def test_scan_of_opset_8_is_refused_at_import() -> None:
    model, _ = scan_model(None, None, None, None)
    model.opset_import[0].version = 8
    with pytest.raises(RuntimeModelError, match=r"node scan \(Scan\): opset 8 Scan .* supported: Scan from opset 9 on"):
        from_proto(model)


def test_scan_with_dynamic_batch() -> None:
    model, feeds = scan_model([1, 0], [1, 0], [1, -1], [0, 1], dynamic_batch=True)
    graph = from_proto(model)
    exe = RUNTIME.prepare(graph, {})
    for batch in (1, 3):
        ins = {"s0": f32(batch, 4), "a": f32(batch, 5, 4), "b": feeds["b"]}
        for g, w in zip(exe.run([ins[v.name] for v in graph.inputs]), run_ort(model, ins)):
            np.testing.assert_allclose(g, w, **TOL)
    assert graph.values["y1s"].shape == (-1, 5, 4) and graph.values["y2s"].shape == (-1, 4, 5)


def test_scan_refuses_what_it_does_not_support() -> None:
    model, feeds = scan_model([1, 0], [0, 2], [0, 0], [0, 0])
    with pytest.raises(UnsupportedOpError, match=r"node 'scan' \(Scan\): scan_input_directions=\[0, 2\].*0 \(forward\) or 1"):
        run_kubetrt(model, feeds)
    model, feeds = scan_model([1, 0], [0, 0], [0], [0, 0])
    with pytest.raises(UnsupportedOpError, match=r"scan_output_axes=\[0\] for 2 values"):
        run_kubetrt(model, feeds)


# ---------------------------------------------------------------------------- compile, refuse, export

def test_subgraphs_run_only_compiled() -> None:
    with pytest.raises(UnsupportedOpError, match="sub-graph body is not compiled"):
        ops.call("Loop", np.array(2, np.int64), None, np.ones(2, np.float32))
    model, _ = counting_loop(2, None)
    with pytest.raises(UnsupportedOpError, match=r"node loop \(Loop\): sub-graph body needs an executor"):
        compile_graph(from_proto(model))


def test_constant_captures_become_constants_of_the_subgraph() -> None:
    model, _ = counting_loop(2, None)
    graph = from_proto(model)
    (loop,) = [n for n in graph.nodes if n.op == "Loop"]
    assert loop.inputs == ["M", "", "x", "w", "u"] and loop.attrs[CAPTURES] == 2
    compile_graph(graph, subgraph_plan=SequentialPlan)
    body: Graph = loop.attrs["body"]
    assert loop.inputs == ["M", "", "x", "u"] and loop.captures == 1
    assert [v.name for v in body.inputs] == ["i", "c", "acc", "u"] and "w" in body.constants


def test_the_capture_key_is_one_key() -> None:
    assert CAPTURES == control_flow.CAPTURES and not CAPTURES.isidentifier()


def _export_cases() -> list[tuple[onnx.ModelProto, dict[str, np.ndarray]]]:
    return [counting_loop(3, None, shape=[2, 3]), counting_loop(0, None, dynamic_batch=True, shape=["N", 3]),
            while_loop(None), (if_model(True)[0], {"x": np.abs(f32(2, 3))}), scan_model([1, 0], [1, 0], [1, -1], [0, 1])]


@pytest.mark.parametrize("case", range(5))
def test_export_round_trips_through_onnxruntime(case: int) -> None:
    model, feeds = _export_cases()[case]
    exported = graph_to_onnx(from_proto(model))
    for g, w in zip(run_ort(exported, feeds), run_ort(model, feeds)):
        np.testing.assert_allclose(g, w, **TOL)


@pytest.mark.parametrize("new_name", ["u_renamed", "acc_out"], ids=["renamed", "shadowing_an_inner_name"])
def test_export_reads_a_renamed_capture_by_its_outer_name(new_name: str) -> None:
    """Passes rename outer values (fusion, layout); the sub-graph keeps its own name for them."""
    model, feeds = counting_loop(3, None, shape=[2, 3])
    graph = from_proto(model)
    for n in graph.nodes:
        n.inputs = [new_name if x == "u" else x for x in n.inputs]
        n.outputs = [new_name if x == "u" else x for x in n.outputs]
    exported = graph_to_onnx(graph)
    for g, w in zip(run_ort(exported, feeds), run_ort(model, feeds)):
        np.testing.assert_allclose(g, w, **TOL)


class _Ort:
    """onnxruntime running an exported segment, where TensorRT would run it."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model

    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]:
        return run_ort(self.model, dict(zip([v.name for v in self.model.graph.input], feeds)))


@pytest.mark.parametrize("reject", ["Loop", "Mul"], ids=["loop_falls_back", "loop_in_exported_segment"])
def test_partitioned_segments_with_a_loop_chain_to_onnxruntime(reject: str) -> None:
    """The Loop's capture u comes from another segment: a boundary value like any operand."""
    model, feeds = counting_loop(3, None, shape=[2, 3])
    graph = from_proto(model)
    segs = partition(graph, lambda n: n.op != reject)
    assert [s.supported for s in segs] == ([True, False] if reject == "Loop" else [False, True])
    loop_seg = next(s for s in segs if any(n.op == "Loop" for n in s.nodes))
    assert loop_seg.inputs == ["x", "u"]
    exes = [_Ort(export_segment(graph, s)) if s.supported else RUNTIME.prepare(segment_graph(graph, s), {}) for s in segs]
    for g, w in zip(SegmentRunner(graph, segs, exes).run([feeds["x"]]), run_ort(model, feeds)):
        np.testing.assert_allclose(g, w, **TOL)


def test_cuda_runtime_runs_control_flow_as_host_fallback_steps() -> None:
    model, feeds = counting_loop(3, None)
    exe = CudaRuntime(NumpyStandIn()).prepare(from_proto(model), {"precision": "fp32"})
    assert exe.plan.fallback_ops == ["Loop"]
    for g, w in zip(exe.run([feeds["x"]]), run_ort(model, feeds)):
        np.testing.assert_allclose(g, w, **TOL)


# ---------------------------------------------------------------------------- a real tf2onnx conversion

def test_tf2onnx_while_loop_with_a_cond_inside_matches_tensorflow() -> None:
    from kubetrt.pipeline.ingest import tensorflow

    tf = tensorflow()
    import tf2onnx

    w = np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def f(x: Any) -> Any:
        def body(i: Any, h: Any, acc: Any) -> Any:
            h2 = tf.cond(tf.reduce_sum(h) > 0.0, lambda: tf.tanh(tf.matmul(h, w)) + x, lambda: h * 0.5 - x)
            return i + 1, h2, acc + tf.reduce_mean(h2)

        _, h, acc = tf.while_loop(lambda i, h, acc: i < 6, body, [tf.constant(0), x, tf.constant(0.0)])
        return h, acc

    model, _ = tf2onnx.convert.from_function(f, input_signature=f.input_signature, opset=17)
    assert {"Loop", "If"} <= {n.op_type for n in model.graph.node} | {
        n.op_type for g in model.graph.node for a in g.attribute if a.type == onnx.AttributeProto.GRAPH for n in a.g.node}
    graph = from_proto(model)
    for executor in EXECUTORS:
        exe = RUNTIME.prepare(copy.deepcopy(graph), {"executor": executor})
        for batch in (1, 3):
            x = rng.standard_normal((batch, 4)).astype(np.float32)
            want = [t.numpy() for t in f(tf.constant(x))]
            for g, t in zip(exe.run([x]), want):
                np.testing.assert_allclose(g, t, rtol=1e-4, atol=1e-5)
