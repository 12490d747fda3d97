"""Dense chains: the pass that joins dense layers feeding only each other into one DenseChain
node (runtime/passes/chains.py) and the kernel that runs it in one team call at few rows
(sgemm.PackedChain), as one primitive chain of its layers' oneDNN calls beyond. Against float64
NumPy and, in plans, onnxruntime; fp32 tolerance from the one table (runtime/accuracy.py)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.kernels import onednn, primitive_chain, sgemm
from kubetrt.runtime.kernels.activations import scalar_form
from kubetrt.runtime.kernels.omp import TeamChoice
from onnx_cases import make_model, node, run_ort, run_plan
from threads import on_threads

pytestmark = pytest.mark.skipif(not sgemm.AVAILABLE, reason="numba or libgomp is missing: dense layers run one by one")
TOL = tolerance_for("fp32", "host")
rng = np.random.default_rng(29)
RELU, CLIP, GELU = ("Relu", {}), ("Clip", {"min": -0.5, "max": 0.75}), ("Gelu", {})


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=TOL.rtol, atol=TOL.atol)


@pytest.fixture
def chain_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Records the input shape of every call the chained kernel runs."""
    calls: list[tuple[int, ...]] = []
    real = sgemm.PackedChain.__call__

    def spy(self: sgemm.PackedChain, a: np.ndarray) -> np.ndarray:
        calls.append(a.shape)
        return real(self, a)
    monkeypatch.setattr(sgemm.PackedChain, "__call__", spy)
    return calls


def layers(widths: list[int], acts: list[Any], bias: bool = True) -> list[sgemm.PackedDense]:
    return [sgemm.PackedDense(f32(k, n) * 0.3, f32(n) if bias else None, scalar_form(act), residual=False, name=f"fc{i}")
            for i, (k, n, act) in enumerate(zip(widths, widths[1:], acts))]


