"""Shape-specialized plans: a graph that computes shapes at run time (Shape -> Gather -> Concat ->
Reshape, as converters emit for a dynamic batch) gets, per input signature, a plan compiled with
those shapes, where the chain has folded away; results stay onnxruntime's."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.onnx_import import from_proto
from kubetrt.runtime.specialize import SHAPE_OPS, ShapeSpecializedPlan
from onnx_cases import make_model, node, run_ort

rng = np.random.default_rng(3)


def dynamic_reshape_model():  # type: ignore[no-untyped-def]
    # y = relu(reshape(x @ w, [batch, 4, 6]) * 2): the target shape is computed from x's shape
    nodes = [
        node("MatMul", ["x", "w"], ["h"]),
        node("Shape", ["x"], ["s"]),
        node("Gather", ["s", "zero"], ["n"], axis=0),
        node("Concat", ["n", "tail"], ["target"], axis=0),
        node("Reshape", ["h", "target"], ["r"]),
        node("Mul", ["r", "two"], ["m"]),
        node("Relu", ["m"], ["y"]),
    ]
    consts = {"w": rng.standard_normal((8, 24)).astype(np.float32), "zero": np.array([0], np.int64),
              "tail": np.array([4, 6], np.int64), "two": np.array(2.0, np.float32)}
    return make_model(nodes, {"x": np.zeros((1, 8), np.float32)}, ["y"], consts, dynamic_batch=True)


def shape_ops(plan) -> list[str]:  # type: ignore[no-untyped-def]
    return [k.op for k in plan.prog.kernels if k.op in SHAPE_OPS]


def test_each_batch_size_gets_a_plan_without_shape_work_and_the_same_numbers() -> None:
    model = dynamic_reshape_model()
    plan = RUNTIME.prepare(from_proto(model), {})
    assert isinstance(plan, ShapeSpecializedPlan)
    assert shape_ops(plan.generic) == ["Shape"], "the generic plan computes the target shape per call"
    for batch in (1, 5, 32):
        x = rng.standard_normal((batch, 8)).astype(np.float32)
        (ref,) = run_ort(model, {"x": x})
        (first,) = plan.run([x])  # served by the generic plan while the specialized one compiles
        special = plan.specialized([x])
        assert special is not plan.generic and shape_ops(special) == []
        assert len(special.prog.kernels) < len(plan.generic.prog.kernels)
        (again,) = plan.run([x])
        assert plan.plans[((batch, 8),)] is special, "later calls with this signature run the specialized plan"
        for got in (first, again):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_only_the_newest_signatures_are_kept() -> None:
    graph = from_proto(dynamic_reshape_model())
    generic = RUNTIME.prepare(graph, {})
    assert isinstance(generic, ShapeSpecializedPlan)
    plan = ShapeSpecializedPlan(generic.graph, generic.generic, generic.compile_plan, max_signatures=2)
    for batch in (1, 2, 3):
        plan.specialized([np.zeros((batch, 8), np.float32)])
    assert list(plan.plans) == [((2, 8),), ((3, 8),)]


def test_a_failing_specialization_leaves_the_generic_plan_serving(caplog: pytest.LogCaptureFixture) -> None:
    model = dynamic_reshape_model()
    graph = from_proto(model)
    generic = RUNTIME.prepare(graph, {})
    assert isinstance(generic, ShapeSpecializedPlan)

    def broken(_graph):  # type: ignore[no-untyped-def]
        raise RuntimeError("no kernel for this shape")

    plan = ShapeSpecializedPlan(generic.graph, generic.generic, broken)
    x = rng.standard_normal((3, 8)).astype(np.float32)
    assert plan.specialized([x]) is plan.generic
    assert ((3, 8),) in plan.failed and not plan.plans
    (got,) = plan.run([x])
    np.testing.assert_allclose(got, run_ort(model, {"x": x})[0], rtol=1e-5, atol=1e-5)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("shape specialization failed")]
    assert "no kernel for this shape" in record.fields["error"]  # type: ignore[attr-defined]


def test_static_graphs_and_graphs_without_shape_work_keep_the_plain_plan() -> None:
    nodes = [node("MatMul", ["x", "w"], ["h"]), node("Relu", ["h"], ["y"])]
    consts = {"w": rng.standard_normal((8, 4)).astype(np.float32)}
    for dynamic in (False, True):
        model = make_model(nodes, {"x": np.zeros((2, 8), np.float32)}, ["y"], consts, dynamic_batch=dynamic)
        assert not isinstance(RUNTIME.prepare(from_proto(model), {}), ShapeSpecializedPlan)
