"""INT8 through the pipeline: `kubetrt pipeline run --calibration DATA` (in-process and kfp.local)
lowers with calibration, builds int8 engines from model.int8.onnx, judges them on the held-out
samples and deploys a ModelDeployment carrying the calibration block; int8 without calibration
data is refused before anything is fetched or lowered; the model digest follows the calibration.

The zoo's small_cnn has random weights and the calibration data is random too; its int8 engine
still agrees with TensorFlow's top-1 on every held-out sample, so the real gate applies unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import yaml

from kubetrt.cli import main
from kubetrt.pipeline.calibration import CalibrationError
from kubetrt.pipeline.store import LocalStore, model_digest
from kubetrt.runtime.package import MODEL_INT8_ONNX, MODEL_ONNX, open_package, read_manifest

SAMPLES = 80  # 64 to calibrate on, 16 held out (holdout 0.2)
INT8 = "host:int8:1/8/32"


def _validate(resource: dict[str, Any]) -> None:
    """The CRD's schema, and the rules the operator checks itself (the CEL rule among them)."""
    from kubetrt.operators import objects
    from kubetrt.operators.crds import model_deployment_spec_schema

    assert resource["apiVersion"] == "kubetrt.io/v1alpha1" and resource["kind"] == "ModelDeployment"
    jsonschema.validate(resource["spec"], model_deployment_spec_schema())
    assert objects.validate_spec(objects.normalized_spec(resource)) == []


def _random_images(path: Path, seed: int) -> Path:
    """Calibration data for small_cnn: an .npz with its one input, random images of its shape."""
    rng = np.random.default_rng(seed)
    np.savez(path, image=rng.standard_normal((SAMPLES, 32, 32, 3)).astype(np.float32))
    return path


