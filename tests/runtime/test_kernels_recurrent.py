"""LSTM, GRU and RNN against onnxruntime: every direction and layout, ragged sequence_lens,
initial states, peepholes, clip, GRU's linear_before_reset, non-default activations, both
recurrence paths (numba and the NumPy fallback), dynamic batch and both executors.

onnxruntime refuses layout=1, so batch-first cases are checked against its layout=0 result on
the transposed input, with the outputs transposed back.
"""
from __future__ import annotations

import re
import zlib
from typing import Any

import numpy as np
import onnx
import pytest

from kubetrt.runtime import UnsupportedOpError
from kubetrt.runtime.errors import KernelError
from kubetrt.runtime.kernels import jit, recurrent
from kubetrt.runtime.kernels.registry import KernelSpec, lookup
from onnx_cases import make_model, node, run_kubetrt, run_ort

rng: np.random.Generator  # drawn per test, by _data_seeded_by_test
TOL = dict(rtol=1e-4, atol=1e-5)
T, B, I, H = 6, 3, 5, 4
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
OUTPUTS = {"LSTM": ["y", "yh", "yc"], "GRU": ["y", "yh"], "RNN": ["y", "yh"]}
RAGGED = np.array([6, 2, 0], np.int32)  # a full, a short and an empty sequence
RAGGED_RNN = np.array([6, 2, 4], np.int32)  # onnxruntime's RNN reads Y[-1] for a zero length


@pytest.fixture(autouse=True)
def _data_seeded_by_test(request: pytest.FixtureRequest) -> None:
    """Each case draws the same data whichever tests ran before it on its worker: for about one
    draw in 300, an RNN state growing through Softplus passes 88 and onnxruntime's reference
    Softplus overflows to inf where the runtime's stable form stays finite."""
    global rng
    rng = np.random.default_rng(zlib.crc32(request.node.name.encode()))


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


Case = tuple[onnx.NodeProto, dict[str, np.ndarray], dict[str, np.ndarray]]


def case(op: str, direction: str = "forward", *, lens: np.ndarray | None = None, initial: bool = False,
         peepholes: bool = False, steps: int = T, batch: int = B, **attrs: Any) -> Case:
    """(node, runtime inputs, constant weights) in layout 0; sequence_lens and states are runtime inputs."""
    d, g = (2 if direction == "bidirectional" else 1), GATES[op]
    consts = {"w": f32(d, g * H, I, scale=0.6), "r": f32(d, g * H, H, scale=0.6), "b": f32(d, 2 * g * H, scale=0.3)}
    feeds = {"x": f32(steps, batch, I)}
    inputs = ["x", "w", "r", "b", "", ""]
    if lens is not None:
        feeds["sl"], inputs[4] = lens, "sl"
    if initial:
        feeds["h0"], inputs[5] = f32(d, batch, H), "h0"
        if op == "LSTM":
            feeds["c0"] = f32(d, batch, H)
            inputs.append("c0")
    if peepholes:
        inputs += [""] * (7 - len(inputs)) + ["p"]
        consts["p"] = f32(d, 3 * H, scale=0.5)
    while inputs[-1] == "":
        inputs.pop()
    n = node(op, inputs, OUTPUTS[op], hidden_size=H, direction=direction, **attrs)
    return n, feeds, consts


def batch_first(n: onnx.NodeProto, feeds: dict[str, np.ndarray]) -> tuple[onnx.NodeProto, dict[str, np.ndarray]]:
    """The same node and inputs with layout=1."""
    bf = onnx.NodeProto()
    bf.CopyFrom(n)
    bf.attribute.append(onnx.helper.make_attribute("layout", 1))
    moved = {k: (v.transpose(1, 0, 2) if k in ("x", "h0", "c0") else v) for k, v in feeds.items()}
    return bf, moved


def to_batch_first(outs: list[np.ndarray]) -> list[np.ndarray]:
    return [outs[0].transpose(2, 0, 1, 3)] + [o.transpose(1, 0, 2) for o in outs[1:]]


def check(op: str, n: onnx.NodeProto, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray], layout: int = 0,
          executor: str = "sequential") -> None:
    ref = run_ort(make_model([n], feeds, OUTPUTS[op], consts), feeds)
    if layout:
        n, feeds = batch_first(n, feeds)
        ref = to_batch_first(ref)
    got = run_kubetrt(make_model([n], feeds, OUTPUTS[op], consts), feeds, executor)
    assert len(got) == len(ref)
    for name, g, r in zip(OUTPUTS[op], got, ref):
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, r.shape, g.dtype)
        np.testing.assert_allclose(g, r, **TOL, err_msg=name)


