"""Primitive chains: a plan's runs of oneDNN steps, captured on the first call with an input
signature, run as one compiled call on later calls. Watched by what they change: oneDNN's call
sites see no Python call on a captured run, the results stay onnxruntime's (fp32 tolerance
rtol/atol 1e-4, as for the other kernels) and the generic plan's to the bit."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime import capture
from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.executor import SequentialPlan
from kubetrt.runtime.kernels import omp, primitive_chain
from kubetrt.runtime.kernels.primitive_chain import PrimitiveChain
from kubetrt.runtime.onnx_import import from_proto
from onnx_cases import make_model, node, run_ort
from threads import on_threads

pytestmark = pytest.mark.skipif(not primitive_chain.AVAILABLE, reason="chains need the onednn extra and numba")
rng = np.random.default_rng(5)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def inverted_residual(outputs: tuple[str, ...] = ("g",)) -> Any:
    """A MobileNet-like block: stem, 1x1 expand, depthwise, 1x1 project summed onto the stem's
    output (which dies there: in place), max pool, global average. An 8-channel input: the stem
    stays a oneDNN convolution (Winograd's form takes 16 channels or more)."""
    nodes = [node("Conv", ["x", "w0"], ["s0"], pads=[1, 1, 1, 1]), node("Relu", ["s0"], ["s"]),
             node("Conv", ["s", "w1"], ["a0"]), node("Relu", ["a0"], ["a"]),
             node("Conv", ["a", "w2"], ["b0"], pads=[1, 1, 1, 1], group=32), node("Relu", ["b0"], ["b"]),
             node("Conv", ["b", "w3"], ["c"]), node("Add", ["c", "s"], ["d"]),
             node("MaxPool", ["d"], ["p"], kernel_shape=[2, 2], strides=[2, 2]), node("GlobalAveragePool", ["p"], ["g"])]
    consts = {"w0": f32(16, 8, 3, 3), "w1": f32(32, 16, 1, 1), "w2": f32(32, 1, 3, 3), "w3": f32(16, 32, 1, 1)}
    return make_model(nodes, {"x": f32(1, 8, 12, 12)}, list(outputs), consts, dynamic_batch=True)


def prepared(model: Any) -> SequentialPlan:
    plan = RUNTIME.prepare(from_proto(model), {})
    assert isinstance(plan, SequentialPlan)
    return plan


def chains(plan: SequentialPlan, x: np.ndarray) -> list[PrimitiveChain]:
    """The chains of the plan captured for x's signature."""
    return [run for run, *_ in plan.captured_steps([x]) or [] if isinstance(run, PrimitiveChain)]


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_later_calls_run_the_captured_chain_with_the_same_results(batch: int, onednn_calls: list) -> None:
    model = inverted_residual()
    plan = prepared(model)
    xs = [f32(batch, 8, 12, 12) for _ in range(3)]
    first = plan.run([xs[0]])[0]
    assert [kind for kind, _ in onednn_calls].count("Conv") == 4  # the capture run is the plan's own steps
    onednn_calls.clear()
    got = [plan.run([x])[0] for x in xs]
    assert onednn_calls == []  # every oneDNN step ran in a chain
    (chain,) = chains(plan, xs[0])
    assert len(chain.rows) >= 5  # four convolutions and the max pool, at batch 8 the global pool too
    np.testing.assert_array_equal(got[0], first)
    for x, y in zip(xs, got):
        np.testing.assert_allclose(y, run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(y, plan._compiled[1](x)[0])  # type: ignore[index]  # the generic plan's bits


def test_results_are_fresh_arrays_not_the_chains_memory() -> None:
    plan = prepared(inverted_residual(("g", "d")))
    x1, x2 = f32(2, 8, 12, 12), f32(2, 8, 12, 12)
    plan.run([x1])
    g1, d1 = plan.run([x1])
    keep = g1.copy(), d1.copy()
    g2, d2 = plan.run([x2])
    np.testing.assert_array_equal(g1, keep[0])
    np.testing.assert_array_equal(d1, keep[1])
    assert not np.shares_memory(d1, d2) and not np.shares_memory(g1, g2)


def test_a_residual_read_later_keeps_its_values() -> None:
    # s is the sum's residual and a graph output: the sum may not land in it, chained or not
    model = inverted_residual(("g", "s"))
    plan = prepared(model)
    x = f32(1, 8, 12, 12)
    ref = run_ort(model, {"x": x})
    for _ in range(3):
        for got, want in zip(plan.run([x]), ref):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_the_callers_input_is_never_written() -> None:
    # an NHWC model whose input is the residual: the chain's in-place sum must not land in it
    nodes = [node("Conv", ["x", "w1"], ["a0"], pads=[1, 1, 1, 1]), node("Relu", ["a0"], ["a"]),
             node("Conv", ["a", "w2"], ["c"], pads=[1, 1, 1, 1]), node("Add", ["c", "x"], ["y"])]
    model = make_model(nodes, {"x": f32(1, 16, 8, 8)}, ["y"], {"w1": f32(16, 16, 3, 3) * 0.1, "w2": f32(16, 16, 3, 3) * 0.1})
    plan = prepared(model)
    x = f32(1, 16, 8, 8)
    before = x.copy()
    for _ in range(3):
        np.testing.assert_allclose(plan.run([x])[0], run_ort(model, {"x": before})[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(x, before)


def test_callers_on_several_threads_get_their_own_results() -> None:
    model = inverted_residual(("g", "d"))
    plan = prepared(model)
    inputs = [f32(1, 8, 12, 12) for _ in range(4)]
    expected = [run_ort(model, {"x": x}) for x in inputs]
    plan.run([inputs[0]])

    def work(t: int) -> None:
        for _ in range(20):
            for got, want in zip(plan.run([inputs[t]]), expected[t]):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    on_threads(work, list(range(4)))
    assert len(chains(plan, inputs[0])[0]._idle) >= 1  # arenas given back, one per caller that ran at once


def test_a_chain_on_one_thread_gives_the_same_results(monkeypatch: pytest.MonkeyPatch) -> None:
    model = inverted_residual()
    plan = prepared(model)
    x = f32(3, 8, 12, 12)
    team = plan.run([x])[0], plan.run([x])[0]
    picked: list[bool] = []
    real = omp.TeamChoice.pick

    def alone(self: omp.TeamChoice) -> bool:
        real(self)
        picked.append(True)
        return True
    monkeypatch.setattr(omp.TeamChoice, "pick", alone)
    np.testing.assert_array_equal(plan.run([x])[0], team[1])
    assert picked


def test_inputs_of_another_shape_take_the_replaced_steps() -> None:
    model = inverted_residual()
    plan = prepared(model)
    x = f32(1, 8, 12, 12)
    plan.run([x])
    plan.run([x])
    (chain,) = chains(plan, x)
    other = f32(2, 12, 12, 8)  # what the chain's first step reads, for a batch it was not captured for
    (want,) = chain.fallback(other)
    got = chain(other)
    np.testing.assert_array_equal(got[0], want)


def test_no_chain_where_the_arena_would_exceed_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capture, "ARENA_LIMIT", 1024)
    plan = prepared(inverted_residual())
    x = f32(1, 8, 12, 12)
    plan.run([x])
    assert plan.captured_steps([x]) is None
    assert ((x.shape, x.dtype),) in plan._captured


@pytest.mark.parametrize("text,enabled", [("", True), ("1", True), ("0", False)])
def test_chains_setting(text: str, enabled: bool) -> None:
    assert capture.chains_enabled({capture.CHAINS_ENV: text}) == enabled


def test_a_wrong_chains_setting_is_named() -> None:
    with pytest.raises(ValueError, match=r"KUBETRT_PRIMITIVE_CHAINS='yes': expected 1 .* or 0"):
        capture.chains_enabled({capture.CHAINS_ENV: "yes"})


def se_and_head() -> Any:
    """conv, a squeeze-and-excitation block (its team kernel), conv, global average (the one-thread
    kernel), flatten and a dense classifier head with its softmax (the packed dense chain): all of it one chain."""
    nodes = [node("Conv", ["x", "w0"], ["d0"], pads=[1, 1, 1, 1]), node("Relu", ["d0"], ["d"]),
             node("GlobalAveragePool", ["d"], ["s"]), node("Conv", ["s", "w1", "b1"], ["r0"]), node("Relu", ["r0"], ["r"]),
             node("Conv", ["r", "w2", "b2"], ["g0"]), node("Sigmoid", ["g0"], ["g"]), node("Mul", ["d", "g"], ["e"]),
             node("Conv", ["e", "w3"], ["f"], pads=[1, 1, 1, 1]), node("GlobalAveragePool", ["f"], ["p"]),
             node("Flatten", ["p"], ["q"]), node("MatMul", ["q", "wd"], ["m"]), node("Add", ["m", "bd"], ["logits"]),
             node("Softmax", ["logits"], ["probs"], axis=-1)]
    consts = {"w0": f32(32, 16, 3, 3) * 0.2, "w1": f32(8, 32, 1, 1) * 0.3, "b1": f32(8), "w2": f32(32, 8, 1, 1) * 0.5,
              "b2": f32(32), "w3": f32(32, 32, 3, 3) * 0.2, "wd": f32(32, 10), "bd": f32(10)}
    return make_model(nodes, {"x": f32(1, 16, 10, 10)}, ["probs"], consts, dynamic_batch=True)


@pytest.mark.parametrize("batch", [1, 2])
def test_jitted_kernels_between_the_primitives_join_the_chain(batch: int, onednn_calls: list) -> None:
    model = se_and_head()
    plan = prepared(model)
    ops = [k.op for k in plan.prog.kernels]
    assert {"SqueezeExciteNHWC", "GlobalAveragePoolNHWC", "DenseChain"} <= set(ops), ops
    x = f32(batch, 16, 10, 10)
    first = plan.run([x])[0]
    steps = plan.captured_steps([x]) or []
    assert len(steps) == 2 and isinstance(steps[1][0], PrimitiveChain)  # the input's layout change, then one chain
    kinds = [type(row.step).__name__ for row in steps[1][0].rows]
    assert kinds == ["Site", "SqueezeExciteCall", "Site", "KernelCall", "KernelCall"], kinds  # the flatten hands its input through
    onednn_calls.clear()
    for _ in range(2):
        x2 = f32(batch, 16, 10, 10)
        got = plan.run([x2])[0]
        np.testing.assert_allclose(got, run_ort(model, {"x": x2})[0], rtol=1e-4, atol=1e-4)
    assert onednn_calls == []
    np.testing.assert_array_equal(plan.run([x])[0], first)


def test_a_chain_with_kernel_calls_on_one_thread_keeps_the_results(monkeypatch: pytest.MonkeyPatch) -> None:
    model = se_and_head()
    plan = prepared(model)
    x = f32(2, 16, 10, 10)
    plan.run([x])
    monkeypatch.setattr(omp.TeamChoice, "pick", lambda self: True)
    # a sum split over fewer threads adds in another order: onnxruntime's tolerance, not the team's bits
    np.testing.assert_allclose(plan.run([x])[0], run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-6)


def test_a_plan_no_chain_can_form_in_never_captures() -> None:
    # a dense head alone: one step that may join a chain, none beside it, so no signature is even computed
    nodes = [node("MatMul", ["x", "w"], ["m"]), node("Relu", ["m"], ["y"])]
    model = make_model(nodes, {"x": f32(1, 32)}, ["y"], {"w": f32(32, 16)}, dynamic_batch=True)
    plan = prepared(model)
    for batch in (1, 2):
        x = f32(batch, 32)
        np.testing.assert_allclose(plan.run([x])[0], run_ort(model, {"x": x})[0], rtol=1e-4, atol=1e-4)
    assert plan._captured == {}
