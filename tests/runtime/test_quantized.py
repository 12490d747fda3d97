"""Explicit quantization on the host: Q/DQ kernels exactly as onnxruntime computes them, and Q/DQ
graphs run on integer convolutions and matmuls (runtime/passes/quantization.py) within a couple of
output quantization steps of onnxruntime running the same graph literally (every op in float
between DequantizeLinear and QuantizeLinear, graph optimizations off)."""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
import pytest

from kubetrt.runtime.kernels import onednn
from kubetrt.runtime.onnx_import import from_proto
from kubetrt.runtime.passes import optimize

from onnx_cases import make_model, node, run_kubetrt, run_ort

rng = np.random.default_rng(7)


def f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8])
@pytest.mark.parametrize("zero_point", [0, 3])
def test_quantize_dequantize_per_tensor_match_onnxruntime(dtype: Any, zero_point: int) -> None:
    # halves (x / scale = k + 0.5) round to even, and values far outside the range saturate
    x = np.concatenate([np.arange(-8, 8, dtype=np.float32) * 0.25 + 0.125, f32(64, scale=40.0)]).astype(np.float32)
    init = {"s": np.array(0.25, np.float32), "zp": np.array(zero_point, dtype)}
    model = make_model([node("QuantizeLinear", ["x", "s", "zp"], ["q"]), node("DequantizeLinear", ["q", "s", "zp"], ["y"])],
                       {"x": x}, ["q", "y"], init)
    want = run_ort(model, {"x": x})
    got = run_kubetrt(model, {"x": x})
    assert got[0].dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_quantize_dequantize_per_axis_match_onnxruntime() -> None:
    x = f32(2, 3, 4, scale=3.0)
    init = {"s": np.array([0.1, 0.02, 0.5], np.float32), "zp": np.zeros(3, np.int8)}
    model = make_model([node("QuantizeLinear", ["x", "s", "zp"], ["q"], axis=1), node("DequantizeLinear", ["q", "s", "zp"], ["y"], axis=1)],
                       {"x": x}, ["q", "y"], init)
    for got, want in zip(run_kubetrt(model, {"x": x}), run_ort(model, {"x": x})):
        np.testing.assert_array_equal(got, want)


def test_quantize_without_zero_point_is_uint8() -> None:
    x = f32(10, scale=50.0)
    model = make_model([node("QuantizeLinear", ["x", "s"], ["q"])], {"x": x}, ["q"], {"s": np.array(0.5, np.float32)})
    (got,) = run_kubetrt(model, {"x": x})
    assert got.dtype == np.uint8
    np.testing.assert_array_equal(got, run_ort(model, {"x": x})[0])


# ---------------------------------------------------------------- Q/DQ graphs on integers

