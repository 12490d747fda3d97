"""Lower: SavedModel -> model package, checked independently of the code that wrote it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from model_zoo import MODELS

from kubetrt.pipeline import lower as lower_mod
from kubetrt.pipeline.errors import LowerError
from kubetrt.pipeline.ingest import ingest, tensorflow
from kubetrt.pipeline.lower import check_faithful, lower, random_inputs, rename_io
from kubetrt.runtime.accuracy import tolerance_for
from kubetrt.runtime.package import (
    GOLDEN,
    MODEL_ONNX,
    TensorSpec,
    load_golden,
    open_package,
    sha256_file,
)

REPO = Path(__file__).resolve().parents[1]
FAST_MODELS = [name for name, spec in MODELS.items() if not spec.slow]


def _no_leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.endswith(".partial") or ".tmp" in p.name)


@pytest.fixture(scope="module")
def dynamic_savedmodel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """serving_default: x f32[-1,-1,4] (dynamic sequence dim); static_batch: x f32[2,4]."""
    tf = tensorflow()

    class Dyn(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None, 4], tf.float32)])
        def seq(self, x):  # type: ignore[no-untyped-def]
            return {"pooled": tf.reduce_mean(x, axis=1) * 3.0}

        @tf.function(input_signature=[tf.TensorSpec([2, 4], tf.float32)])
        def static(self, x):  # type: ignore[no-untyped-def]
            return {"y": x + 1.0}

    path = tmp_path_factory.mktemp("dyn") / "seq_model"
    module = Dyn()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.seq, "static_batch": module.static})
    return path


# --------------------------------------------------------------------------- zoo packages


@pytest.mark.parametrize("name", FAST_MODELS)
def test_package_is_valid_and_reproduces_tensorflow(zoo, name: str) -> None:
    savedmodel, package = zoo.savedmodel(name), zoo.package(name)
    info = ingest(savedmodel)
    manifest = open_package(package)  # digest-checks every listed file

    assert (manifest.name, manifest.version, manifest.signature) == (name, "1", "serving_default")
    assert manifest.inputs == info.inputs and manifest.outputs == info.outputs
    assert set(manifest.files) == {MODEL_ONNX, GOLDEN}
    for rel, digest in manifest.files.items():
        assert sha256_file(package / rel) == digest
    assert manifest.source["uri"] == savedmodel.resolve().as_uri()
    assert manifest.source["digest"] == info.digest
    assert {"tensorflow", "tf2onnx", "onnx", "kubetrt", "created"} <= set(manifest.provenance)
    assert manifest.provenance["created"].endswith("+00:00")
    assert manifest.golden["batch_sizes"] == [1, 4] and manifest.golden["seed"] == 0
    assert manifest.onnx["opset"] == 17

    model = onnx.load(str(package / MODEL_ONNX))
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == [t.name for t in manifest.inputs]
    assert [o.name for o in model.graph.output] == [t.name for t in manifest.outputs]
    assert {(op.domain or "ai.onnx"): op.version for op in model.opset_import}["ai.onnx"] == 17
    assert all(i.type.tensor_type.shape.dim[0].dim_param == "batch" for i in model.graph.input)

    golden = load_golden(package, manifest)
    assert sorted(golden) == [1, 4]
    session = ort.InferenceSession(str(package / MODEL_ONNX), providers=["CPUExecutionProvider"])
    fn = tensorflow().saved_model.load(str(savedmodel)).signatures["serving_default"]
    for batch, (inputs, outputs) in golden.items():
        _assert_fits(inputs, manifest.inputs, batch)
        _assert_fits(outputs, manifest.outputs, batch)
        # the golden outputs are TensorFlow's own ...
        tf_out = fn(**inputs)
        for key, want in outputs.items():
            np.testing.assert_allclose(tf_out[key].numpy(), want, rtol=1e-6, atol=1e-6)
        # ... and onnxruntime reproduces them from model.onnx
        got = dict(zip(outputs, session.run(list(outputs), inputs)))
        for key, want in outputs.items():
            np.testing.assert_allclose(got[key], want, rtol=1e-4, atol=1e-4, err_msg=f"{name} batch{batch}.{key}")


def _assert_fits(arrays: dict[str, np.ndarray], specs: list[TensorSpec], batch: int) -> None:
    assert sorted(arrays) == sorted(t.name for t in specs)
    for spec in specs:
        a = arrays[spec.name]
        assert str(a.dtype) == spec.dtype
        assert a.shape[0] == batch and len(a.shape) == len(spec.shape)
        assert all(d in (-1, g) for d, g in zip(spec.shape, a.shape))


def test_integer_golden_inputs_are_small_ids(zoo) -> None:
    package = zoo.package("two_in_two_out")
    _, (inputs, _) = sorted(load_golden(package).items())[-1]
    assert inputs["ids"].dtype == np.int32 and inputs["ids"].min() >= 0 and inputs["ids"].max() < 10
    assert len(np.unique(inputs["ids"])) > 1  # really random, not constant


# --------------------------------------------------------------------------- lower() itself


def test_lower_dynamic_dims_need_a_shape_override(dynamic_savedmodel: Path, tmp_path: Path) -> None:
    with pytest.raises(LowerError, match=r"input 'x' \(shape \[-1, -1, 4\]\): dims \[1\] are dynamic.*--shape x=-1,8,4"):
        lower(dynamic_savedmodel, tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists()

    manifest = lower(dynamic_savedmodel, tmp_path / "pkg", shapes={"x": (-1, 5, 4)}, seed=3, version="2")
    assert manifest.name == "seq_model" and manifest.version == "2"
    assert manifest.inputs == [TensorSpec("x", "float32", (-1, -1, 4))]  # the graph stays dynamic
    assert manifest.golden["shapes"] == {"x": [-1, 5, 4]} and manifest.golden["seed"] == 3
    golden = load_golden(tmp_path / "pkg")
    assert golden[4][0]["x"].shape == (4, 5, 4) and golden[4][1]["pooled"].shape == (4, 4)
    # the lowered graph accepts other sequence lengths too
    session = ort.InferenceSession(str(tmp_path / "pkg" / MODEL_ONNX), providers=["CPUExecutionProvider"])
    x = np.ones((2, 9, 4), np.float32)
    np.testing.assert_allclose(session.run(["pooled"], {"x": x})[0], np.full((2, 4), 3.0), rtol=1e-6)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({"y": (-1, 5, 4)}, r"shape override for unknown input\(s\) y; signature 'serving_default' inputs are: x"),
        ({"x": (-1, 5)}, r"shape override \[-1, 5\] does not fit; expected 3 dims"),
        ({"x": (1, 5, 4)}, r"shape override \[1, 5, 4\] does not fit; expected 3 dims, -1 for the batch dim"),
        ({"x": (-1, 5, 3)}, r"shape override \[-1, 5, 3\] has 3 at dim 2"),
        ({"x": (-1, 0, 4)}, r"shape override \[-1, 0, 4\] has 0 at dim 1"),
    ],
)
def test_bad_shape_overrides(dynamic_savedmodel: Path, tmp_path: Path, shapes, message: str) -> None:
    with pytest.raises(LowerError, match=message):
        lower(dynamic_savedmodel, tmp_path / "pkg", shapes=shapes)
    assert not (tmp_path / "pkg").exists()


def test_static_batch_dim_refused(dynamic_savedmodel: Path, tmp_path: Path) -> None:
    with pytest.raises(LowerError, match=r"input 'x' \(shape \[2, 4\]\): expected a dynamic leading batch dim"):
        lower(dynamic_savedmodel, tmp_path / "pkg", signature="static_batch")


def test_existing_output_directory_refused(zoo, tmp_path: Path) -> None:
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(LowerError, match=rf"{out}: already exists; refusing to overwrite"):
        lower(zoo.savedmodel("mlp"), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert _no_leftovers(tmp_path) == []


@pytest.mark.parametrize("interrupt", [RuntimeError("conversion blew up"), KeyboardInterrupt()])
def test_interrupted_lowering_leaves_nothing(zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             interrupt: BaseException) -> None:
    out = tmp_path / "pkg"
    seen: list[str] = []

    def convert_then_die(*args: object, **kwargs: object) -> None:
        # midway: the staged directory exists and already holds the golden file
        seen.extend(str(p.relative_to(tmp_path)) for p in tmp_path.glob(".pkg.*.partial/*"))
        raise interrupt

    monkeypatch.setattr(lower_mod, "convert", convert_then_die)
    with pytest.raises(type(interrupt)):
        lower(zoo.savedmodel("mlp"), out)
    assert len(seen) == 1 and seen[0].endswith("/golden.npz")
    assert not out.exists()
    assert _no_leftovers(tmp_path) == []


def test_unfaithful_conversion_fails_lowering(zoo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    record = lower_mod.record_golden

    def skewed(*args, **kwargs):  # type: ignore[no-untyped-def]
        batches = record(*args, **kwargs)
        for _, outputs in batches.values():
            outputs["output_0"] += 1e-3  # as if ONNX computed something slightly different
        return batches

    monkeypatch.setattr(lower_mod, "record_golden", skewed)
    with pytest.raises(LowerError, match=r"onnxruntime output batch1\.output_0 differs from TensorFlow: .*max abs error 0\.001"):
        lower(zoo.savedmodel("mlp"), tmp_path / "pkg")
    assert not (tmp_path / "pkg").exists() and _no_leftovers(tmp_path) == []


@pytest.mark.parametrize("kwargs", [{"name": "bad name"}, {"name": ""}, {"version": "v/1"}])
def test_bad_name_or_version(zoo, tmp_path: Path, kwargs: dict[str, str]) -> None:
    with pytest.raises(LowerError, match=r"expected 1-128 letters, digits"):
        lower(zoo.savedmodel("mlp"), tmp_path / "pkg", **kwargs)


@pytest.mark.parametrize("opset", [12, 99])
def test_unsupported_opset_refused(zoo, tmp_path: Path, opset: int) -> None:
    with pytest.raises(LowerError, match=rf"ONNX opset {opset} is not supported; expected 13\.\.\d+"):
        lower(zoo.savedmodel("mlp"), tmp_path / "pkg", opset=opset)
    assert not (tmp_path / "pkg").exists()


def test_default_name_of_tf_serving_layout(tmp_path: Path) -> None:
    assert lower_mod.default_name(tmp_path / "resnet" / "3") == "resnet"
    assert lower_mod.default_name(tmp_path / "resnet") == "resnet"


# --------------------------------------------------------------------------- zoo guard


def test_zoo_refuses_slow_models_in_unmarked_tests(zoo) -> None:
    with pytest.raises(pytest.UsageError, match=r"zoo model 'resnet50' takes tens of seconds.*mark the test @pytest.mark.slow"):
        zoo.package("resnet50")
    with pytest.raises(KeyError, match=r"no zoo model 'vgg'; available: mlp, small_cnn"):
        zoo.savedmodel("vgg")


# --------------------------------------------------------------------------- helpers


def test_random_inputs_by_dtype() -> None:
    specs = [TensorSpec("f", "float16", (-1, 3)), TensorSpec("i", "int64", (-1,)), TensorSpec("u", "uint8", (-1, 2)),
             TensorSpec("b", "bool", (-1, 50))]
    tails = {"f": (3,), "i": (), "u": (2,), "b": (50,)}
    a = random_inputs(specs, tails, 4, np.random.default_rng(0))
    b = random_inputs(specs, tails, 4, np.random.default_rng(0))
    assert {k: (v.dtype.name, v.shape) for k, v in a.items()} == {
        "f": ("float16", (4, 3)), "i": ("int64", (4,)), "u": ("uint8", (4, 2)), "b": ("bool", (4, 50))}
    assert all(np.array_equal(a[k], b[k]) for k in a)  # seeded
    assert 0 <= a["i"].min() and a["i"].max() < 10
    assert a["b"].any() and not a["b"].all()


def test_check_faithful_tolerance_and_exactness() -> None:
    tol = tolerance_for("fp32", "host")
    want = np.array([1.0, 100.0], np.float32)
    assert check_faithful("t", want + np.float32(5e-5), want, tol) == pytest.approx(5e-5, rel=0.1)
    with pytest.raises(LowerError, match=r"t differs from TensorFlow: .*max abs error 0\.001.*not faithful"):
        check_faithful("t", want + np.float32(1e-3), want, tol)
    with pytest.raises(LowerError, match=r"is float64\[2\]; TensorFlow gave float32\[2\]"):
        check_faithful("t", want.astype(np.float64), want, tol)
    with pytest.raises(LowerError, match=r"1 of 2 elements differ \(exact match expected for int32\)"):
        check_faithful("t", np.array([1, 3], np.int32), np.array([1, 2], np.int32), tol)


def test_rename_io_moves_a_clashing_internal_name_aside() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x:0"], ["x"]), helper.make_node("Neg", ["x"], ["Identity:0"])],
        "g",
        [helper.make_tensor_value_info("x:0", TensorProto.FLOAT, [None, 2])],
        [helper.make_tensor_value_info("Identity:0", TensorProto.FLOAT, [None, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    rename_io(model, {"x:0": "x", "Identity:0": "y"}, ["x"], ["y"])
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["x"] and [o.name for o in model.graph.output] == ["y"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([[-1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(session.run(["y"], {"x": x})[0], [[-0.0, -2.0]])


def test_rename_io_refuses_unmappable_names() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["a"], ["b"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    with pytest.raises(LowerError, match=r"cannot map them onto the signature's inputs \['x'\]"):
        rename_io(helper.make_model(graph), {}, ["x"], ["y"])


# --------------------------------------------------------------------------- captured constants, coverage


@pytest.fixture(scope="module")
def det_savedmodel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A determinant (ONNX Det: no kubetrt kernel) between ops kubetrt has, and a captured constant."""
    tf = tensorflow()
    offset = tf.constant(np.eye(3, dtype=np.float32) * 2.0)  # captured, not a variable

    class Det(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 3, 3], tf.float32)])
        def serve(self, x):  # type: ignore[no-untyped-def]
            det = tf.linalg.det(tf.nn.relu(x) + offset)
            return {"det": tf.tanh(det * 0.1), "total": tf.reduce_sum(x, axis=[1, 2])}

    path = tmp_path_factory.mktemp("det") / "det_model"
    module = Det()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return path


