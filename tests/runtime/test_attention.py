"""Fused attention: the pass that folds MatMul -> Softmax -> MatMul and the transposes and reshapes
around it into one FusedAttention node (runtime/passes/attention.py), and the kernel that runs it
head by head, reading q, k and v through strides (runtime/kernels/attention.py). Against
onnxruntime on the same graphs and TensorFlow on the zoo's transformer; fp32 tolerance from the
one table (runtime/accuracy.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.kernels import attention, sgemm
from kubetrt.runtime.kernels.omp import TeamChoice
from onnx_cases import make_model, run_ort, run_plan
from threads import on_threads

pytestmark = pytest.mark.skipif(not sgemm.AVAILABLE, reason="numba or libgomp is missing: attention runs as separate ops")
TOL = tolerance_for("fp32", "host")
rng = np.random.default_rng(31)


def f32(*shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=TOL.rtol, atol=TOL.atol)


def const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, onnx.TensorProto.INT64, [len(values)], values))


def mha(b: int, s: int, t: int, heads: int, d: int, e: int, *, scores_hook: str = "", k_late: bool = False,
        softmax_axis: int = -1, shared_heads_k: bool = False) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Multi-head attention as converters write it: projections, Reshape + Transpose per head,
    MatMul, a scale, Softmax, MatMul, Transpose + Reshape back, an output projection.
    scores_hook: "mask" adds a mask to the scores, "output" makes them a graph output too.
    k_late: k is laid out (B, H, T, D) and transposed by a Transpose of its own before the MatMul.
    shared_heads_k: one k for every head (B, 1, D, T), broadcast by the MatMul."""
    c = 24
    feeds = {"x": f32(b, s, c), "mem": f32(b, t, c)}
    inits = {"wq": f32(c, heads * d) * 0.3, "wk": f32(c, (1 if shared_heads_k else heads) * d) * 0.3,
             "wv": f32(c, heads * e) * 0.3, "wo": f32(heads * e, c) * 0.3, "scale": np.array(d ** -0.5, np.float32)}
    kh = 1 if shared_heads_k else heads
    nodes = [
        const("q_shape", [b, s, heads, d]), const("k_shape", [b, t, kh, d]), const("v_shape", [b, t, heads, e]),
        const("o_shape", [b, s, heads * e]),
        helper.make_node("MatMul", ["x", "wq"], ["q2"]), helper.make_node("MatMul", ["mem", "wk"], ["k2"]),
        helper.make_node("MatMul", ["mem", "wv"], ["v2"]),
        helper.make_node("Reshape", ["q2", "q_shape"], ["q4"]), helper.make_node("Transpose", ["q4"], ["q"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["k2", "k_shape"], ["k4"]),
        helper.make_node("Reshape", ["v2", "v_shape"], ["v4"]), helper.make_node("Transpose", ["v4"], ["v"], perm=[0, 2, 1, 3]),
    ]
    if k_late:
        nodes += [helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 1, 3]), helper.make_node("Transpose", ["kt"], ["k"], perm=[0, 1, 3, 2])]
    else:
        nodes += [helper.make_node("Transpose", ["k4"], ["k"], perm=[0, 2, 3, 1])]
    nodes += [helper.make_node("MatMul", ["q", "k"], ["raw"]), helper.make_node("Mul", ["raw", "scale"], ["scores"])]
    softmax_in = "scores"
    if scores_hook == "mask":
        feeds["mask"] = np.where(rng.random((b, 1, 1, t)) < 0.3, -1e4, 0).astype(np.float32)
        nodes.append(helper.make_node("Add", ["scores", "mask"], ["masked"]))
        softmax_in = "masked"
    nodes += [
        helper.make_node("Softmax", [softmax_in], ["probs"], axis=softmax_axis), helper.make_node("MatMul", ["probs", "v"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]), helper.make_node("Reshape", ["ctx_t", "o_shape"], ["ctx2"]),
        helper.make_node("MatMul", ["ctx2", "wo"], ["y"]),
    ]
    outputs = ["y", "scores"] if scores_hook == "output" else ["y"]
    return make_model(nodes, feeds, outputs, inits), feeds


@pytest.mark.parametrize("b,s,t,heads,d,e", [(2, 16, 16, 4, 16, 16), (1, 5, 7, 2, 3, 20), (3, 33, 17, 3, 8, 8), (2, 1, 40, 2, 16, 32)],
                         ids=["whole-tiles", "odd-sizes", "cross-attention", "one-query"])
@pytest.mark.parametrize("k_late", [False, True], ids=["k-transposed-once", "k-transposed-twice"])
def test_multi_head_attention_fuses_and_matches_onnxruntime(b: int, s: int, t: int, heads: int, d: int, e: int, k_late: bool) -> None:
    model, feeds = mha(b, s, t, heads, d, e, k_late=k_late)
    got, ops = run_plan(model, feeds)
    assert "FusedAttention" in ops and not {"Softmax", "Transpose"} & set(ops), ops
    close(got[0], run_ort(model, feeds)[0])


@pytest.mark.parametrize("case", [dict(scores_hook="mask"), dict(scores_hook="output"), dict(softmax_axis=2), dict(shared_heads_k=True)],
                         ids=["masked-scores", "scores-read-twice", "softmax-over-queries", "k-broadcast-over-heads"])
def test_what_the_kernel_does_not_compute_stays_unfused_and_right(case: dict) -> None:
    model, feeds = mha(2, 6, 6, 2, 8, 8, **case)
    got, ops = run_plan(model, feeds)
    assert "FusedAttention" not in ops and "Softmax" in ops, ops
    for g, w in zip(got, run_ort(model, feeds)):
        close(g, w)