DIRECTIONS = ["forward", "reverse", "bidirectional"]


@pytest.mark.parametrize("clip", [None, 0.7])
@pytest.mark.parametrize("initial", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "ragged"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_lstm(direction: str, layout: int, ragged: bool, initial: bool, clip: float | None) -> None:
    attrs = {} if clip is None else {"clip": clip}
    n, feeds, consts = case("LSTM", direction, lens=RAGGED if ragged else None, initial=initial, peepholes=initial, **attrs)
    check("LSTM", n, feeds, consts, layout)


@pytest.mark.parametrize("clip", [None, 0.7])
@pytest.mark.parametrize("lbr", [0, 1], ids=["lbr0", "lbr1"])
@pytest.mark.parametrize("initial", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "ragged"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gru(direction: str, layout: int, ragged: bool, initial: bool, lbr: int, clip: float | None) -> None:
    attrs: dict[str, Any] = {"linear_before_reset": lbr}
    if clip is not None:
        attrs["clip"] = clip
    n, feeds, consts = case("GRU", direction, lens=RAGGED if ragged else None, initial=initial, **attrs)
    check("GRU", n, feeds, consts, layout)


@pytest.mark.parametrize("clip", [None, 0.7])
@pytest.mark.parametrize("initial", [False, True], ids=["zero_state", "initial_state"])
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "ragged"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_rnn(direction: str, layout: int, ragged: bool, initial: bool, clip: float | None) -> None:
    attrs = {} if clip is None else {"clip": clip}
    n, feeds, consts = case("RNN", direction, lens=RAGGED_RNN if ragged else None, initial=initial, **attrs)
    check("RNN", n, feeds, consts, layout)


ACTIVATION_CASES = [
    ("LSTM", "forward", {"activations": ["HardSigmoid", "Tanh", "Relu"], "activation_alpha": [0.3],
                         "activation_beta": [0.45]}),
    ("LSTM", "bidirectional", {"activations": ["Sigmoid", "Relu", "Tanh", "HardSigmoid", "Tanh", "Softsign"]}),
    ("LSTM", "reverse", {"input_forget": 1}),
    ("LSTM", "forward", {"input_forget": 1, "activations": ["HardSigmoid", "Tanh", "Tanh"]}),
    ("GRU", "forward", {"activations": ["HardSigmoid", "Relu"], "linear_before_reset": 1}),
    ("GRU", "bidirectional", {"activations": ["Sigmoid", "Tanh", "HardSigmoid", "LeakyRelu"], "activation_alpha": [0.25, 0.1],
                              "activation_beta": [0.5]}),
    ("GRU", "reverse", {"activations": ["Sigmoid", "Elu"], "activation_alpha": [0.8]}),
    ("RNN", "forward", {"activations": ["Relu"]}),
    ("RNN", "bidirectional", {"activations": ["Sigmoid", "Softplus"]}),
    ("RNN", "bidirectional", {"activations": ["HardSigmoid", "LeakyRelu"], "activation_alpha": [0.3, 0.2],
                              "activation_beta": [0.4, 0.0]}),
    ("RNN", "reverse", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.1]}),
]