@pytest.mark.parametrize("m", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_a_chain_gives_the_bits_of_its_layers_one_by_one(m: int, bias: bool) -> None:
    # widths around the panel (16) and the tile edges; each tile is summed in the same order either way
    dense = layers([33, 40, 17, 9], [RELU, GELU, CLIP], bias)
    a = f32(m, 33)
    want = a
    for layer in dense:
        want = layer(want)
    got = sgemm.PackedChain(dense)(a)
    assert got.shape == (m, 9) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    ref = a.astype(np.float64)
    for layer, act in zip(dense, [RELU, GELU, CLIP]):
        ref = ref @ layer._w.astype(np.float64) + (0 if layer._bias is None else layer._bias)
        form = scalar_form(act)
        assert form is not None
        ref = 0.5 * ref * (1 + np.vectorize(math.erf)(ref / math.sqrt(2))) if act is GELU else np.clip(ref, form[1], form[2])
    close(got, ref)


def test_a_team_of_one_gives_the_same_bits_as_the_team(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, a = layers([64, 80, 48, 10], [RELU, RELU, None]), f32(7, 64)
    results = []
    for serial in (False, True):
        monkeypatch.setattr(TeamChoice, "pick", lambda self, s=serial: s)
        results.append(sgemm.PackedChain(dense)(a))
    np.testing.assert_array_equal(results[0], results[1])


def test_rows_of_any_rank_and_none_at_all() -> None:
    dense = layers([12, 20, 5], [RELU, None])
    chain = sgemm.PackedChain(dense)
    a = f32(2, 3, 12)
    np.testing.assert_array_equal(chain(a), dense[1](dense[0](a)))
    assert chain(f32(0, 12)).shape == (0, 5)
    assert chain(a[:, ::2]).shape == (2, 2, 5), "a strided view is read as rows"


def test_threads_sharing_one_chain_get_their_own_results() -> None:
    dense = layers([48, 40, 24], [RELU, None])
    chain = sgemm.PackedChain(dense)

    def work(a: np.ndarray) -> None:
        want = dense[1](dense[0](a))
        for _ in range(50):
            np.testing.assert_array_equal(chain(a), want)
    on_threads(work, [f32(m, 48) for m in (1, 4, 9, 16)])


def test_bad_input_and_bad_chains_are_named() -> None:
    chain = sgemm.PackedChain(layers([6, 4, 3], [None, None]), name="head")
    with pytest.raises(ValueError, match=r"MatMul head: expected a float32 input of shape \[\.\.\., 6\], got float32 of shape \(2, 5\)"):
        chain(f32(2, 5))
    with pytest.raises(ValueError, match=r"MatMul head: expected a float32 input .* got float64"):
        chain(np.zeros((2, 6)))
    a, b = layers([6, 4], [None])[0], layers([5, 3], [None])[0]
    with pytest.raises(ValueError, match="dense chain mlp: layer fc0 takes 5 features, fc0 gives 4"):
        sgemm.PackedChain([a, b], name="mlp")
    with pytest.raises(ValueError, match="no residual sums"):
        sgemm.PackedChain([sgemm.PackedDense(f32(4, 4), None, scalar_form(None), residual=True)])


def mlp(activations: list[str | None], widths: list[int], tail: str = "Softmax", **tail_attrs: Any) -> tuple[list[Any], dict[str, np.ndarray]]:
    """MatMul + Add [+ activation] per layer, as an exporter writes a Keras MLP; then `tail`."""
    nodes, init, x = [], {}, "x"
    for i, (k, n, act) in enumerate(zip(widths, widths[1:], activations)):
        init[f"w{i}"], init[f"b{i}"] = f32(k, n) * 0.2, f32(n)
        nodes += [node("MatMul", [x, f"w{i}"], [f"m{i}"]), node("Add", [f"m{i}", f"b{i}"], [f"a{i}"])]
        x = f"a{i}"
        if act is not None:
            nodes.append(node(act, [x], [f"h{i}"]))
            x = f"h{i}"
    nodes.append(node(tail, [x], ["y"], **({"axis": -1} | tail_attrs)))
    return nodes, init


@pytest.mark.parametrize("batch", [1, 16, 32])
@pytest.mark.parametrize("tail", ["Softmax", "LogSoftmax"])
def test_an_mlp_and_its_softmax_become_one_chain_that_matches_onnxruntime(batch: int, tail: str, chain_calls: list[tuple[int, ...]]) -> None:
    nodes, init = mlp(["Relu", "Relu", None], [64, 96, 96, 10], tail)
    feeds = {"x": f32(batch, 64)}
    model = make_model(nodes, feeds, ["y"], init)
    (got,), ops = run_plan(model, feeds)
    close(got, run_ort(model, feeds)[0])
    assert ops == ["DenseChain"], ops
    chained = batch <= sgemm.MAX_ROWS or not onednn.AVAILABLE
    assert chain_calls == ([(batch, 64)] if chained else []), chain_calls


@pytest.fixture
def primitive_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the primitive chains' calls and the oneDNN calls made one by one from Python."""
    calls = {"chain": 0, "site": 0}
    chain, site = primitive_chain.PrimitiveChain.__call__, onednn.Site.__call__

    def chain_spy(self: primitive_chain.PrimitiveChain, *xs: np.ndarray) -> tuple[np.ndarray, ...]:
        calls["chain"] += 1
        return chain(self, *xs)

    def site_spy(self: onednn.Site, *args: Any, **kwargs: Any) -> np.ndarray:
        calls["site"] += 1
        return site(self, *args, **kwargs)
    monkeypatch.setattr(primitive_chain.PrimitiveChain, "__call__", chain_spy)
    monkeypatch.setattr(onednn.Site, "__call__", site_spy)
    return calls


@pytest.mark.skipif(not primitive_chain.AVAILABLE, reason="oneDNN is missing: many rows run layer by layer on NumPy")
@pytest.mark.parametrize("shape", [(32, 64), (3, 20, 64)], ids=["rows", "sequences"])
@pytest.mark.parametrize("tail", ["Softmax", "LogSoftmax", None])
def test_at_many_rows_the_layers_primitives_run_as_one_chain(shape: tuple[int, ...], tail: str | None,
                                                            primitive_calls: dict[str, int]) -> None:
    nodes, init = mlp(["Relu", "Relu", None], [64, 96, 80, 10], tail or "Softmax")
    if tail is None:
        nodes.pop()
        nodes[-1].output[0] = "y"
    feeds = {"x": f32(*shape)}
    model = make_model(nodes, feeds, ["y"], init)
    want = run_ort(model, feeds)[0]
    for call in range(3):
        (got,), ops = run_plan(model, feeds)
        assert ops == ["DenseChain"], ops
        assert got.shape == shape[:-1] + (10,)
        close(got, want)
    assert primitive_calls == {"chain": 3, "site": 0}, primitive_calls


@pytest.mark.skipif(not primitive_chain.AVAILABLE, reason="oneDNN is missing: many rows run layer by layer on NumPy")
@pytest.mark.parametrize("softmax", [(False, 1.0), (True, 1.0), (False, 0.125)], ids=["softmax", "log-softmax", "scaled"])
def test_a_primitive_chain_s_softmax_gives_the_softmax_kernel_s_bits(softmax: tuple[bool, float]) -> None:
    from kubetrt.runtime.kernels import jit
    from kubetrt.runtime.kernels.reduce import softmax_call

    log, scale = softmax
    dense = onednn.Dense(f32(40, 12), f32(12), None, residual=False, name="head")
    a = f32(33, 40) * 4
    line = primitive_chain.in_line([dense.site(33), softmax_call((33, 12), log, scale)], a.shape, (33, 12), lambda x: (x,), "head")
    (got,) = line(a)
    np.testing.assert_array_equal(got, jit.softmax_rows(dense(a), log, scale))
    z = scale * (a.astype(np.float64) @ dense.w + dense.bias)
    z -= z.max(axis=-1, keepdims=True)
    close(got, z - np.log(np.exp(z).sum(axis=-1, keepdims=True)) if log else np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True))


@pytest.mark.skipif(not primitive_chain.AVAILABLE, reason="oneDNN is missing: many rows run layer by layer on NumPy")
def test_at_many_rows_new_shapes_stop_being_kept_and_a_wrong_input_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubetrt.runtime.devices.host import RUNTIME
    from kubetrt.runtime.kernels import nn
    from kubetrt.runtime.onnx_import import from_proto

    made: list[tuple[int, ...]] = []
    real = primitive_chain.in_line

    def spy(steps: Any, shape: tuple[int, ...], *rest: Any) -> Any:
        made.append(shape)
        return real(steps, shape, *rest)
    monkeypatch.setattr(primitive_chain, "in_line", spy)
    monkeypatch.setattr(nn, "MAX_IN_LINE", 3)
    nodes, init = mlp(["Relu", None], [64, 48, 10])
    model = make_model(nodes, {"x": f32(32, 64)}, ["y"], init, dynamic_batch=True)
    plan = RUNTIME.prepare(from_proto(model), {})
    ((step, ins, *_),) = plan.steps
    consts = [plan.prog.values[v].const if v >= 0 else None for v in ins[1:]]
    with pytest.raises(ValueError, match=r"MatMul .*: expected a float32 input of shape \[\.\.\., 64\], got float32 of shape \(32, 63\)"):
        step(f32(32, 63), *consts)
    assert step(f32(0, 64), *consts)[0].shape == (0, 10)
    for rows in range(17, 23):
        x = f32(rows, 64)
        close(step(x, *consts)[0], run_ort(model, {"x": x})[0])
    assert made == [(17, 64), (18, 64)], "a primitive chain for each of the first shapes only (the bad one counts)"


def test_a_classifier_head_of_one_layer_takes_its_softmax_in() -> None:
    nodes, init = mlp([None], [48, 10])
    feeds = {"x": f32(1, 48)}
    model = make_model(nodes, feeds, ["y"], init)
    (got,), ops = run_plan(model, feeds)
    close(got, run_ort(model, feeds)[0])
    assert ops == ["DenseChain"], ops


@pytest.mark.parametrize("softmax", [(False, 1.0), (True, 1.0), (False, 0.125)], ids=["softmax", "log-softmax", "scaled"])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_the_chain_s_softmax_gives_the_softmax_kernel_s_bits(softmax: tuple[bool, float], m: int) -> None:
    from kubetrt.runtime.kernels import jit

    dense = layers([20, 24, 12], [RELU, None])
    a = f32(m, 20) * 4
    got = sgemm.PackedChain(dense, softmax=softmax)(a)
    log, scale = softmax
    np.testing.assert_array_equal(got, jit.softmax_rows(dense[1](dense[0](a)), log, scale))
    z = scale * (np.maximum(a.astype(np.float64) @ dense[0]._w + dense[0]._bias, 0) @ dense[1]._w + dense[1]._bias)
    z -= z.max(axis=-1, keepdims=True)
    want = z - np.log(np.exp(z).sum(axis=-1, keepdims=True)) if log else np.exp(z) / np.exp(z).sum(axis=-1, keepdims=True)
    close(got, want)


def test_a_softmax_that_is_not_the_chain_s_alone_stays_a_node() -> None:
    # over the first axis, and over a value someone else reads too: neither joins the chain
    nodes, init = mlp(["Relu", None], [16, 12, 6], axis=0)
    feeds = {"x": f32(3, 16)}
    model = make_model(nodes, feeds, ["y"], init)
    (got,), ops = run_plan(model, feeds)
    close(got, run_ort(model, feeds)[0])
    assert ops == ["DenseChain", "Softmax"], ops
    nodes, init = mlp(["Relu", None], [16, 12, 6])
    model = make_model(nodes, feeds, ["y", "a1"], init)
    got, ops = run_plan(model, feeds)
    for g, w in zip(got, run_ort(model, feeds)):
        close(g, w)
    assert ops == ["DenseChain", "Softmax"], ops


def test_what_a_chain_stops_at(chain_calls: list[tuple[int, ...]]) -> None:
    # a Sigmoid (no scalar form in the packed kernel) ends one chain; a value read twice ends the next
    nodes, init = mlp(["Relu", "Sigmoid", "Relu", "Relu", None], [32, 24, 24, 16, 16, 8])
    nodes.append(node("Relu", ["h2"], ["z"]))  # h2, layer 2's output, is read by layer 3 and by this Relu
    feeds = {"x": f32(1, 32)}
    model = make_model(nodes, feeds, ["y", "z"], init)
    got, ops = run_plan(model, feeds)
    for g, w in zip(got, run_ort(model, feeds)):
        close(g, w)
    assert ops.count("DenseChain") == 1 and ops.count("FusedMatMul") == 3, ops
    assert chain_calls == [(1, 16)], "the chain is layers 3 and 4, after the value read twice"


def test_a_residual_layer_is_not_chained() -> None:
    nodes = [node("MatMul", ["x", "w0"], ["h"]), node("Relu", ["h"], ["r"]), node("MatMul", ["r", "w1"], ["m"]),
             node("Add", ["m", "r"], ["y"])]
    feeds = {"x": f32(2, 24)}
    model = make_model(nodes, feeds, ["y"], {"w0": f32(24, 24), "w1": f32(24, 24)})
    (got,), ops = run_plan(model, feeds)
    close(got, run_ort(model, feeds)[0])
    assert ops == ["FusedMatMul", "FusedMatMul"], ops
