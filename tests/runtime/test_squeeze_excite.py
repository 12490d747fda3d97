"""Squeeze-and-excitation blocks as one kernel (passes/squeeze_excite.py, kernels/squeeze_excite.py):
the host plan against onnxruntime on the block as ONNX writes it, at batches that take the team
kernel (NHWC) and the blocked path, and the team kernel at each team size against NumPy."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from kubetrt.runtime.kernels import jit, omp
from kubetrt.runtime.kernels.squeeze_excite import SqueezeExcite
from onnx_cases import make_model, node, run_ort, run_plan

rng = np.random.default_rng(47)
C, CR = 32, 8  # channels in whole blocks: batch 8 runs the blocked path


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def block(squeeze_act: str, gate_act: str, extra_reader: bool = False) -> tuple[onnx.ModelProto, list[str]]:
    """conv -> GlobalAveragePool -> 1x1 conv + act -> 1x1 conv + gate act -> Mul -> conv, as
    converters write it (Silu as Sigmoid and Mul)."""
    nodes = [node("Conv", ["x", "w0", "b0"], ["d"], pads=[1, 1, 1, 1]), node("GlobalAveragePool", ["d"], ["s"]),
             node("Conv", ["s", "w1", "b1"], ["r0"])]
    if squeeze_act == "Silu":
        nodes += [node("Sigmoid", ["r0"], ["r0s"]), node("Mul", ["r0", "r0s"], ["r"])]
    else:
        nodes.append(node(squeeze_act, ["r0"], ["r"]))
    nodes += [node("Conv", ["r", "w2", "b2"], ["g0"]), node(gate_act, ["g0"], ["g"]), node("Mul", ["d", "g"], ["y0"]),
              node("Conv", ["y0", "w3"], ["y"], pads=[1, 1, 1, 1])]
    outputs = ["y", "g"] if extra_reader else ["y"]
    consts = {"w0": f32(C, C, 3, 3) * 0.2, "b0": f32(C), "w1": f32(CR, C, 1, 1) * 0.3, "b1": f32(CR),
              "w2": f32(C, CR, 1, 1) * 0.5, "b2": f32(C), "w3": f32(C, C, 3, 3) * 0.2}
    model = make_model(nodes, {"x": f32(1, C, 9, 9)}, outputs, consts, dynamic_batch=True)
    return model, outputs


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("squeeze_act,gate_act", [("Silu", "Sigmoid"), ("Relu", "HardSigmoid"), ("Relu", "Sigmoid")])
def test_the_block_runs_as_one_kernel(batch: int, squeeze_act: str, gate_act: str, monkeypatch: pytest.MonkeyPatch, blocked_from_8: int) -> None:
    from kubetrt.runtime.passes import blocked

    monkeypatch.setattr(blocked, "CONVS_PER_REORDER", 1)  # so small a region pays for its reorders: batch 8 runs blocked
    model, _ = block(squeeze_act, gate_act)
    feeds = {"x": f32(batch, C, 9, 9)}
    seen: list[int] = []
    outputs, ops = run_plan(model, feeds, lambda op, args, out: seen.append(args[0].ndim) if op == "SqueezeExciteNHWC" else None)
    np.testing.assert_allclose(outputs[0], run_ort(model, feeds)[0], rtol=1e-4, atol=1e-4)
    assert ops.count("SqueezeExciteNHWC") == 1 and "GlobalAveragePoolNHWC" not in ops and "Mul" not in ops
    assert seen == [5 if batch >= 8 else 4]  # blocked from the blocked threshold up, NHWC (the team kernel) below


def test_a_gate_read_elsewhere_keeps_the_block_unfused() -> None:
    model, _ = block("Relu", "Sigmoid", extra_reader=True)
    feeds = {"x": f32(2, C, 9, 9)}
    outputs, ops = run_plan(model, feeds)
    for got, want in zip(outputs, run_ort(model, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert "SqueezeExciteNHWC" not in ops and "Mul" in ops


def numpy_reference(x: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray) -> np.ndarray:
    s = x.astype(np.float64).mean(axis=(1, 2))
    h = s @ w1.T + b1
    h = h / (1 + np.exp(-h))
    g = 1 / (1 + np.exp(-(h @ w2.T + b2)))
    return (x * g[:, None, None, :]).astype(np.float32)


@pytest.mark.skipif(not (jit.AVAILABLE and omp.PARALLEL), reason="the team kernel needs numba and libgomp")
@pytest.mark.parametrize("threads", [1, 2, 3])
# a batch the team divides runs whole images per member, another splits each image's rows
@pytest.mark.parametrize("shape", [(1, 7, 7, 48), (2, 5, 3, 20), (1, 1, 1, 16), (4, 9, 9, 24), (6, 5, 5, 32)])
def test_the_team_kernel_at_each_team_size(threads: int, shape: tuple[int, ...]) -> None:
    from kubetrt.runtime.kernels.squeeze_excite import _run

    c = shape[-1]
    w1, b1, w2, b2 = f32(4, c) * 0.3, f32(4), f32(c, 4) * 0.5, f32(c)
    se = SqueezeExcite(w1, b1, ("Silu", {}), w2, b2, ("Sigmoid", {}), "se")
    assert se.team_consts is not None
    x = f32(*shape)
    out = np.empty_like(x)
    n, h, w, _ = shape
    _run(se.team_consts, x.reshape(n, h * w, c), out.reshape(n, h * w, c), threads)
    np.testing.assert_allclose(out, numpy_reference(x, w1, b1, w2, b2), rtol=1e-5, atol=1e-6)


def test_in_place_writes_the_input_and_a_wrong_width_is_named() -> None:
    w1, b1, w2, b2 = f32(4, 16), f32(4), f32(16, 4), f32(16)
    se = SqueezeExcite(w1, b1, ("Silu", {}), w2, b2, ("Sigmoid", {}), "block3a_se")
    x = f32(1, 6, 6, 16)
    want = numpy_reference(x, w1, b1, w2, b2)
    y = se(x, overwrite=True)
    assert y is x
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"block3a_se: input has 8 channels, the gate's weights expect 16"):
        se(f32(1, 6, 6, 8))
