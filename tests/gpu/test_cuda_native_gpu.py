"""The cuda runtime's native GPU parts (cuBLAS on its own handle, cuDNN's convolutions, the one-launch
depthwise, im2col and pooling kernels) against onnxruntime, eager and replayed from a CUDA Graph.
Skipped where CuPy or a GPU is absent; on a GPU node: pytest tests/gpu/test_cuda_native_gpu.py."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kubetrt.runtime.accuracy import GPU, tolerance_for
from kubetrt.runtime.devices.cuda import CudaRuntime
from kubetrt.runtime.onnx_import import from_proto

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from onnx_cases import make_model, node, run_ort  # noqa: E402


def _rng(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _check(rt: CudaRuntime, model: Any, feeds: dict[str, np.ndarray], precision: str, conv_algo: str = "im2col") -> Any:
    """Runs eager and replayed; both must match onnxruntime at the precision's gpu tolerance."""
    want = run_ort(model, feeds)
    tol = tolerance_for(precision, GPU)
    for graphs in (False, True):
        exe = rt.prepare(from_proto(model), {"precision": precision, "cuda_graphs": graphs, "contexts": 1,
                                             "conv_algo": conv_algo})
        for _ in range(2):  # capture, then replay
            got = exe.run([feeds[k] for k in feeds])
            for g, w in zip(got, want):
                assert g.shape == w.shape
                np.testing.assert_allclose(g.astype(np.float32), w, rtol=tol.rtol, atol=tol.atol)
        if graphs:
            assert exe.capture_failures == {} and exe.stats["replays"] == 2, exe.capture_failures  # capture launches too
    return exe


CONV_CASES = [  # (id, weight shape, attrs, input shape, epilogue)
    ("depthwise_3x3_same_relu6", (32, 1, 3, 3), dict(group=32, pads=[1, 1, 1, 1]), (2, 32, 15, 15), "clip"),
    ("depthwise_5x5_s2_asym", (16, 1, 5, 5), dict(group=16, strides=[2, 2], pads=[1, 2, 2, 1]), (1, 16, 14, 14), "relu"),
    ("depthwise_dilated_residual", (8, 1, 3, 3), dict(group=8, pads=[2, 2, 2, 2], dilations=[2, 2]), (2, 8, 9, 9), "add"),
    ("dense_3x3_s2", (24, 16, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1]), (3, 16, 17, 17), "relu"),
    ("dense_7x7_stem", (16, 3, 7, 7), dict(strides=[2, 2], pads=[3, 3, 3, 3]), (2, 3, 32, 32), "none"),
    ("dense_1x1_s2", (32, 16, 1, 1), dict(strides=[2, 2]), (2, 16, 8, 8), "none"),
    ("dense_1x1_residual", (16, 16, 1, 1), dict(), (4, 16, 6, 6), "add"),
    ("grouped_3x3", (12, 3, 3, 3), dict(group=4, pads=[1, 1, 1, 1]), (1, 12, 10, 10), "relu"),
    # batch x channels beyond one grid dimension (65535 blocks)
    ("wide_batch_1x1", (2048, 64, 1, 1), dict(), (40, 64, 2, 2), "relu"),
]