def _qdq(name: str, scale: float, out: str, init: dict[str, np.ndarray]) -> list[onnx.NodeProto]:
    """QuantizeLinear -> DequantizeLinear of `name` at a symmetric int8 scale (what the quantizer writes)."""
    init[f"{name}_s"], init[f"{name}_zp"] = np.array(scale, np.float32), np.array(0, np.int8)
    return [node("QuantizeLinear", [name, f"{name}_s", f"{name}_zp"], [f"{name}_q"]),
            node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_zp"], [out])]


def _weights(name: str, w: np.ndarray, axis: int, init: dict[str, np.ndarray], bits: int = 8) -> list[onnx.NodeProto]:
    """Per-channel symmetric int8 weights and their DequantizeLinear."""
    other = tuple(i for i in range(w.ndim) if i != axis)
    top = 2 ** (bits - 1) - 1
    scale = (np.abs(w).max(axis=other) / top).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    init[f"{name}_q"] = np.clip(np.rint(w / scale.reshape(shape)), -top, top).astype(np.int8)
    init[f"{name}_s"], init[f"{name}_zp"] = scale, np.zeros(scale.size, np.int8)
    return [node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_zp"], [name], axis=axis)]


def _bias(name: str, b: np.ndarray, x_scale: float, w_scale: np.ndarray, init: dict[str, np.ndarray]) -> list[onnx.NodeProto]:
    scale = (x_scale * w_scale).astype(np.float32)
    init[f"{name}_q"] = np.rint(b / scale).astype(np.int32)
    init[f"{name}_s"], init[f"{name}_zp"] = scale, np.zeros(scale.size, np.int32)
    return [node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_zp"], [name], axis=0)]


CALIBRATED = ["x", "a", "ar", "c", "d", "s", "sr", "g", "pf"]


def residual_block(batch: int = 2, channels: int = 8, hw: int = 10) -> tuple[onnx.ModelProto, dict[str, np.ndarray], float]:
    """x -> conv3x3+ReLU -> conv1x1, + shortcut conv1x1, ReLU -> conv3x3 stride 2 -> global pool -> dense:
    a ResNet block as onnxruntime's QDQ quantizer writes it, with min-max scales from the float
    graph's own activations. Returns the model and a feed."""
    x = np.random.default_rng(1).standard_normal((batch, channels, hw, hw)).astype(np.float32)
    probe = _residual_block({k: 1.0 for k in CALIBRATED}, channels, x)
    ranges = run_ort(_float_model(probe, CALIBRATED), {"x": x})
    scales = {k: float(np.abs(v).max()) / 127 for k, v in zip(CALIBRATED, ranges)}
    return _residual_block(scales, channels, x), {"x": x}


def _residual_block(scales: dict[str, float], channels: int, x: np.ndarray) -> onnx.ModelProto:
    init: dict[str, np.ndarray] = {}
    nodes: list[onnx.NodeProto] = []
    wrng = np.random.default_rng(2)
    nodes += _qdq("x", scales["x"], "xd", init)

    def conv(name: str, src: str, cin: int, cout: int, k: int, stride: int = 1) -> None:
        w = (wrng.standard_normal((cout, cin, k, k)) * 0.3).astype(np.float32)
        nodes.extend(_weights(f"{name}_w", w, 0, init))
        nodes.extend(_bias(f"{name}_b", (wrng.standard_normal(cout) * 0.1).astype(np.float32), scales[src], init[f"{name}_w_s"], init))
        dq = {"x": "xd", "ar": "bd", "sr": "fd"}[src]
        nodes.append(node("Conv", [dq, f"{name}_w", f"{name}_b"], [name], pads=[k // 2] * 4, strides=[stride, stride]))

    conv("a", "x", channels, channels, 3)
    nodes += _qdq("a", scales["a"], "ad", init) + [node("Relu", ["ad"], ["ar"])] + _qdq("ar", scales["ar"], "bd", init)
    conv("c", "ar", channels, channels, 1)
    nodes += _qdq("c", scales["c"], "cd", init)
    conv("d", "x", channels, channels, 1)
    nodes += _qdq("d", scales["d"], "dd", init)
    nodes += [node("Add", ["cd", "dd"], ["s"])] + _qdq("s", scales["s"], "sd", init)
    nodes += [node("Relu", ["sd"], ["sr"])] + _qdq("sr", scales["sr"], "fd", init)
    conv("g", "sr", channels, 2 * channels, 3, stride=2)
    nodes += _qdq("g", scales["g"], "gd", init) + [node("GlobalAveragePool", ["gd"], ["p"]), node("Flatten", ["p"], ["pf"])]
    nodes += _qdq("pf", scales["pf"], "pd", init)
    nodes += _weights("fc_w", (wrng.standard_normal((2 * channels, 5)) * 0.5).astype(np.float32), 1, init)
    nodes += [node("MatMul", ["pd", "fc_w"], ["m"]), node("Add", ["m", "fc_b"], ["y"])]
    init["fc_b"] = (wrng.standard_normal(5) * 0.1).astype(np.float32)
    return make_model(nodes, {"x": x}, ["y"], init, dynamic_batch=True)


def test_qdq_graph_runs_on_integer_convolutions() -> None:
    model, _ = residual_block()
    g = optimize(from_proto(model))
    ops = Counter(n.op for n in g.nodes)
    assert ops["QConvNHWC"] == 4 and ops["QMatMul"] == 1, ops
    assert not {"Conv", "FusedConv", "FusedConvNHWC", "Relu", "Add"} & set(ops), ops
    by_name = {n.name: n for n in g.nodes if n.op == "QConvNHWC"}
    convs = sorted(by_name.values(), key=lambda n: n.name)
    # requantized in the call: the ReLU'd results as uint8, the rest int8; the residual sum is fused
    assert [n.attrs.get("y_dtype") for n in convs] == ["uint8", "uint8", "int8", None], [(n.name, n.attrs) for n in convs]
    assert [len([i for i in n.inputs if i]) for n in convs] == [3, 4, 3, 3]
    assert [g.values[n.inputs[0]].dtype for n in convs] == [np.int8, np.uint8, np.int8, np.uint8]


@pytest.mark.parametrize("executor", ["sequential", "dataflow"])
@pytest.mark.parametrize("batch", [1, 3])
def test_qdq_graph_matches_onnxruntime(executor: str, batch: int) -> None:
    model, _ = residual_block(batch=2)
    x = np.random.default_rng(batch).standard_normal((batch, 8, 10, 10)).astype(np.float32)
    (want,) = run_ort(model, {"x": x})
    (got,) = run_kubetrt(model, {"x": x}, executor=executor)
    # The fused path rounds once per integer op where the literal graph also rounds the
    # convolution's result before ReLU and the sum, and clips where these inputs exceed the
    # calibrated ranges: within 3% of the output's range.
    np.testing.assert_allclose(got, want, atol=0.03 * np.abs(want).max(), rtol=0)
    (fp,) = run_ort(_float_model(model), {"x": x})
    assert np.abs(got - fp).max() <= np.abs(want - fp).max() + 0.05  # no further from float than onnxruntime's QDQ


def _float_model(model: onnx.ModelProto, outputs: list[str] | None = None) -> onnx.ModelProto:
    """The same graph with every Q/DQ round trip of activations removed (weights stay quantized):
    the float computation the quantized one approximates; `outputs` replaces its outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    producers = {o: n for n in m.graph.node for o in n.output}
    renamed: dict[str, str] = {}
    keep = []
    for n in m.graph.node:
        q = producers.get(n.input[0]) if n.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear":
            renamed[n.output[0]] = q.input[0]
            continue
        keep.append(n)
    for n in keep:
        for i, name in enumerate(n.input):
            n.input[i] = renamed.get(name, name)
    del m.graph.node[:]
    m.graph.node.extend(k for k in keep if k.op_type != "QuantizeLinear")
    if outputs is not None:
        del m.graph.output[:]
        m.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in outputs)
    return m


@pytest.mark.skipif(not onednn.AVAILABLE, reason="the onednn extra is not installed")
@pytest.mark.parametrize("source", ["int8", "uint8"])
def test_full_range_sources_and_weights_do_not_saturate(source: str) -> None:
    """Extreme sources (a model's own uint8 input reaches 255) and weights of +-127: on CPUs
    without VNNI oneDNN's int16 pair sums would saturate unless the weights are narrowed; either
    way the result must match the float computation within what 7-bit weights cost."""
    init: dict[str, np.ndarray] = {}
    dtype = np.dtype(source)
    q = rng.choice([np.iinfo(dtype).min, np.iinfo(dtype).max], (2, 16, 6, 6)).astype(dtype)
    w = rng.choice([-1.0, 1.0], (8, 16, 3, 3)).astype(np.float32)
    init["x_s"], init["x_zp"] = np.array(0.05, np.float32), np.array(0, dtype)
    nodes = [node("DequantizeLinear", ["q", "x_s", "x_zp"], ["xd"])] + _weights("w", w, 0, init)
    nodes += [node("Conv", ["xd", "w"], ["c"], pads=[1, 1, 1, 1]), node("Conv", ["c", "w2"], ["y"])]
    init["w2"] = np.eye(8, dtype=np.float32).reshape(8, 8, 1, 1)  # a second conv so the layout pass runs NHWC
    model = make_model(nodes, {"q": q}, ["y"], init)
    (want,) = run_ort(model, {"q": q})
    (got,) = run_kubetrt(model, {"q": q})
    np.testing.assert_allclose(got, want, rtol=0, atol=0.01 * np.abs(want).max())


def test_without_onednn_integer_ops_compute_the_same_in_float(monkeypatch: pytest.MonkeyPatch) -> None:
    model, feeds = residual_block()
    with_onednn = run_kubetrt(model, feeds)[0]
    monkeypatch.setattr(onednn, "AVAILABLE", False)
    without = run_kubetrt(model, feeds)[0]
    np.testing.assert_allclose(without, with_onednn, atol=0.06, rtol=0)


def test_block_quantization_is_refused_at_compile_time() -> None:
    from kubetrt.runtime.errors import UnsupportedOpError

    x = f32(4, 4)
    model = make_model([node("DequantizeLinear", ["q", "s"], ["y"], axis=1, block_size=2)], {"q": x.astype(np.int8)}, ["y"],
                       {"s": np.ones((4, 2), np.float32)})
    with pytest.raises(UnsupportedOpError, match="block_size=2"):
        run_kubetrt(model, {"q": x.astype(np.int8)})


@pytest.mark.parametrize("rows", [1, 16])
def test_integer_matmuls_match_onnxruntime(rows: int) -> None:
    """Two Dense layers as the quantizer writes them, at a GEMV and a GEMM: the first reads a
    signed source, the second the first's ReLU'd uint8 result (integers end to end where they
    cannot saturate, float where they could: the same numbers either way)."""
    init: dict[str, np.ndarray] = {}
    x = f32(rows, 32)
    nodes = _qdq("x", float(np.abs(x).max()) / 127, "xd", init) + _weights("w", f32(32, 24, scale=0.3), 1, init)
    nodes += [node("MatMul", ["xd", "w"], ["m"]), node("Relu", ["m"], ["r"])]
    nodes += _qdq("r", 0.05, "rd", init) + _weights("w2", f32(24, 12), 1, init)
    nodes += [node("MatMul", ["rd", "w2"], ["m2"]), node("Add", ["m2", "b"], ["y"])]
    init["b"] = f32(12)
    model = make_model(nodes, {"x": x}, ["y"], init)
    g = optimize(from_proto(model))
    assert [n.op for n in g.nodes] == ["QuantizeLinear", "QMatMul", "QMatMul"]
    assert g.nodes[1].attrs["y_dtype"] == "uint8" and g.nodes[2].attrs["x_max"] == 127
    (want,) = run_ort(model, {"x": x})
    (got,) = run_kubetrt(model, {"x": x})
    # one rounding of the ReLU'd result to the 0.05 grid, where onnxruntime also rounds before ReLU
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(init["w2_q"] * init["w2_s"]).sum(axis=0).max())


def test_qdq_graph_compiles_without_fusion() -> None:
    """Integer ops without fused epilogues still get their requantization and run."""
    from kubetrt.runtime.executor import SequentialPlan
    from kubetrt.runtime.program import compile_graph

    model, feeds = residual_block()
    plan = SequentialPlan(compile_graph(from_proto(model), "host", fusion=False))
    (got,) = plan.run([feeds["x"]])
    (want,) = run_ort(model, feeds)
    np.testing.assert_allclose(got, want, atol=0.03 * np.abs(want).max(), rtol=0)