def test_captured_constants_are_frozen(tmp_path: Path) -> None:
    """A tensor the function captures (not a variable: EfficientNet's normalization statistics,
    ConvNeXt's layer scales) becomes a constant, not an extra graph input."""
    tf = tensorflow()
    scale = tf.constant(np.linspace(0.5, 1.5, 4, dtype=np.float32))

    class Scaled(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
        def serve(self, x):  # type: ignore[no-untyped-def]
            return {"y": x * scale + 1.0}

    module = Scaled()
    tf.saved_model.save(module, str(tmp_path / "sm"), signatures={"serving_default": module.serve})
    lower(tmp_path / "sm", tmp_path / "pkg")
    model = onnx.load(str(tmp_path / "pkg" / MODEL_ONNX))
    assert [i.name for i in model.graph.input] == ["x"]


def test_op_without_kernel_fails_lowering_naming_model_node_and_op(det_savedmodel: Path, tmp_path: Path) -> None:
    with pytest.raises(LowerError, match=r"model det-model: .*no kernel on host.*\(Det\).*--allow-fallback onnxruntime"):
        lower(det_savedmodel, tmp_path / "pkg", name="det-model")
    assert not (tmp_path / "pkg").exists()


def test_allowed_fallback_records_coverage_and_runs_in_onnxruntime(det_savedmodel: Path, tmp_path: Path) -> None:
    from kubetrt.runtime import load_model
    from kubetrt.runtime.accuracy import HOST, compare

    manifest = lower(det_savedmodel, tmp_path / "pkg", name="det-model", allow_fallback=("onnxruntime",))
    host = manifest.onnx["coverage"]["host"]
    assert [seg["ops"] for seg in host["fallback_segments"]] == [["Det"]]
    assert host["ops"]["onnxruntime"] == {"Det": 1} and host["missing"] == []
    model = load_model(tmp_path / "pkg")
    for batch, (inputs, expected) in load_golden(tmp_path / "pkg", manifest).items():
        result = compare(model.predict(inputs), expected, tolerance_for("fp32", HOST))
        assert result.passed, f"batch {batch}: {result.reason()}"


def test_unknown_fallback_runtime_refused(det_savedmodel: Path, tmp_path: Path) -> None:
    with pytest.raises(LowerError, match=r"fallback runtime\(s\) \['tensorflow'\]: expected any of \['onnxruntime'\]"):
        lower(det_savedmodel, tmp_path / "pkg", allow_fallback=("tensorflow",))


# --------------------------------------------------------------------------- CLI


def _kubetrt(*args: str, progress: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBETRT_PROGRESS": "1" if progress else "0"}
    return subprocess.run([sys.executable, "-m", "kubetrt.cli", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def test_cli_lower_end_to_end(zoo, tmp_path: Path) -> None:
    out = tmp_path / "mlp-pkg"
    proc = _kubetrt("lower", str(zoo.savedmodel("mlp")), "-o", str(out), "--name", "mlp-cli",
                    "--version", "3", "--seed", "7", "--opset", "17", progress=True)
    assert proc.returncode == 0, proc.stderr
    assert f"lowered mlp-cli v3 -> {out}" in proc.stdout
    assert "features:float32[-1, 256]" in proc.stdout
    assert "[kubetrt] converting to ONNX (opset 17) done" in proc.stderr  # progress shown
    assert "oneDNN" not in proc.stderr and "I0000" not in proc.stderr  # TF start-up spam silenced
    assert "kernel coverage, host:" in proc.stdout and "no fallback: every node runs on host" in proc.stdout
    assert "kernel coverage, cuda:" in proc.stdout
    manifest = open_package(out)
    assert (manifest.name, manifest.version, manifest.golden["seed"]) == ("mlp-cli", "3", 7)
    assert sorted(load_golden(out, manifest)) == [1, 4]


def test_cli_lower_errors_are_one_line(zoo, tmp_path: Path) -> None:
    proc = _kubetrt("lower", str(tmp_path / "missing"), "-o", str(tmp_path / "pkg"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kubetrt lower: error: {tmp_path / 'missing'}: SavedModel directory does not exist"
    proc = _kubetrt("lower", str(zoo.savedmodel("mlp")), "-o", str(tmp_path), "--shape", "features")
    assert proc.returncode == 2 and "expected NAME=D0,D1,..." in proc.stderr
