"""The activation table (runtime/kernels/activations.py) is the one definition every path reads:
each fused form (numba's scalar form, oneDNN's post-op, the fusion pass's choice) is checked
against the xp form here, on random data and edge values, so they cannot drift apart."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kubetrt.runtime import ops
from kubetrt.runtime.accuracy import HOST, TOLERANCES
from kubetrt.runtime.kernels import cuda, jit, onednn
from kubetrt.runtime.kernels.activations import (
    ACTIVATIONS,
    FUSABLE,
    SCALAR_CLAMP,
    SCALAR_GELU,
    SCALAR_NONE,
    UNARY_OPS,
    bind,
    cuda_expr,
    scalar_form,
)
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(7)
EDGES = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38,
                  6.0, 5.999, 6.001, -1.5, 0.5, 1.0, -1.0], np.float32)

# Parameters each activation with a numba scalar form is checked at: defaults, both bounds,
# either side open (numba takes an open side as an infinite bound).
SCALAR_CASES: dict[str, list[dict[str, Any]]] = {
    "Relu": [{}],
    "Clip": [{"min": 0.0, "max": 6.0}, {"min": -1.5, "max": None}, {"min": None, "max": 0.5}, {"min": 0.0}, {}],
    "Gelu": [{}],  # the erf form; the tanh form has none
}
# Each scalar form as a plain function of (v, a, b): what the numba kernels run per element.
SCALAR_FUNCTIONS: dict[int, Any] = {SCALAR_CLAMP: getattr(jit, "clamp", None),
                                     SCALAR_GELU: lambda v, a, b: jit.gelu_erf(v)}
# Clamps are exact; GELU's polynomial may be contracted into fused multiply-adds inside a kernel
# (one rounding fewer per step), so it matches to a few float32 ulps.
FORM_TOLERANCE: dict[int, dict[str, float]] = {SCALAR_CLAMP: {"rtol": 0.0, "atol": 0.0}, SCALAR_GELU: {"rtol": 4e-6, "atol": 1e-7}}
needs_jit = pytest.mark.skipif(not jit.AVAILABLE, reason="numba is not installed: the NumPy epilogues run instead")


def values(n: int = 500, dtype: Any = np.float32) -> np.ndarray:
    with np.errstate(over="ignore"):  # float16 takes the largest edges as infinities
        return np.concatenate([EDGES, rng.standard_normal(n).astype(np.float32) * 8]).astype(dtype)


def scalar_cases() -> list[tuple[str, dict[str, Any]]]:
    return [(op, p) for op, ps in SCALAR_CASES.items() for p in ps]


def test_every_scalar_form_is_checked() -> None:
    """A new scalar form, or a new activation given one, must join the cases below."""
    assert set(SCALAR_CASES) == {op for op, a in ACTIVATIONS.items() if a.scalar is not None}
    forms = [scalar_form((op, p)) for op, p in scalar_cases()]
    assert {f[0] for f in forms if f is not None} - {SCALAR_NONE} <= set(SCALAR_FUNCTIONS) == set(FORM_TOLERANCE)
    assert scalar_form(("Gelu", {"approximate": "tanh"})) is None


@needs_jit
@pytest.mark.parametrize("op,params", scalar_cases(), ids=[f"{op}{p}" for op, p in scalar_cases()])
def test_scalar_form_matches_the_xp_form(op: str, params: dict[str, Any]) -> None:
    form = scalar_form((op, params))
    assert form is not None and form[0] != SCALAR_NONE
    fn = SCALAR_FUNCTIONS[form[0]]
    x = values()
    a, b = np.float32(form[1]), np.float32(form[2])
    got = np.array([fn(v, a, b) for v in x], np.float32)
    np.testing.assert_array_equal(got, bind(np, op, params, may_be_half=False)(x.copy(), None))


@needs_jit
@pytest.mark.parametrize("op,params", scalar_cases(), ids=[f"{op}{p}" for op, p in scalar_cases()])
def test_numba_kernels_apply_the_scalar_form_as_the_xp_epilogue_does(op: str, params: dict[str, Any]) -> None:
    form = scalar_form((op, params))
    assert form is not None
    act = bind(np, op, params, may_be_half=False)

    y = rng.standard_normal((37, 16)).astype(np.float32) * 8
    y[0] = EDGES
    bias, residual = rng.standard_normal(16).astype(np.float32), rng.standard_normal((37, 16)).astype(np.float32)
    got = jit.epilogue_rows(y.copy(), bias, residual, *form)
    np.testing.assert_array_equal(got, act((y + residual) + bias, None))

    x = np.pad(rng.standard_normal((2, 5, 7, 6)).astype(np.float32) * 4, ((0, 0), (0, 0), (1, 1), (1, 1)))
    w, b = rng.standard_normal((5, 1, 3, 3)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    plain = jit.depthwise_conv(x, w, b, [1, 1], [1, 1], 7, 6)
    tol = FORM_TOLERANCE[form[0]]
    np.testing.assert_allclose(jit.depthwise_conv(x, w, b, [1, 1], [1, 1], 7, 6, *form), act(plain, None), **tol)

    xh = np.ascontiguousarray(x[:, :, 1:-1, 1:-1].transpose(0, 2, 3, 1))
    wh = np.ascontiguousarray(w[:, 0].transpose(1, 2, 0))
    plain = jit.depthwise_conv_nhwc(xh, wh, b, [1, 1], [1, 1], [1, 1], 7, 6)
    np.testing.assert_allclose(jit.depthwise_conv_nhwc(xh, wh, b, [1, 1], [1, 1], [1, 1], 7, 6, *form), act(plain, None), **tol)


ONEDNN_CASES: list[tuple[str, dict[str, Any], Any]] = [
    ("Relu", {}, ("eltwise_relu", 0.0, 0.0)),
    ("Clip", {"min": 0.0, "max": 6.0}, ("eltwise_clip", 0.0, 6.0)),
    ("Clip", {"min": 0.0}, ("eltwise_relu", 0.0, 0.0)),  # [0, inf) is ReLU
    ("Clip", {"max": 1.0}, False),  # an open lower bound: oneDNN's clip needs both
    ("Sigmoid", {}, False),
    ("Silu", {}, ("eltwise_swish", 1.0, 0.0)),
    ("Gelu", {}, ("eltwise_gelu_erf", 0.0, 0.0)),
    ("Gelu", {"approximate": "tanh"}, ("eltwise_gelu_tanh", 0.0, 0.0)),
]


@pytest.mark.parametrize("op,params,post", ONEDNN_CASES, ids=[f"{c[0]}{c[1]}" for c in ONEDNN_CASES])
def test_onednn_post_op_is_the_tables_mapping(op: str, params: dict[str, Any], post: Any) -> None:
    assert onednn.activation_post_op((op, params)) == post
    assert onednn.activation_post_op(None) is None


@pytest.mark.skipif(not onednn.AVAILABLE, reason="the onednn extra is not installed")
@pytest.mark.parametrize("op,params,post", [c for c in ONEDNN_CASES if c[2]], ids=[f"{c[0]}{c[1]}" for c in ONEDNN_CASES if c[2]])
def test_onednn_post_op_matches_the_xp_form(op: str, params: dict[str, Any], post: Any) -> None:
    a = rng.standard_normal((33, 24)).astype(np.float32) * 3
    w, bias = rng.standard_normal((24, 16)).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    plain = onednn.Dense(w, bias, None, residual=False)(a)
    fused = onednn.Dense(w, bias, post, residual=False)(a)
    # fp32's entry of the one table: oneDNN's erf and the xp form's are different approximations,
    # each within about 1e-6 of GELU, so on some inputs they differ by more than either's error
    np.testing.assert_allclose(fused, bind(np, op, params, may_be_half=False)(plain, None), rtol=0, atol=TOLERANCES[("fp32", HOST)])


def test_every_fusable_activation_has_a_gpu_form() -> None:
    assert cuda_expr(None) == "v"
    for op in FUSABLE:
        assert cuda_expr((op, {})) is not None, op
    assert cuda_expr(("Clip", {"max": 6.0})) == "fminf(fmaxf(v, -INFINITY), 6.0f)"
    assert cuda_expr(("LeakyRelu", {})) == "v >= 0.f ? v : 0.01f * v"
    with pytest.raises(ValueError, match="fused activation 'Exp'"):
        cuda_expr(("Exp", {}))


FUSION_ATTRS: dict[str, dict[str, Any]] = {"LeakyRelu": {"alpha": 0.2}, "HardSigmoid": {"alpha": 0.3, "beta": 0.4}, "Elu": {"alpha": 0.7}}
ORT_HAS = set(UNARY_OPS) - {"Gelu", "Erfc", "Silu"}  # not ONNX ops at the test opset (17)


@pytest.mark.parametrize("op", [op for op in UNARY_OPS if op in ORT_HAS and op != "Not"])
@pytest.mark.parametrize("backend", ["onednn", "numpy"])
def test_fusion_takes_exactly_the_fusable_activations(op: str, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kubetrt.runtime.onnx_import import from_proto
    from kubetrt.runtime.program import compile_graph

    if backend == "numpy":
        monkeypatch.setattr(onednn, "AVAILABLE", False)
    nodes = [node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), node(op, ["c"], ["y"], **FUSION_ATTRS.get(op, {}))]
    feeds = {"x": rng.standard_normal((2, 3, 6, 6)).astype(np.float32)}
    consts = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    if op in ("Log", "Sqrt", "Reciprocal"):  # keep the domain (and away from 1/x's pole): a bias far above the convolution's range
        consts["b"] = np.full(4, 100.0, np.float32)
    model = make_model(nodes, feeds, ["y"], consts)
    kernels = [k.op for k in compile_graph(from_proto(model)).kernels]
    assert kernels == (["FusedConv"] if op in FUSABLE else ["FusedConv", op])
    np.testing.assert_allclose(run_kubetrt(model, feeds)[0], run_ort(model, feeds)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sigmoid_first", [True, False])
@pytest.mark.parametrize("backend", ["onednn", "numpy"])
def test_sigmoid_times_input_fuses_as_silu(sigmoid_first: bool, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SiLU/Swish as converters write it, Mul(x, Sigmoid(x)), becomes one fused activation."""
    from kubetrt.runtime.onnx_import import from_proto
    from kubetrt.runtime.program import compile_graph

    if backend == "numpy":
        monkeypatch.setattr(onednn, "AVAILABLE", False)
    mul = ["s", "c"] if sigmoid_first else ["c", "s"]
    nodes = [node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), node("Sigmoid", ["c"], ["s"]), node("Mul", mul, ["y"])]
    feeds = {"x": (rng.standard_normal((2, 3, 6, 6)) * 3).astype(np.float32)}
    consts = {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
    model = make_model(nodes, feeds, ["y"], consts)
    prog = compile_graph(from_proto(model))
    assert [k.op for k in prog.kernels] == ["FusedConv"]
    np.testing.assert_allclose(run_kubetrt(model, feeds)[0], run_ort(model, feeds)[0], rtol=1e-4, atol=1e-5)


def test_sigmoid_read_elsewhere_is_not_fused() -> None:
    """A Sigmoid whose result someone else reads too stays: fusing would drop that reader's value."""
    from kubetrt.runtime.onnx_import import from_proto
    from kubetrt.runtime.program import compile_graph

    nodes = [node("Conv", ["x", "w"], ["c"]), node("Sigmoid", ["c"], ["s"]), node("Mul", ["c", "s"], ["y"]),
             node("Add", ["s", "y"], ["z"])]
    feeds = {"x": rng.standard_normal((1, 3, 4, 4)).astype(np.float32)}
    model = make_model(nodes, feeds, ["z"], {"w": rng.standard_normal((2, 3, 1, 1)).astype(np.float32)})
    assert "Silu" not in [k.op for k in compile_graph(from_proto(model)).kernels]
    np.testing.assert_allclose(run_kubetrt(model, feeds)[0], run_ort(model, feeds)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", UNARY_OPS)
def test_host_and_cuda_kernels_share_each_definition(op: str) -> None:
    """The cuda kernel (NumPy standing in for CuPy) and the host kernel compute the same values."""
    attrs = FUSION_ATTRS.get(op, {})
    for dtype in (np.float32, np.float16):
        x = values(dtype=dtype) if op != "Not" else values() > 0
        ctx = cuda.DeviceContext(xp=np, compute_dtype=np.dtype(dtype))
        with np.errstate(all="ignore"):
            host = ops.call(op, x, **attrs)
            device = ops.call(op, x, device="cuda", ctx=ctx, **attrs)
        assert host.dtype == device.dtype == x.dtype
        np.testing.assert_array_equal(device, host)


@pytest.mark.parametrize("op", sorted(op for op, a in ACTIVATIONS.items() if a.wide))
def test_wide_activations_compute_half_operands_in_float32(op: str) -> None:
    x = values(dtype=np.float16)
    if op in ("Log", "Sqrt"):
        x = np.abs(x) + np.float16(0.1)
    with np.errstate(all="ignore"):
        want = bind(np, op, {}, may_be_half=False)(x.astype(np.float32), None).astype(np.float16)
        fresh = bind(np, op, {}, may_be_half=True)(x, None)
        out = x.copy()
        in_place = bind(np, op, {}, may_be_half=True)(out, out)
    assert fresh.dtype == np.float16 and in_place is out
    np.testing.assert_array_equal(fresh, want)
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("op", ["Relu", "Tanh"])
def test_activation_behind_a_dense_layers_reshape_is_fused(op: str) -> None:
    """Keras Tensordot: Reshape -> MatMul -> Reshape -> activation; the activation moves above the
    Reshape into the product's epilogue, unless someone else reads the reshaped value."""
    from kubetrt.runtime.onnx_import import from_proto
    from kubetrt.runtime.program import compile_graph

    consts = {"w": rng.standard_normal((8, 16)).astype(np.float32), "shape": np.array([2, 3, 16], np.int64)}
    feeds = {"x": rng.standard_normal((6, 8)).astype(np.float32)}
    nodes = [node("MatMul", ["x", "w"], ["m"]), node("Reshape", ["m", "shape"], ["r"]), node(op, ["r"], ["y"])]
    model = make_model(nodes, feeds, ["y"], consts)
    assert [k.op for k in compile_graph(from_proto(model)).kernels] == ["FusedMatMul", "Reshape"]
    np.testing.assert_allclose(run_kubetrt(model, feeds)[0], run_ort(model, feeds)[0], rtol=1e-5, atol=1e-6)

    read_twice = make_model(nodes + [node("Neg", ["r"], ["z"])], feeds, ["y", "z"], consts)
    assert [k.op for k in compile_graph(from_proto(read_twice)).kernels] == ["FusedMatMul", "Reshape", op, "Neg"]
    for got, want in zip(run_kubetrt(read_twice, feeds), run_ort(read_twice, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_follows_its_approximate_attribute(approximate: str) -> None:
    """ONNX Gelu's two forms, against float64 references of each formula."""
    import math

    x = np.linspace(-6, 6, 1201).astype(np.float32)
    x64 = x.astype(np.float64)
    if approximate == "tanh":
        want = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    else:
        want = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    got = bind(np, "Gelu", {"approximate": approximate}, may_be_half=False)(x, None)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    assert np.abs(got - want).max() < 1e-5
