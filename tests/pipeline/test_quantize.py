"""INT8 quantization and `lower --calibration`: real onnxruntime, real TensorFlow, checked from outside."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kubetrt.cli import main
from kubetrt.pipeline import lower as lower_mod
from kubetrt.pipeline import quantize as quantize_mod
from kubetrt.pipeline.calibration import CalibrationError, CalibrationOptions, data_digest
from kubetrt.pipeline.ingest import tensorflow
from kubetrt.pipeline.quantize import quantize
from kubetrt.pipeline.stages import lower_stage
from kubetrt.runtime.package import (
    GOLDEN,
    HELDOUT,
    MODEL_INT8_ONNX,
    MODEL_ONNX,
    load_heldout,
    model_file,
    open_package,
)


def float_model(zoo: Any, name: str) -> Any:
    return onnx.load(str(zoo.package(name) / MODEL_ONNX))


def initializers(model: Any) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def producers(model: Any) -> dict[str, Any]:
    return {out: node for node in model.graph.node for out in node.output}


def dequantized_weight(model: Any, node: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(int8 weight, scale, zero point, axis) when `node`'s weight is a DequantizeLinear of a constant."""
    dq = producers(model).get(node.input[1])
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    inits = initializers(model)
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    return inits[dq.input[0]], inits[dq.input[1]], inits[dq.input[2]], axis


def is_quantized_input(model: Any, tensor: str) -> bool:
    node = producers(model).get(tensor)
    return node is not None and node.op_type == "DequantizeLinear"


def nodes_of(model: Any, op_type: str) -> list[Any]:
    return [n for n in model.graph.node if n.op_type == op_type]


def activation_scale(model: Any, tensor: str) -> float:
    q = next(n for n in nodes_of(model, "QuantizeLinear") if n.input[0] == tensor)
    inits = initializers(model)
    assert inits[q.input[2]].dtype == np.int8 and inits[q.input[2]] == 0
    return float(inits[q.input[1]])


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 32, 32, 3)).astype(np.float32)


# --------------------------------------------------------------------------- the Q/DQ graph


def test_weights_are_int8_symmetric_per_output_channel_and_activations_symmetric(zoo) -> None:
    model = float_model(zoo, "small_cnn")
    q = quantize(model, {"image": images(24)}, CalibrationOptions("data")).model
    onnx.checker.check_model(q, full_check=True)
    convs = nodes_of(q, "Conv")
    assert len(convs) == 4
    for conv in convs:
        found = dequantized_weight(q, conv)
        assert found is not None, f"{conv.name}: weight is not quantized"
        weight, scale, zero, axis = found
        channels = weight.shape[0]
        assert weight.dtype == np.int8 and axis == 0 and scale.shape == (channels,) == zero.shape
        assert zero.dtype == np.int8 and not zero.any()  # symmetric
        # symmetric max-abs scaling: every output channel reaches +-127 and has its own scale
        assert (np.abs(weight.reshape(channels, -1).astype(int)).max(axis=1) == 127).all()
        assert len(np.unique(scale)) > channels // 2
        assert is_quantized_input(q, conv.input[0])
        assert len(conv.input) < 3 or not is_quantized_input(q, conv.input[2])  # bias stays float
    for node in nodes_of(q, "QuantizeLinear"):
        zero = initializers(q)[node.input[2]]
        assert zero.dtype == np.int8 and zero.ndim == 0 and zero == 0
    assert not any(initializers(q)[n.input[0]].dtype == np.int32
                   for n in nodes_of(q, "DequantizeLinear") if n.input[0] in initializers(q))


def test_matmul_weights_are_per_output_column(zoo) -> None:
    model = float_model(zoo, "mlp")
    x = np.random.default_rng(1).standard_normal((20, 256)).astype(np.float32)
    q = quantize(model, {"features": x}, CalibrationOptions("data")).model
    matmuls = nodes_of(q, "MatMul")
    assert len(matmuls) == 3
    for node in matmuls:
        weight, scale, zero, axis = dequantized_weight(q, node) or pytest.fail(f"{node.name} not quantized")
        assert axis == 1 and scale.shape == (weight.shape[1],) and not zero.any()
        assert (np.abs(weight.astype(int)).max(axis=0) == 127).all()


def test_quantized_model_stays_close_to_the_float_model(zoo) -> None:
    model = float_model(zoo, "small_cnn")
    q = quantize(model, {"image": images(32)}, CalibrationOptions("data"))
    fresh = images(8, seed=9)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"image": fresh})[0]
    got = ort.InferenceSession(q.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"image": fresh})[0]
    assert got.shape == want.shape == (8, 10)
    err = np.abs(got - want).max()
    assert 0 < err < 0.1, err  # really quantized (not bit-equal), yet close
    assert (got.argmax(axis=1) == want.argmax(axis=1)).mean() >= 0.75