@pytest.mark.parametrize("backend", ["numba", "numpy"])
@pytest.mark.parametrize("spec", ACTIVATION_CASES, ids=lambda s: f"{s[0]}-{s[1]}-{'-'.join(s[2].get('activations', ['input_forget']))}")
def test_activations(spec: tuple[str, str, dict[str, Any]], backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every activation in a gate, alpha/beta consumed in order by the activations that take them."""
    if backend == "numpy":
        monkeypatch.setattr(jit, "AVAILABLE", False)
    op, direction, attrs = spec
    n, feeds, consts = case(op, direction, lens=RAGGED_RNN, initial=True, peepholes=op == "LSTM", **attrs)
    check(op, n, feeds, consts)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("layout", [0, 1])
def test_numpy_fallback(op: str, layout: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NumPy recurrence (no numba, KUBETRT_DISABLE_JIT) computes what the numba kernels do."""
    monkeypatch.setattr(jit, "AVAILABLE", False)
    lens = RAGGED_RNN if op == "RNN" else RAGGED
    attrs = {"linear_before_reset": 1} if op == "GRU" else {}
    n, feeds, consts = case(op, "bidirectional", lens=lens, initial=True, peepholes=op == "LSTM", clip=0.9, **attrs)
    check(op, n, feeds, consts, layout)
    n, feeds, consts = case(op, "reverse", lens=lens)
    check(op, n, feeds, consts, layout)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_dataflow_executor_threads_and_batch_blocks(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batch 9: two blocks of four rows and a single row, split across three threads; the other executor."""
    monkeypatch.setattr(jit, "THREADS", 3)
    monkeypatch.setattr(jit, "MIN_WORK_PER_THREAD", 1)
    lens = np.array([6, 1, 3, 6, 5, 2, 6, 4, 3], np.int32)
    n, feeds, consts = case(op, "bidirectional", lens=lens, initial=True, batch=9)
    check(op, n, feeds, consts, executor="dataflow")


def dynamic_batch_model(op: str, n: onnx.NodeProto, feeds: dict[str, np.ndarray], consts: dict[str, np.ndarray],
                        layout: int) -> onnx.ModelProto:
    """The batch dimension of X and the initial states symbolic (dim 1 in layout 0, dim 0 in layout 1)."""
    def vi(name: str, arr: np.ndarray) -> onnx.ValueInfoProto:
        shape: list[Any] = list(arr.shape)
        shape[0 if layout else 1] = "N"
        return onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, shape)

    graph = onnx.helper.make_graph([n], "rnn", [vi(k, v) for k, v in feeds.items()],
                                   [onnx.helper.make_empty_tensor_value_info(o) for o in OUTPUTS[op]],
                                   initializer=[onnx.numpy_helper.from_array(v, k) for k, v in consts.items()])
    m = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("layout", [0, 1])
def test_dynamic_batch(op: str, layout: int) -> None:
    """One compiled program, inputs of several batch sizes."""
    from kubetrt.runtime.devices.host import RUNTIME
    from kubetrt.runtime.onnx_import import from_proto

    n, feeds, consts = case(op, "bidirectional", initial=True)
    if layout:
        n, feeds = batch_first(n, feeds)
    graph = from_proto(dynamic_batch_model(op, n, feeds, consts, layout))
    assert graph.inputs[0].shape == ((-1, T, I) if layout else (T, -1, I))
    exe = RUNTIME.prepare(graph, {"executor": "sequential"})
    for batch in (1, 5, 2):
        n0, f0, _ = case(op, "bidirectional", initial=True, batch=batch)
        ref = run_ort(make_model([n0], f0, OUTPUTS[op], consts), f0)
        if layout:
            _, f0 = batch_first(n0, f0)
            ref = to_batch_first(ref)
        got = exe.run([f0[v.name] for v in graph.inputs])
        assert [g.shape for g in got] == [r.shape for r in ref]
        for g, r in zip(got, ref):
            np.testing.assert_allclose(g, r, **TOL)


def test_hidden_size_from_r_and_only_final_state_wanted() -> None:
    """No hidden_size attribute; Y not wanted (""); the recurrence still runs to Y_h."""
    n, feeds, consts = case("GRU", "bidirectional", lens=RAGGED)
    with_size = onnx.helper.make_node("GRU", list(n.input), ["", "yh"], name="gru_yh", direction="bidirectional", hidden_size=H)
    ref = run_ort(make_model([with_size], feeds, ["yh"], consts), feeds)  # onnxruntime requires hidden_size
    without = onnx.helper.make_node("GRU", list(n.input), ["", "yh"], name="gru_yh", direction="bidirectional")
    got = run_kubetrt(make_model([without], feeds, ["yh"], consts), feeds)
    np.testing.assert_allclose(got[0], ref[0], **TOL)


def test_long_sequence_keras_shapes() -> None:
    """Keras-like sizes (32 features, 64 units, 100 steps): rounding must not build up over the steps."""
    for op, attrs in (("LSTM", {}), ("GRU", {"linear_before_reset": 1})):
        x, g = f32(100, 2, 32), GATES[op]
        consts = {"w": f32(1, g * 64, 32, scale=0.2), "r": f32(1, g * 64, 64, scale=0.2), "b": f32(1, 2 * g * 64, scale=0.1)}
        m = make_model([node(op, ["x", "w", "r", "b"], OUTPUTS[op], hidden_size=64, **attrs)], {"x": x}, OUTPUTS[op], consts)
        for got, ref in zip(run_kubetrt(m, {"x": x}), run_ort(m, {"x": x})):
            np.testing.assert_allclose(got, ref, **TOL)


def test_float64_and_float16() -> None:
    """float64 runs the NumPy recurrence in float64; float16 computes in float32 and rounds once.
    onnxruntime has float32 kernels only: the reference is its float32 result."""
    n, feeds, consts = case("LSTM", "bidirectional", lens=RAGGED, initial=True)
    ref = run_ort(make_model([n], feeds, OUTPUTS["LSTM"], consts), feeds)
    # Half inputs and outputs carry 11-bit mantissas (relative rounding ~5e-4), hence its tolerance.
    for dtype, tol in ((np.float64, TOL), (np.float16, dict(rtol=1e-2, atol=1e-2))):
        f = {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in feeds.items()}
        c = {k: v.astype(dtype) for k, v in consts.items()}
        got = run_kubetrt(make_model([n], f, OUTPUTS["LSTM"], c), f)
        for g, r in zip(got, ref):
            assert g.dtype == dtype
            np.testing.assert_allclose(g.astype(np.float32), r, **tol)


BAD = [
    ("LSTM", {"direction": "sideways"}, "direction='sideways'"),
    ("LSTM", {"activations": ["Sigmoid", "Tanh", "Gelu"]}, "activation 'Gelu'"),
    ("GRU", {"linear_before_reset": 2}, "linear_before_reset=2"),
    ("GRU", {"layout": 2}, "layout=2"),
    ("RNN", {"activations": ["Tanh", "Tanh", "Tanh"]}, "activations=['Tanh', 'Tanh', 'Tanh'] for 1 direction(s)"),
    ("RNN", {"clip": -1.0}, "clip=-1.0"),
    ("RNN", {"activations": ["Affine"]}, "activation Affine without activation_alpha/activation_beta"),
]


@pytest.mark.parametrize("op,attrs,given", BAD, ids=[f"{b[0]}-{b[2][:20]}" for b in BAD])
def test_bad_attributes_name_the_node(op: str, attrs: dict[str, Any], given: str) -> None:
    n, feeds, consts = case(op)
    for k, v in attrs.items():
        for a in list(n.attribute):
            if a.name == k:
                n.attribute.remove(a)
        n.attribute.append(onnx.helper.make_attribute(k, v))
    m = make_model([n], feeds, OUTPUTS[op], consts)
    with pytest.raises(UnsupportedOpError, match=re.escape(f"node {n.name!r} ({op}): {given}") + ".*supported: "):
        run_kubetrt(m, feeds)


def test_bad_sequence_lens_name_the_node() -> None:
    n, feeds, consts = case("LSTM", lens=np.array([7, 1, 1], np.int32))
    with pytest.raises(KernelError, match=r"LSTM lstm_y: sequence_lens \[7, 1, 1\] must be 3 lengths in \[0, 6\]"):
        run_kubetrt(make_model([n], feeds, OUTPUTS["LSTM"], consts), feeds)


@pytest.mark.parametrize("layout", [0, 1])
def test_shape_function(layout: int) -> None:
    fn = lookup("LSTM").shape_fn
    xs = (T, B, I) if layout == 0 else (B, T, I)
    spec = KernelSpec("LSTM", "l", {"direction": "bidirectional", "layout": layout, "hidden_size": H}, [None] * 3,
                      [xs, None, None], [np.dtype(np.float32)] * 3, n_outputs=3, present=[True] * 3)
    y, state = ((T, 2, B, H), (2, B, H)) if layout == 0 else ((B, T, 2, H), (B, 2, H))
    assert fn(spec) == [(y, np.float32), (state, np.float32), (state, np.float32)]
    unknown = KernelSpec("GRU", "g", {}, [None] * 3, [None, None, (1, 3 * H, H)], [None] * 3, n_outputs=2, present=[True] * 3)
    assert lookup("GRU").shape_fn(unknown) == [((-1, 1, -1, H), None), ((1, -1, H), None)]
    assert lookup("RNN").shape_fn(KernelSpec("RNN", "r", {}, [], [], [], n_outputs=1)) == [((-1, 1, -1, -1), None)]


def test_constant_weights_are_laid_out_once() -> None:
    """The factory transposes and stacks constant weights; a call reuses them."""
    n, feeds, consts = case("LSTM", "bidirectional", peepholes=True)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
    attrs["direction"] = attrs["direction"].decode()
    vals = [None, consts["w"], consts["r"], consts["b"], None, None, None, consts["p"]]
    present = [True, True, True, True, False, False, False, True]
    spec = KernelSpec("LSTM", "l", attrs, vals, [v.shape if v is not None else None for v in vals],
                      [np.dtype(np.float32)] * 8, n_outputs=3, present=present)
    run = lookup("LSTM").factory(spec)
    assert isinstance(run, recurrent._Runner) and run.fixed is not None
    assert run.fixed.wt.shape == (I, 2 * 4 * H) and run.fixed.wt.flags.c_contiguous
    assert run.weights(consts["w"], consts["r"], consts["b"], consts["p"], np.dtype(np.float32)) is run.fixed