@pytest.fixture(scope="module")
def calibration(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("calibration")
    return {"a": _random_images(root / "a.npz", 1), "b": _random_images(root / "b.npz", 2)}


@pytest.fixture(scope="module")
def in_process(model_zoo, calibration: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """`kubetrt pipeline run --no-kfp` with an int8 and an fp32 host target, calibrated on data a."""
    tmp = tmp_path_factory.mktemp("int8-pipeline")
    out = tmp / "md.yaml"
    args = ["pipeline", "run", str(model_zoo.savedmodel("small_cnn")), "--store", str(tmp / "store"),
            "--target", INT8, "--target", "host", "--calibration", str(calibration["a"]), "--no-kfp",
            "--name", "small_cnn", "-o", str(out)]
    assert main(args) == 0
    resource = yaml.safe_load(out.read_text())
    return {"store": tmp / "store", "resource": resource,
            "digest": resource["metadata"]["annotations"]["kubetrt.io/model-digest"]}


def test_in_process_pipeline_publishes_verified_int8_and_fp32_engines(in_process: dict[str, Any],
                                                                      calibration: dict[str, Path]) -> None:
    resource, digest = in_process["resource"], in_process["digest"]
    _validate(resource)
    assert resource["spec"]["optimization"]["calibration"] == {
        "uri": f"file://{calibration['a']}", "method": "minmax", "holdoutFraction": 0.2}
    assert [(t["name"], t["precision"]) for t in resource["spec"]["targets"]] == [("cpu", "int8"), ("cpu-fp32", "fp32")]
    keys = json.loads(resource["metadata"]["annotations"]["kubetrt.io/verified-engines"])
    store = LocalStore(in_process["store"])
    assert store.list_engines(digest) == sorted(keys.values())

    int8 = store.read_report(digest, keys["cpu"])
    assert int8 is not None and int8["passed"] and int8["spec"] == INT8
    assert int8["build"]["model"]["file"] == MODEL_INT8_ONNX
    assert int8["heldout"]["passed"] and int8["heldout"]["samples"] == SAMPLES // 5
    assert int8["golden_gating"] is False and int8["summary"].startswith("passed: held-out (16 samples)")
    fp32 = store.read_report(digest, keys["cpu-fp32"])
    assert fp32 is not None and fp32["passed"] and fp32["build"]["model"]["file"] == MODEL_ONNX

    package = Path(store.package_uri(digest))
    manifest = open_package(package)
    assert model_digest(manifest) == digest
    assert manifest.quantization["calibration"]["source"] == str(calibration["a"])
    assert manifest.heldout["samples"] == SAMPLES // 5


def test_model_digest_follows_calibration_data_and_method(in_process: dict[str, Any], calibration: dict[str, Path],
                                                          zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Same SavedModel, other calibration data or method: another address; uncalibrated: its own;
    the same data and method again: the same address (so stored engines are reused)."""
    from kubetrt.pipeline.calibration import CalibrationOptions
    from kubetrt.pipeline.lower import lower

    savedmodel = zoo.savedmodel("small_cnn")
    again = lower(savedmodel, tmp_path / "again", name="small_cnn", calibration=CalibrationOptions(str(calibration["a"])))
    assert model_digest(again) == in_process["digest"]
    other_data = lower(savedmodel, tmp_path / "b", name="small_cnn", calibration=CalibrationOptions(str(calibration["b"])))
    other_method = lower(savedmodel, tmp_path / "percentile", name="small_cnn",
                         calibration=CalibrationOptions(str(calibration["a"]), method="percentile"))
    fp32 = read_manifest(zoo.package("small_cnn"))
    digests = [in_process["digest"], model_digest(other_data), model_digest(other_method), model_digest(fp32)]
    assert len(set(digests)) == 4, digests
    assert other_data.source["digest"] == other_method.source["digest"] == fp32.source["digest"]


@pytest.mark.parametrize("kfp", [False, True], ids=["in-process", "kfp"])
def test_int8_without_calibration_fails_before_lowering(model_zoo, kfp: bool, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    store, root = tmp_path / "store", tmp_path / "root"
    args = ["pipeline", "run", str(model_zoo.savedmodel("small_cnn")), "--store", str(store), "--target", INT8,
            "--target", "host", "--pipeline-root", str(root), *([] if kfp else ["--no-kfp"])]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"target(s) {INT8} build int8 engines" in err and "give --calibration DATA (an .npz with one array per " \
        "model input" in err, err
    assert not store.exists() and not root.exists()  # nothing lowered, published, or started


def test_stage_functions_refuse_int8_without_calibration(model_zoo, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from kubetrt.pipeline.kfp_pipeline import run_local
    from kubetrt.pipeline.stages import run_pipeline

    source = str(model_zoo.savedmodel("small_cnn"))
    with pytest.raises(CalibrationError, match="need calibration data: give --calibration DATA"):
        run_pipeline(source, str(tmp_path / "store"), [INT8], tmp_path / "work")
    with pytest.raises(CalibrationError, match="need calibration data: give --calibration DATA"):
        run_local(source, str(tmp_path / "store"), ["host", INT8], tmp_path / "root")
    assert not (tmp_path / "store").exists() and not (tmp_path / "work").exists() and not (tmp_path / "root").exists()


@pytest.mark.parametrize("extra, message", [
    (["--calibration-method", "entropy"], "--calibration-method need --calibration DATA"),
    (["--calibration-preprocess", "unit"], "--calibration-preprocess need --calibration DATA"),
    (["--calibration", "/no/such/calibration.npz"], "/no/such/calibration.npz: calibration data not found"),
    (["--calibration", "CAL", "--calibration-preprocess", "bogus"], "preprocessing 'bogus': expected one of"),
])
@pytest.mark.parametrize("kfp", [False, True], ids=["in-process", "kfp"])
def test_bad_calibration_requests_fail_before_ingest(extra: list[str], message: str, kfp: bool,
                                                     calibration: dict[str, Path], tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The SavedModel does not exist: had ingest run first, that would be the error."""
    extra = [str(calibration["a"]) if a == "CAL" else a for a in extra]
    args = ["pipeline", "run", "/no/such/model", "--store", str(tmp_path / "store"), "--target", "host",
            "--pipeline-root", str(tmp_path / "root"), *extra, *([] if kfp else ["--no-kfp"])]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "model not found" not in err, err


def test_kfp_local_run_deploys_the_calibrated_int8_engine(model_zoo, in_process: dict[str, Any],  # type: ignore[no-untyped-def]
                                                         calibration: dict[str, Path], tmp_path: Path) -> None:
    from kubetrt.pipeline.kfp_pipeline import run_local

    store_root = tmp_path / "store"
    text = run_local(str(model_zoo.savedmodel("small_cnn")), str(store_root), [INT8], tmp_path / "root",
                     name="small_cnn", calibration=str(calibration["a"]))
    resource = yaml.safe_load(text)
    _validate(resource)
    assert resource["spec"]["optimization"]["calibration"]["uri"] == f"file://{calibration['a']}"
    digest = resource["metadata"]["annotations"]["kubetrt.io/model-digest"]
    assert digest == in_process["digest"]  # same model, same data: the same address as the in-process run
    keys = json.loads(resource["metadata"]["annotations"]["kubetrt.io/verified-engines"])
    assert list(keys) == ["cpu"] and keys["cpu"].endswith("_int8_b1-8-32")
    report = LocalStore(store_root).read_report(digest, keys["cpu"])
    assert report is not None and report["passed"] and report["heldout"]["passed"]
    engine = json.loads((store_root / digest / keys["cpu"] / "engine.json").read_text())
    manifest = read_manifest(store_root / digest / "package")
    assert engine["model"] == {"name": "small_cnn", "version": "1", "file": MODEL_INT8_ONNX,
                               "onnx": manifest.files[MODEL_INT8_ONNX]}