def test_methods_measure_different_ranges_on_skewed_data(zoo) -> None:
    """One outlier in the last batch: minmax spans it, percentile clips near the percentile of |x|,
    entropy clips to where the bulk of the distribution is."""
    model = float_model(zoo, "mlp")
    x = np.random.default_rng(2).standard_normal((48, 256)).astype(np.float32)
    x[47, 3] = 60.0  # batches of 16: the outlier only arrives with the third
    scales = {}
    for method, percentile in (("minmax", None), ("percentile", 99.99), ("percentile", 99.0), ("entropy", None)):
        q = quantize(model, {"features": x}, CalibrationOptions("data", method=method, percentile=percentile))
        scales[(method, percentile)] = activation_scale(q.model, "features")
    absx = np.abs(x).ravel()
    assert scales[("minmax", None)] == pytest.approx(60.0 / 127, rel=1e-6)
    for p in (99.99, 99.0):  # at the p-th percentile of |x|, to within two samples and a histogram bin
        low, high = (np.percentile(absx, q, method="inverted_cdf") for q in (p - 200 / absx.size, p))
        assert (low - 0.01) / 127 <= scales[("percentile", p)] <= high / 127, p
    assert scales[("percentile", 99.0)] < scales[("percentile", 99.99)] < scales[("minmax", None)] / 5
    assert scales[("entropy", None)] < scales[("minmax", None)] / 5
    assert len(set(scales.values())) == 4


def test_quantization_is_a_pure_function(zoo) -> None:
    model = float_model(zoo, "small_cnn")
    options = CalibrationOptions("data", method="percentile", keep_float=("first",))
    a, b = quantize(model, {"image": images(20)}, options), quantize(model, {"image": images(20)}, options)
    assert a.model.SerializeToString() == b.model.SerializeToString()
    assert a.record == b.record
    c = quantize(model, {"image": images(20, seed=5)}, options)
    assert c.model.SerializeToString() != a.model.SerializeToString()  # the data matters


def test_record_says_what_was_done(zoo) -> None:
    q = quantize(float_model(zoo, "mlp"), {"features": np.ones((4, 256), np.float32)},
                 CalibrationOptions("data", method="percentile"))
    r = q.record
    assert (r["format"], r["method"], r["percentile"], r["bias"], r["file"]) == ("qdq", "percentile", 99.999, "float",
                                                                                  MODEL_INT8_ONNX)
    assert r["weights"] == {"type": "int8", "symmetric": True, "granularity": "per-channel"}
    assert r["activations"] == {"type": "int8", "symmetric": True, "granularity": "per-tensor"}
    assert r["library"] == {"name": "onnxruntime", "version": ort.__version__}
    assert r["float"] == {"op_types": ["LayerNormalization", "Softmax"], "nodes": [], "requested": []}
    assert r["nodes"]["QuantizeLinear"] == len(nodes_of(q.model, "QuantizeLinear")) > 0


# --------------------------------------------------------------------------- keep_float


def test_softmax_stays_float_by_default(zoo, monkeypatch: pytest.MonkeyPatch) -> None:
    def softmax_output_quantized() -> bool:
        q = quantize(float_model(zoo, "small_cnn"), {"image": images(8)}, CalibrationOptions("data")).model
        (softmax,) = nodes_of(q, "Softmax")
        return any(n.input[0] == softmax.output[0] for n in nodes_of(q, "QuantizeLinear"))

    assert not softmax_output_quantized()
    monkeypatch.setattr(quantize_mod, "FLOAT_OP_TYPES", ())
    assert softmax_output_quantized()  # what onnxruntime does unless told otherwise


@pytest.mark.parametrize("keep, float_index", [("first", 0), ("last", -1)])
def test_keep_first_or_last_layer_in_float(zoo, keep: str, float_index: int) -> None:
    model = float_model(zoo, "small_cnn")
    default = quantize(model, {"image": images(8)}, CalibrationOptions("data")).model
    layers = [n for n in default.graph.node if n.op_type in ("Conv", "MatMul")]  # graph order is topological
    assert [n.op_type for n in layers] == ["Conv"] * 4 + ["MatMul"]
    kept = layers[float_index].name
    q = quantize(model, {"image": images(8)}, CalibrationOptions("data", keep_float=(keep,)))
    assert q.record["float"]["nodes"] == [kept]
    for node in q.model.graph.node:
        if node.op_type in ("Conv", "MatMul"):
            quantized = dequantized_weight(q.model, node) is not None
            assert quantized == (node.name != kept), node.name
            if node.name == kept:  # computes in float, on its float weight itself
                assert initializers(q.model)[node.input[1]].dtype == np.float32


