"""The dataflow executor: concurrency of independent kernels, errors as values, AsyncValue."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from kubetrt.runtime import KernelError
from kubetrt.runtime.executor import AsyncValue
from kubetrt.runtime.kernels.registry import register, same_as_input
from onnx_cases import make_model, node, run_kubetrt

RENDEZVOUS = {"barrier": threading.Barrier(2, timeout=10)}
CALLS: list[str] = []


@register("TestRendezvous", same_as_input)
def _rendezvous(spec):  # type: ignore[no-untyped-def]
    """Test-only kernel: returns only once a second kernel is running at the same time."""
    def run(x):  # type: ignore[no-untyped-def]
        RENDEZVOUS["barrier"].wait()
        return (x + 1,)
    return run


@register("TestFail", same_as_input)
def _fail(spec):  # type: ignore[no-untyped-def]
    def run(x):  # type: ignore[no-untyped-def]
        raise FloatingPointError("boom")
    return run


@register("TestRecord", same_as_input)
def _record(spec):  # type: ignore[no-untyped-def]
    def run(x):  # type: ignore[no-untyped-def]
        CALLS.append(spec.name)
        return (x,)
    return run


def _model(nodes, outputs):  # type: ignore[no-untyped-def]
    import onnx
    from onnx import helper

    graph = helper.make_graph(
        nodes, "t", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, [2]) for o in outputs],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_independent_kernels_run_concurrently_on_the_pool() -> None:
    RENDEZVOUS["barrier"] = threading.Barrier(2, timeout=10)
    model = _model([node("TestRendezvous", ["x"], ["a"]), node("TestRendezvous", ["x"], ["b"]), node("Add", ["a", "b"], ["y"])], ["y"])
    x = np.ones(2, np.float32)
    (y,) = run_kubetrt(model, {"x": x}, "dataflow")  # would deadlock (BrokenBarrierError) if serialized
    np.testing.assert_array_equal(y, [4.0, 4.0])


def test_sequential_plan_really_is_sequential() -> None:
    RENDEZVOUS["barrier"] = threading.Barrier(2, timeout=0.5)
    model = _model([node("TestRendezvous", ["x"], ["a"]), node("TestRendezvous", ["x"], ["b"]), node("Add", ["a", "b"], ["y"])], ["y"])
    with pytest.raises(KernelError, match="TestRendezvous"):
        run_kubetrt(model, {"x": np.ones(2, np.float32)}, "sequential")


def test_error_flows_to_dependents_as_a_value_not_running_them() -> None:
    CALLS.clear()
    model = _model(
        [
            node("TestFail", ["x"], ["bad"]),
            node("TestRecord", ["bad"], ["after_bad"]),
            node("TestRecord", ["x"], ["good"]),
        ],
        ["after_bad", "good"],
    )
    with pytest.raises(KernelError) as err:
        run_kubetrt(model, {"x": np.ones(2, np.float32)}, "dataflow")
    assert "TestFail" in str(err.value) and "testfail_bad" in str(err.value) and "boom" in str(err.value)
    assert CALLS == ["testrecord_good"]  # the independent branch ran, the dependent did not


def test_async_value_callbacks_fire_once_in_order() -> None:
    av = AsyncValue()
    seen: list[object] = []
    av.and_then(lambda v: seen.append(v.value))
    av.set_value(3)
    av.and_then(lambda v: seen.append(v.value * 2))
    assert seen == [3, 6]
    with pytest.raises(RuntimeError):
        av.set_value(4)
    bad = AsyncValue()
    bad.set_error(ValueError("x"))
    assert bad.is_error and isinstance(bad.value, ValueError)


def test_dataflow_infer_is_awaitable(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from kubetrt.runtime.devices.host import RUNTIME
    from kubetrt.runtime.onnx_import import from_proto

    model = make_model([node("Relu", ["x"], ["a"]), node("Neg", ["x"], ["b"]), node("Add", ["a", "b"], ["y"])], {"x": np.ones(3, np.float32)}, ["y"])
    exe = RUNTIME.prepare(from_proto(model), {"executor": "dataflow"})

    async def go():  # type: ignore[no-untyped-def]
        return await asyncio.wrap_future(exe.run_async([np.array([1.0, -2.0, 3.0], np.float32)]))

    (y,) = asyncio.run(go())
    np.testing.assert_array_equal(y, [0.0, 2.0, 0.0])