@pytest.mark.parametrize("algo", ["im2col", "cudnn"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", CONV_CASES, ids=[c[0] for c in CONV_CASES])
def test_native_convolutions_match_onnxruntime_eager_and_replayed(gpu: CudaRuntime, case: Any, precision: str,
                                                                  algo: str) -> None:
    if algo not in gpu.conv_algos():
        pytest.skip("cuDNN does not load on this GPU node")
    _, wshape, attrs, xshape, tail = case
    x = _rng(1, xshape)
    inits = {"w": _rng(2, wshape) * 0.3, "b": _rng(3, (wshape[0],))}
    nodes = [node("Conv", ["x", "w", "b"], ["c"], kernel_shape=list(wshape[2:]), **attrs)]
    if tail == "relu":
        nodes.append(node("Relu", ["c"], ["y"]))
    elif tail == "clip":
        inits |= {"lo": np.array(0, np.float32), "hi": np.array(6, np.float32)}
        nodes.append(node("Clip", ["c", "lo", "hi"], ["y"]))
    elif tail == "add":
        nodes.append(node("Add", ["c", "x"], ["y"]))
    else:
        nodes.append(node("Identity", ["c"], ["y"]))
    model = make_model(nodes, {"x": x}, ["y"], inits)
    exe = _check(gpu, model, {"x": x}, precision, algo)
    pads = attrs.get("pads", [0] * 4)
    if algo == "cudnn" and "depthwise" not in case[0] and pads[:2] == pads[2:]:
        assert exe.plan.ctx.conv_choices, "the layer's choice between cuDNN and the GEMMs was timed and recorded"


POOL_CASES = [
    ("maxpool_3x3_s2_pad", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]), "MaxPool", (2, 8, 15, 15)),
    ("maxpool_ceil", dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1), "MaxPool", (1, 4, 7, 7)),
    ("avgpool_excl_pad", dict(kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1]), "AveragePool", (2, 4, 6, 6)),
    ("avgpool_incl_pad_ceil", dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1,
                                   ceil_mode=1), "AveragePool", (1, 4, 8, 8)),
]


@pytest.mark.parametrize("case", POOL_CASES, ids=[c[0] for c in POOL_CASES])
def test_native_pooling_matches_onnxruntime_eager_and_replayed(gpu: CudaRuntime, case: Any) -> None:
    _, attrs, op, shape = case
    x = _rng(4, shape)
    _check(gpu, make_model([node(op, ["x"], **attrs)], {"x": x}, ["y"]), {"x": x}, "fp32")


MATMUL_CASES = [  # a shape, b shape (constant b where named "w")
    ("vector_rows", (1, 64), (64, 10)),
    ("batched_broadcast_weight", (4, 7, 32), (32, 16)),
    ("attention_scores", (2, 4, 9, 16), (2, 4, 16, 9)),
    ("broadcast_left", (1, 5, 8), (3, 8, 6)),
]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("case", MATMUL_CASES, ids=[c[0] for c in MATMUL_CASES])
def test_native_matmul_is_captured_and_matches_onnxruntime(gpu: CudaRuntime, case: Any, precision: str) -> None:
    _, ashape, bshape = case
    a, b = _rng(5, ashape), _rng(6, bshape)
    model = make_model([node("MatMul", ["a", "b"])], {"a": a, "b": b}, ["y"])
    _check(gpu, model, {"a": a, "b": b}, precision)


def test_tf32_math_mode_changes_fp32_gemm_results_within_tolerance(gpu: CudaRuntime) -> None:
    """TF32 is a real choice: its products differ from exact fp32 ones, and stay in the fp32 bound."""
    a, b = _rng(7, (256, 512)), _rng(8, (512, 256))
    model = make_model([node("MatMul", ["a", "b"])], {"a": a, "b": b}, ["y"])
    outs = {}
    for math in ("default", "tf32"):
        exe = gpu.prepare(from_proto(model), {"precision": "fp32", "math": math, "contexts": 1})
        outs[math] = exe.run([a, b])[0]
    exact = a.astype(np.float64) @ b.astype(np.float64)
    err = {m: float(np.abs(o - exact).max()) for m, o in outs.items()}
    assert err["tf32"] > 10 * err["default"], err
    assert err["tf32"] < 0.5, err


def test_batches_replay_the_graph_of_their_power_of_two_bucket(gpu: CudaRuntime) -> None:
    x, w = _rng(9, (3, 8, 6, 6)), _rng(10, (4, 8, 3, 3))
    model = make_model([node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3]), node("Relu", ["c"], ["y"])],
                       {"x": x}, ["y"], {"w": w}, dynamic_batch=True)
    exe = gpu.prepare(from_proto(model), {"precision": "fp32", "cuda_graphs": True, "contexts": 1})
    tol = tolerance_for("fp32", GPU)
    for rows in (3, 4, 3):
        got = exe.run([x[:rows] if rows <= 3 else np.concatenate([x, x[:1]])])[0]
        want = run_ort(model, {"x": x[:rows] if rows <= 3 else np.concatenate([x, x[:1]])})[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=tol.rtol, atol=tol.atol)
    assert exe.stats["captures"] == 1 and exe.stats["replays"] == 3  # 3 rows ran on the graph of 4
