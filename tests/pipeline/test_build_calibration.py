"""`kubetrt build --calibration URI` (the EngineBuild Job's command, run through the real CLI main()):
an int8 build of a package without an int8 model, or calibrated with other data, is refused before
any engine work, with the operator's termination-log result; matching or non-int8 builds go on."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kubetrt.cli import main
from kubetrt.operators.names import BUILD_REFUSED_EXIT_CODE
from kubetrt.pipeline import stages
from kubetrt.runtime.package import (HELDOUT, MODEL_INT8_ONNX, MODEL_ONNX, HeldOut, load_golden, read_manifest,
                                     save_heldout, sha256_file, write_manifest)

CALIBRATED_WITH = "/data/resnet/calibration.npz"


@pytest.fixture
def uncalibrated(zoo: Any, tmp_path: Path) -> Path:
    """The zoo's small CNN as `kubetrt lower` writes it without --calibration (no int8 model)."""
    dst = tmp_path / "uncalibrated"
    shutil.copytree(zoo.package("small_cnn"), dst)
    return dst


@pytest.fixture
def calibrated_stand_in(uncalibrated: Path, tmp_path: Path) -> Path:
    """A stand-in for the calibrated package the quantize stage writes: model.int8.onnx (here a copy
    of model.onnx), held-out data (TensorFlow's golden inputs and outputs) and the quantization record
    naming the calibration data, all listed in the manifest with their digests."""
    pkg = tmp_path / "calibrated"
    shutil.copytree(uncalibrated, pkg)
    manifest = read_manifest(pkg)
    shutil.copy(pkg / MODEL_ONNX, pkg / MODEL_INT8_ONNX)
    inputs, outputs = load_golden(pkg, manifest)[max(manifest.golden["batch_sizes"])]
    save_heldout(pkg / HELDOUT, HeldOut(inputs, outputs))
    for name in (MODEL_INT8_ONNX, HELDOUT):
        manifest.files[name] = sha256_file(pkg / name)
    manifest.quantization = {"format": "qdq", "method": "entropy", "file": MODEL_INT8_ONNX,
                             "calibration": {"source": CALIBRATED_WITH, "kind": "npz", "samples": 32,
                                             "heldout_samples": 8, "holdout": 0.2, "seed": 0}}
    manifest.heldout = {"samples": next(iter(inputs.values())).shape[0], "labels": False, "source": CALIBRATED_WITH}
    write_manifest(pkg, manifest)
    return pkg


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Every call of the real build_verify_publish (the engine work) the CLI makes."""
    calls: list[tuple[Any, ...]] = []
    real = stages.build_verify_publish

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(stages, "build_verify_publish", spy)
    return calls


def build(package: Path, target: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    term = tmp_path / "termination-log"
    term.unlink(missing_ok=True)
    rc = main(["build", "--package", str(package), "--target", target, "--store", str(tmp_path / "store"),
               "--termination-log", str(term), *extra])
    return rc, json.loads(term.read_text())


def test_int8_build_of_a_package_without_an_int8_model_is_refused_before_building(
        uncalibrated: Path, tmp_path: Path, builds: list, capsys: pytest.CaptureFixture[str]) -> None:
    rc, result = build(uncalibrated, "host:int8", tmp_path, "--calibration", f"file://{CALIBRATED_WITH}")
    assert rc == BUILD_REFUSED_EXIT_CODE and builds == []
    assert (result["verified"], result["engineKey"]) == (False, "")
    assert "has no INT8 model" in result["report"]["summary"] and "--calibration DATA" in result["report"]["summary"]
    assert "has no INT8 model" in capsys.readouterr().err
    assert not [p for p in (tmp_path / "store").rglob("*") if p.is_file()], "nothing was built or published"


def test_int8_build_of_a_stand_in_calibrated_package_with_other_data_is_refused_naming_both(
        calibrated_stand_in: Path, tmp_path: Path, builds: list) -> None:
    other = "s3://datasets/resnet/other-calibration.npz"
    rc, result = build(calibrated_stand_in, "host:int8", tmp_path, "--calibration", other)
    assert rc == BUILD_REFUSED_EXIT_CODE and builds == []
    summary = result["report"]["summary"]
    assert result["verified"] is False
    assert f"calibrated with {CALIBRATED_WITH}" in summary and f"calibration data {other}" in summary


@pytest.mark.parametrize("calibration", [f"file://{CALIBRATED_WITH}", CALIBRATED_WITH, None],
                         ids=["file-uri", "path", "none"])
def test_int8_build_of_a_stand_in_calibrated_package_with_its_own_data_builds(
        calibrated_stand_in: Path, tmp_path: Path, builds: list, calibration: str | None) -> None:
    extra = ["--calibration", calibration] if calibration else []
    rc, result = build(calibrated_stand_in, "host:int8", tmp_path, *extra)
    assert len(builds) == 1 and builds[0][1].precision == "int8"
    assert rc == 0 and result["verified"] is True and "_int8_" in result["engineKey"], result


def test_non_int8_targets_ignore_the_calibration_flag(uncalibrated: Path, tmp_path: Path, builds: list) -> None:
    rc, result = build(uncalibrated, "host:fp32", tmp_path, "--calibration", "s3://datasets/unrelated.npz")
    assert len(builds) == 1
    assert rc == 0 and result["verified"] is True and "_fp32_" in result["engineKey"]
