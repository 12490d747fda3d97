"""GELU and layer normalization written out op by op (as tf2onnx writes Keras' layers) become one
Gelu / LayerNormalization kernel, with onnxruntime's numbers; a pattern whose intermediate is
read elsewhere stays as it is."""
from __future__ import annotations

import numpy as np
import pytest

from kubetrt.runtime.devices.host import RUNTIME
from kubetrt.runtime.onnx_import import from_proto
from onnx_cases import make_model, node, run_ort

rng = np.random.default_rng(11)


def scalar(v: float) -> np.ndarray:
    return np.array(v, np.float32)


def kernels(model) -> list[str]:  # type: ignore[no-untyped-def]
    return [k.op for k in RUNTIME.prepare(from_proto(model), {}).prog.kernels]


def check(model, feeds) -> list[str]:  # type: ignore[no-untyped-def]
    from onnx_cases import run_kubetrt

    for got, ref in zip(run_kubetrt(model, feeds), run_ort(model, feeds)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    return kernels(model)


GELU_FORMS = {
    # Keras/TF: 0.5 * x * erfc(-x / sqrt 2), erfc written as 1 - erf
    "erfc": [node("Mul", ["half", "x"], ["a"]), node("Neg", ["x"], ["n"]), node("Mul", ["n", "rsqrt2"], ["z"]),
             node("Erf", ["z"], ["e"]), node("Sub", ["one", "e"], ["s"]), node("Mul", ["a", "s"], ["y"])],
    # the textbook form: x * 0.5 * (1 + erf(x / sqrt 2))
    "erf": [node("Div", ["x", "sqrt2"], ["z"]), node("Erf", ["z"], ["e"]), node("Add", ["e", "one"], ["s"]),
            node("Mul", ["x", "half"], ["a"]), node("Mul", ["s", "a"], ["y"])],
}
GELU_CONSTS = {"half": scalar(0.5), "one": scalar(1.0), "rsqrt2": scalar(0.70710677), "sqrt2": scalar(1.4142135)}


@pytest.mark.parametrize("form", sorted(GELU_FORMS))
def test_gelu_forms_become_one_kernel(form: str) -> None:
    feeds = {"x": (rng.standard_normal((2, 7, 33)) * 3).astype(np.float32)}
    ops = check(make_model(GELU_FORMS[form], feeds, ["y"], GELU_CONSTS), feeds)
    assert ops == ["Gelu"], ops


def test_gelu_whose_intermediate_is_read_elsewhere_stays_apart() -> None:
    nodes = GELU_FORMS["erf"] + [node("Add", ["y", "e"], ["out"])]  # erf(x / sqrt 2) has a second reader
    feeds = {"x": rng.standard_normal((4, 9)).astype(np.float32)}
    ops = check(make_model(nodes, feeds, ["out"], GELU_CONSTS), feeds)
    assert "Gelu" not in ops and "Erf" in ops


def layer_norm_nodes(reduce: str) -> list:  # type: ignore[type-arg]
    # tf2onnx's Keras LayerNormalization: moments, rsqrt(var + eps) * gamma, x * g + (beta - mean * g)
    def mean(src: str, dst: str):  # type: ignore[no-untyped-def]
        if reduce == "GlobalAveragePool":
            return node("GlobalAveragePool", [src], [dst])
        return node("ReduceMean", [src], [dst], axes=[-1], keepdims=1)  # opset 13: axes an attribute

    return [mean("x", "mean"), node("Neg", ["mean"], ["nm"]), node("Sub", ["x", "mean"], ["d"]),
            node("Mul", ["d", "d"], ["sq"]), mean("sq", "var"), node("Add", ["var", "eps"], ["ve"]),
            node("Sqrt", ["ve"], ["sd"]), node("Reciprocal", ["sd"], ["rstd"]), node("Mul", ["rstd", "gamma"], ["g"]),
            node("Mul", ["x", "g"], ["xg"]), node("Mul", ["nm", "g"], ["nmg"]), node("Add", ["nmg", "beta"], ["shift"]),
            node("Add", ["xg", "shift"], ["y"])]


@pytest.mark.parametrize("reduce", ["GlobalAveragePool", "ReduceMean"])
def test_layer_norm_written_out_becomes_one_kernel(reduce: str) -> None:
    c = 48
    consts = {"eps": scalar(1e-3), "gamma": rng.standard_normal((1, 1, c)).astype(np.float32),
              "beta": rng.standard_normal(c).astype(np.float32)}
    feeds = {"x": (rng.standard_normal((3, 5, c)) * 4 + 2).astype(np.float32)}
    model = make_model(layer_norm_nodes(reduce), feeds, ["y"], consts)
    ops = check(model, feeds)
    assert ops == ["LayerNormalization"], ops


def test_global_average_pool_of_an_image_is_not_a_layer_norm() -> None:
    # over (N, C, H, W) GlobalAveragePool averages H and W, not the last axis: no rewrite
    consts = {"eps": scalar(1e-3), "gamma": rng.standard_normal(6).astype(np.float32),
              "beta": rng.standard_normal(6).astype(np.float32)}
    feeds = {"x": rng.standard_normal((2, 3, 4, 6)).astype(np.float32)}
    ops = check(make_model(layer_norm_nodes("GlobalAveragePool"), feeds, ["y"], consts), feeds)
    assert "LayerNormalization" not in ops


@pytest.mark.parametrize("elements", [64, 1 << 16])  # the one-pass and the SIMD-exp paths
def test_gelu_in_place_on_its_input_keeps_the_input_until_done(elements: int) -> None:
    from kubetrt.runtime.kernels import activations, jit

    if not jit.AVAILABLE:
        pytest.skip("numba is not installed: the NumPy form runs")
    x = (rng.standard_normal(elements) * 2).astype(np.float32)
    expected = activations.bind(np, "Gelu", {}, may_be_half=False)(x.astype(np.float64), None)
    got = jit.gelu(x, x)  # the executor hands a dying input as `out`
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