def test_keep_op_type_and_node_name_in_float(zoo) -> None:
    model = float_model(zoo, "small_cnn")
    q = quantize(model, {"image": images(8)}, CalibrationOptions("data", keep_float=("Conv",))).model
    assert all(dequantized_weight(q, n) is None for n in nodes_of(q, "Conv"))
    assert dequantized_weight(q, nodes_of(q, "MatMul")[0]) is not None
    second = nodes_of(q, "Conv")[1].name
    q = quantize(model, {"image": images(8)}, CalibrationOptions("data", keep_float=(second,))).model
    assert [n.name for n in nodes_of(q, "Conv") if dequantized_weight(q, n) is None] == [second]


def test_keep_float_entries_that_match_nothing(zoo) -> None:
    model = float_model(zoo, "small_cnn")
    data = {"image": images(4)}
    with pytest.raises(CalibrationError, match=r"keep-float 'conv_7' is neither a node name nor an op type"):
        quantize(model, data, CalibrationOptions("data", keep_float=("conv_7",)))
    with pytest.raises(CalibrationError, match=r"keep-float op type 'LSTM' does not occur in the model; its op types "
                                               r"are Conv, .*MatMul"):
        quantize(model, data, CalibrationOptions("data", keep_float=("LSTM",)))
    fused = nodes_of(model, "Mul")[0].name  # the depthwise conv's BatchNorm scale, folded into the conv
    with pytest.raises(CalibrationError, match=r"was fused into another node by onnxruntime's pre-processing"):
        quantize(model, data, CalibrationOptions("data", keep_float=(fused,)))


def test_first_and_last_need_a_weighted_layer() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Add", ["r", "x"], ["y"], name="add")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = {"x": np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)}
    with pytest.raises(CalibrationError, match=r"keep-float 'last': the model has no Conv/MatMul/Gemm layer"):
        quantize(model, data, CalibrationOptions("data", keep_float=("last",)))
    q = quantize(model, data, CalibrationOptions("data"))  # and a graph without layers still quantizes
    assert nodes_of(q.model, "QuantizeLinear")


# --------------------------------------------------------------------------- lower --calibration


def _rows_in(rows: np.ndarray, data: np.ndarray) -> list[int]:
    flat = data.reshape(len(data), -1)
    return [int(np.flatnonzero((flat == r.reshape(-1)).all(axis=1))[0]) for r in rows]


