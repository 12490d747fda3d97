"""A squeeze-and-excitation gate folded into the next 1x1 convolution's weights (runtime/kernels/
gate_fold.py). Watched by what it changes: a captured chain at one image runs the gate's weights
kernel and a convolution reading its HWIO weights from the arena instead of scaling the image;
the results stay onnxruntime's (fp32 tolerance from the one table, runtime/accuracy.py) on the
team, on one thread, on concurrent callers and where bands cut the runs around it; batches, small images, an image read again later
or summed into, and the switched-off setting keep the unfolded steps."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.executor import SequentialPlan
from kubetrt.runtime.kernels import bands, gate_fold, omp, onednn, primitive_chain
from kubetrt.runtime.kernels.primitive_chain import PrimitiveChain, Row
from kubetrt.runtime.kernels.squeeze_excite import SqueezeExciteCall
from kubetrt.runtime.onnx_import import from_proto
from onnx_cases import make_model, node, run_ort
from threads import on_threads

pytestmark = pytest.mark.skipif(not primitive_chain.AVAILABLE, reason="chains need the onednn extra and numba")
TOL = tolerance_for("fp32", "host")
rng = np.random.default_rng(17)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def gated_block(size: int = 16, project: int = 8, then: str = "conv") -> Any:
    """conv, a squeeze-and-excitation block, a 1x1 projection of its result, then: another conv
    ("conv"), the projection summed onto the gated image ("residual", 32 outputs), or the gated
    image read again ("reread")."""
    project = 32 if then == "residual" else project
    nodes = [node("Conv", ["x", "w0"], ["d0"], pads=[1, 1, 1, 1]), node("Relu", ["d0"], ["d"]),
             node("GlobalAveragePool", ["d"], ["s"]), node("Conv", ["s", "w1", "b1"], ["r0"]), node("Relu", ["r0"], ["r"]),
             node("Conv", ["r", "w2", "b2"], ["g0"]), node("Sigmoid", ["g0"], ["g"]), node("Mul", ["d", "g"], ["e"]),
             node("Conv", ["e", "wp", "bp"], ["p"])]
    if then == "conv":
        nodes.append(node("Conv", ["p", "w4"], ["y"], pads=[1, 1, 1, 1]))
    elif then == "residual":
        nodes.append(node("Add", ["p", "e"], ["y"]))
    else:
        nodes += [node("Conv", ["e", "w5"], ["q"]), node("Add", ["p", "q"], ["y"])]
    consts = {"w0": f32(32, 16, 3, 3) * 0.2, "w1": f32(8, 32, 1, 1) * 0.3, "b1": f32(8), "w2": f32(32, 8, 1, 1) * 0.5,
              "b2": f32(32), "wp": f32(project, 32, 1, 1) * 0.3, "bp": f32(project), "w4": f32(16, project, 3, 3) * 0.2,
              "w5": f32(project, 32, 1, 1) * 0.3}
    used = {i for n in nodes for i in n.input}
    return make_model(nodes, {"x": f32(1, 16, size, size)}, ["y"], {k: v for k, v in consts.items() if k in used},
                      dynamic_batch=True)


def prepared(model: Any) -> SequentialPlan:
    plan = RUNTIME.prepare(from_proto(model), {})
    assert isinstance(plan, SequentialPlan)
    return plan


def chain_rows(plan: SequentialPlan, x: np.ndarray) -> list[Row]:
    chains = [run for run, *_ in plan.captured_steps([x]) or [] if isinstance(run, PrimitiveChain)]
    assert len(chains) == 1, chains
    return chains[0].rows


def folded(rows: list[Row]) -> list[Row]:
    """The rows that read weights an earlier row wrote."""
    return [r for r in rows if r.weights is not None]


def check(plan: SequentialPlan, model: Any, x: np.ndarray) -> None:
    np.testing.assert_allclose(plan.run([x])[0], run_ort(model, {"x": x})[0], rtol=TOL.rtol, atol=TOL.atol)


def test_one_image_folds_the_gate_into_the_projection_weights() -> None:
    model = gated_block()
    plan = prepared(model)
    x = f32(1, 16, 16, 16)
    check(plan, model, x)  # the capture run: the plan's own steps
    rows = chain_rows(plan, x)
    (conv,) = folded(rows)
    gate = rows[rows.index(conv) - 1]
    assert not any(isinstance(r.step, SqueezeExciteCall) for r in rows)  # no row scales the image
    assert gate.dst == conv.weights and gate.src == conv.src  # the gate writes the weights, both read the image
    assert isinstance(conv.step, onednn.Site) and conv.step.op.weights_tag == onednn._library().tag_cdba
    for _ in range(3):
        check(plan, model, f32(1, 16, 16, 16))


def test_the_folded_chain_stays_within_tolerance_of_the_unfolded(monkeypatch: pytest.MonkeyPatch) -> None:
    model = gated_block()
    x = f32(1, 16, 16, 16)
    plan = prepared(model)
    plan.run([x])
    got = plan.run([x])[0]
    monkeypatch.setattr(gate_fold, "ENABLED", False)
    unfolded = prepared(model)
    unfolded.run([x])
    assert folded(chain_rows(unfolded, x)) == []
    want = unfolded.run([x])[0]
    np.testing.assert_allclose(got, want, rtol=TOL.rtol, atol=TOL.atol)


def test_one_thread_computes_the_same_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    model = gated_block()
    plan = prepared(model)
    x = f32(1, 16, 16, 16)
    plan.run([x])
    assert folded(chain_rows(plan, x))
    monkeypatch.setattr(omp.SteadyChoice, "pick", lambda self: True)
    monkeypatch.setattr(omp.SteadyChoice, "untimed", lambda self: False)
    check(plan, model, x)


def test_concurrent_callers_each_scale_their_own_weights() -> None:
    model = gated_block()
    plan = prepared(model)
    xs = [f32(1, 16, 16, 16) for _ in range(4)]
    plan.run([xs[0]])
    assert folded(chain_rows(plan, xs[0]))
    want = [run_ort(model, {"x": x})[0] for x in xs]

    def work(i: int) -> None:
        for _ in range(20):
            np.testing.assert_allclose(plan.run([xs[i]])[0], want[i], rtol=TOL.rtol, atol=TOL.atol)
    on_threads(work, list(range(4)))


def test_bands_leave_a_convolution_with_per_call_weights_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # every run of layers is worth cutting: the folded projection and the ReLU convolution after it
    # would be one, and a band binds each layer's own (unscaled) weights
    monkeypatch.setattr(bands, "MIN_GAIN_US", -np.inf)
    monkeypatch.setattr(bands, "MIN_GAIN_SHARE", 0.0)
    model = gated_block(then="conv")
    plan = prepared(model)
    x = f32(1, 16, 16, 16)
    check(plan, model, x)
    chains = [run for run, *_ in plan.captured_steps([x]) or [] if isinstance(run, PrimitiveChain)]
    (conv,) = folded(chains[0].rows)
    assert conv in chains[0].team_rows  # its own row on the team, not a band's layer
    check(plan, model, f32(1, 16, 16, 16))


@pytest.mark.parametrize("case", ["a batch of two", "a small image", "summed into", "read again", "switched off"])
def test_where_the_fold_does_not_apply_the_gate_scales_the_image(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    batch, size, then = {"a batch of two": (2, 16, "conv"), "a small image": (1, 3, "conv"), "summed into": (1, 16, "residual"),
                         "read again": (1, 16, "reread"), "switched off": (1, 16, "conv")}[case]
    if case == "switched off":
        monkeypatch.setattr(gate_fold, "ENABLED", False)
    model = gated_block(size, then=then)
    plan = prepared(model)
    x = f32(batch, 16, size, size)
    check(plan, model, x)
    rows = chain_rows(plan, x)
    assert folded(rows) == []
    assert any(isinstance(r.step, SqueezeExciteCall) for r in rows)
    check(plan, model, f32(batch, 16, size, size))


def test_worth_compares_pixels_with_outputs() -> None:
    assert gate_fold.worth((1, 16, 16, 32), 8)
    assert not gate_fold.worth((1, 3, 3, 32), 8)  # 9 pixels, 8 outputs: the weights are nearly the image's size


@pytest.mark.parametrize("text,enabled", [("", True), ("1", True), ("0", False)])
def test_gate_fold_setting(text: str, enabled: bool) -> None:
    assert gate_fold.gate_fold_enabled({gate_fold.GATE_FOLD_ENV: text}) == enabled


def test_a_wrong_gate_fold_setting_is_named() -> None:
    with pytest.raises(ValueError, match=r"KUBETRT_GATE_FOLD='on': expected 1 .* or 0"):
        gate_fold.gate_fold_enabled({gate_fold.GATE_FOLD_ENV: "on"})


def test_hwio_weights_are_for_ungrouped_convolutions() -> None:
    with pytest.raises(ValueError, match="HWIO weights are for ungrouped convolutions, got 4 groups"):
        onednn.Conv2D(f32(8, 2, 1, 1), None, 4, [1, 1], [1, 1], None, False, hwio_weights=True)