def test_the_zoo_transformer_fuses_and_matches_tensorflow(zoo) -> None:  # type: ignore[no-untyped-def]
    from test_models import random_feeds, tf_outputs

    from kubetrt.runtime import load_model

    model = load_model(zoo.package("transformer"))
    for batch in (1, 5):
        feeds = random_feeds(model, batch, seed=batch)
        want = tf_outputs(zoo.savedmodel("transformer"), feeds)
        model_proto = onnx.load(str(zoo.package("transformer") / "model.onnx"))
        got, ops = run_plan(model_proto, {i.name: feeds[i.name] for i in model_proto.graph.input})
        assert ops.count("FusedAttention") == 1 and "Softmax" not in ops, ops
        (name,) = want
        close(got[0], want[name])


def test_heads_are_read_through_strides_where_the_views_allow_it() -> None:
    b, s, h, d = 2, 5, 3, 4
    src = f32(b, s, h * d)
    q_views = [("R", (b, s, h, d)), ("T", (0, 2, 1, 3))]
    layout = attention.heads_layout(src, q_views, (b, h, s, d))
    assert layout is not None
    offset, a_n, b_n, rows, cols, sa, sb, sr, sc = layout
    flat = src.reshape(-1)
    want = attention.apply_views(src, q_views)
    for i in range(a_n * b_n):
        head = [[flat[offset + (i // b_n) * sa + (i % b_n) * sb + r * sr + c * sc] for c in range(cols)] for r in range(rows)]
        np.testing.assert_array_equal(np.array(head, np.float32), want.reshape(-1, s, d)[i])
    # a reshape that splits the minor dims of a transposed tensor cannot be a view: a copy is needed
    assert attention.heads_layout(src, [("T", (0, 2, 1)), ("R", (b, h * d, s))], (b, h * d, s)) is not None
    assert attention.heads_layout(src, [("T", (0, 2, 1)), ("R", (b, h, d * s))], (b, h, d * s)) is None


def test_operands_whose_views_copy_still_give_the_right_heads() -> None:
    # q arrives transposed, so its head split is a reshape of a non-contiguous tensor: no strided layout
    b, s, h, d = 2, 6, 2, 8
    xt = helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1])
    nodes = [
        const("q_shape", [b, h, s, d]), xt, helper.make_node("Transpose", ["xt"], ["xtt"], perm=[0, 2, 1]),
        helper.make_node("Reshape", ["xtt", "q_shape"], ["q"]), helper.make_node("Transpose", ["kv"], ["k"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "k"], ["scores"]), helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "kv"], ["y"]),
    ]
    feeds = {"x": f32(b, s * h, d).reshape(b, s * h, d), "kv": f32(b, h, s, d)}
    model = make_model(nodes, feeds, ["y"])
    got, ops = run_plan(model, feeds)
    assert "FusedAttention" in ops, ops
    close(got[0], run_ort(model, feeds)[0])


def test_a_team_of_one_gives_the_same_bits_as_the_team(monkeypatch: pytest.MonkeyPatch) -> None:
    model, feeds = mha(4, 16, 16, 4, 16, 16)
    results = []
    for serial in (False, True):
        monkeypatch.setattr(TeamChoice, "pick", lambda self, s=serial: s)
        got, ops = run_plan(model, feeds)
        assert "FusedAttention" in ops
        results.append(got[0])
    np.testing.assert_array_equal(results[0], results[1])


def test_threads_share_one_plan() -> None:
    from kubetrt.runtime.devices.host import RUNTIME
    from kubetrt.runtime.onnx_import import from_proto

    model, _ = mha(3, 16, 16, 4, 8, 8)
    graph = from_proto(model)
    plan = RUNTIME.prepare(graph, {})
    cases = [{"x": f32(3, 16, 24), "mem": f32(3, 16, 24)} for _ in range(4)]
    wants = [run_ort(model, c)[0] for c in cases]
    plan = plan.specialized([cases[0][v.name] for v in graph.inputs]) if hasattr(plan, "specialized") else plan
    assert "FusedAttention" in [k.op for k in plan.prog.kernels]

    def work(i: int) -> None:
        for _ in range(20):
            close(plan.run([cases[i][v.name] for v in graph.inputs])[0], wants[i])
    on_threads(work, list(range(4)))


def test_bad_operands_are_named() -> None:
    from kubetrt.runtime.kernels.registry import KernelSpec, lookup

    spec = KernelSpec("FusedAttention", "attn", {"scale": 1.0, "shapes": [[2, 3], [3, 2], [2, 3]], "out_shape": [2, 3]},
                      [None] * 3, [(2, 3), (3, 2), (2, 3)], [np.dtype(np.float32)] * 3)
    run = lookup("FusedAttention", "host").factory(spec)
    with pytest.raises(ValueError, match="FusedAttention attn: expected float32 q, k, v, got float64"):
        run(np.zeros((2, 3)), np.zeros((3, 2), np.float32), np.zeros((2, 3), np.float32))
    q, k, v = f32(2, 3), f32(3, 2), f32(2, 3)
    close(run(q, k, v)[0], attention._reference(q, k, v, 1.0))
    if sgemm.AVAILABLE:  # the kernel reads through layouts made for the compiled shapes: others are refused
        with pytest.raises(ValueError, match=r"FusedAttention attn: k has shape \[3, 3\], expected 6 elements \(the \[3, 2\]"):
            run(q, f32(3, 3), v)