def test_cli_lower_with_calibration_writes_int8_model_and_heldout(zoo, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    savedmodel = zoo.savedmodel("small_cnn")
    data = np.random.default_rng(3).uniform(-2, 2, (30, 32, 32, 3))  # float64: cast to the model's float32
    labels = np.arange(30) % 10
    np.savez(tmp_path / "calib.npz", image=data, labels=labels)
    out = tmp_path / "pkg"
    rc = main(["lower", str(savedmodel), "-o", str(out), "--name", "cnn8", "--calibration", str(tmp_path / "calib.npz"),
               "--calibration-method", "percentile", "--percentile", "99.9", "--holdout", "0.3",
               "--keep-float", "last"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "int8: model.int8.onnx calibrated with percentile 99.9 on 21 samples of npz data" in printed
    assert "held out: 9 samples with labels" in printed

    manifest = open_package(out)  # checks every listed digest
    assert set(manifest.files) == {MODEL_ONNX, GOLDEN, MODEL_INT8_ONNX, HELDOUT}
    for rel in (MODEL_INT8_ONNX, HELDOUT):
        assert manifest.files[rel] == "sha256:" + hashlib.sha256((out / rel).read_bytes()).hexdigest()
    assert model_file(manifest, "int8") == MODEL_INT8_ONNX

    q = manifest.quantization
    cal = q["calibration"]
    assert (q["method"], q["percentile"], q["file"]) == ("percentile", 99.9, MODEL_INT8_ONNX)
    assert (cal["samples"], cal["heldout_samples"], cal["kind"], cal["holdout"]) == (21, 9, "npz", 0.3)
    assert cal["source"] == str((tmp_path / "calib.npz").resolve())
    assert cal["digest"] == data_digest({"image": data.astype(np.float32)}, labels)
    assert q["coverage"]["host"]["missing"] == []

    int8 = onnx.load(str(out / MODEL_INT8_ONNX))
    assert nodes_of(int8, "QuantizeLinear") and q["float"]["nodes"] == [nodes_of(int8, "MatMul")[-1].name]
    assert dequantized_weight(int8, nodes_of(int8, "MatMul")[-1]) is None

    # heldout.npz: exactly the samples kept out, their labels, and TensorFlow's outputs for them
    held = load_heldout(out, manifest)
    assert held is not None and held.samples == 9 and held.labels is not None
    rows = _rows_in(held.inputs["image"], data.astype(np.float32))
    assert len(set(rows)) == 9 and rows == sorted(rows)
    np.testing.assert_array_equal(held.labels, labels[rows])
    assert manifest.heldout == {"samples": 9, "labels": True, "source": cal["source"],
                                "digest": data_digest(held.inputs, held.labels)}
    fn = tensorflow().saved_model.load(str(savedmodel)).signatures["serving_default"]
    want = fn(image=tensorflow().constant(data[rows].astype(np.float32)))["output_0"].numpy()
    np.testing.assert_allclose(held.outputs["output_0"], want, rtol=1e-5, atol=1e-6)


def test_bad_calibration_data_fails_before_conversion(zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real_convert, real_ingest = lower_mod.convert, lower_mod.ingest
    monkeypatch.setattr(lower_mod, "convert", lambda *a, **k: calls.append("convert") or real_convert(*a, **k))
    monkeypatch.setattr(lower_mod, "ingest", lambda *a, **k: calls.append("ingest") or real_ingest(*a, **k))
    savedmodel = zoo.savedmodel("small_cnn")

    np.savez(tmp_path / "bad.npz", image=np.zeros((10, 28, 28, 3), np.float32))
    with pytest.raises(CalibrationError, match=r"bad\.npz: input 'image' has shape \[10, 28, 28, 3\] \(samples of "
                                               r"\[28, 28, 3\]\); expected N samples of \[32, 32, 3\]"):
        lower_mod.lower(savedmodel, tmp_path / "pkg", calibration=CalibrationOptions(str(tmp_path / "bad.npz")))
    assert calls == ["ingest"]  # the signature was read to check the data; nothing was converted

    with pytest.raises(CalibrationError, match=r"missing\.npz: calibration data not found"):
        lower_mod.lower(savedmodel, tmp_path / "pkg", calibration=CalibrationOptions(str(tmp_path / "missing.npz")))
    assert calls == ["ingest"]  # a missing file fails before the SavedModel is even read
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.npz"]  # no package, no partial directory


def test_cli_int8_flags_without_calibration_are_refused(zoo, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["lower", str(zoo.savedmodel("mlp")), "-o", str(tmp_path / "p"), "--percentile", "99", "--holdout", "0.1"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == ("kubetrt lower: error: --percentile, --holdout need --calibration DATA "
                                               "(the data the INT8 model is calibrated on)")
    with pytest.raises(SystemExit) as exit_info:
        main(["lower", "sm", "-o", "p", "--calibration", "d.npz", "--calibration-method", "kl"])
    assert exit_info.value.code == 2 and "invalid choice: 'kl'" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_cli_flags_reach_lower(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: dict[str, Any] = {}

    def fake_lower(*args: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise ValueError("stopped after parsing")

    monkeypatch.setattr(lower_mod, "lower", fake_lower)
    rc = main(["lower", "sm", "-o", "pkg", "--calibration", "imgs", "--calibration-method", "entropy",
               "--holdout", "0.1", "--keep-float", "first", "Add", "--keep-float", "conv_3", "--preprocess", "torch"])
    assert rc == 2 and "stopped after parsing" in capsys.readouterr().err
    assert seen["calibration"] == CalibrationOptions("imgs", holdout=0.1, method="entropy",
                                                     keep_float=("first", "Add", "conv_3"), preprocess="torch")
    main(["lower", "sm", "-o", "pkg"])
    assert seen["calibration"] is None


def test_lower_stage_with_a_calibration_uri(zoo, tmp_path: Path) -> None:
    data = np.random.default_rng(4).standard_normal((12, 256)).astype(np.float32)
    (tmp_path / "npy").mkdir()
    np.save(tmp_path / "npy" / "features.npy", data)
    package = lower_stage(zoo.savedmodel("mlp"), tmp_path / "pkg", calibration=f"file://{tmp_path / 'npy'}",
                          calibration_method="entropy")
    manifest = open_package(package)
    q = manifest.quantization
    assert (q["method"], q["calibration"]["kind"], q["calibration"]["samples"]) == ("entropy", "npy", 10)
    assert q["calibration"]["source"] == str((tmp_path / "npy").resolve())
    assert manifest.heldout["labels"] is False and load_heldout(package, manifest).labels is None  # type: ignore[union-attr]
    session = ort.InferenceSession(str(package / MODEL_INT8_ONNX), providers=["CPUExecutionProvider"])
    assert session.run(None, {"features": data[:3]})[0].shape == (3, 10)
