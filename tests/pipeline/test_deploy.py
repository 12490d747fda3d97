"""The ModelDeployment the pipeline writes: int8 engines carry the package's calibration record, so
the resource passes the CRD (schema and CEL rule) and the operator's build Job checks the same data."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kubetrt.cli.commands.build import check_calibration
from kubetrt.operators import crds, objects, reconcile
from kubetrt.operators.reconcile import Observed
from kubetrt.pipeline.deploy import calibration_spec, model_deployment
from kubetrt.runtime.package import MODEL_INT8_ONNX, MODEL_ONNX, Manifest, TensorSpec
from kubetrt.runtime.target import parse_target

REPO = Path(__file__).resolve().parents[2]
DIGEST = "sha256:" + "1" * 64


def record(spec: str) -> dict[str, Any]:
    target = parse_target(spec)
    return {"key": f"key-{target.backend}-{target.precision}", "spec": spec, "gpu_product": target.gpu_product,
            "backend": target.backend, "precision": target.precision, "model_digest": DIGEST,
            "uri": f"file:///srv/store/{DIGEST[7:]}/key"}


def quantization(source: str = "/data/calibration.npz", method: str = "entropy", **extra: Any) -> dict[str, Any]:
    """A manifest's quantization record, as `kubetrt lower --calibration` writes it."""
    return {"format": "qdq", "method": method, **extra, "file": MODEL_INT8_ONNX,
            "calibration": {"source": source, "kind": "npz", "digest": "sha256:" + "2" * 64, "samples": 32,
                            "heldout_samples": 8, "holdout": 0.2, "seed": 0}}


def crd_validator() -> jsonschema.Draft7Validator:
    crd = yaml.safe_load((REPO / "helm/kubetrt/crds/modeldeployments.kubetrt.io.yaml").read_text())
    return jsonschema.Draft7Validator(crds.object_schema(crd))


def test_int8_deployment_carries_the_calibration_and_passes_the_crd() -> None:
    md = model_deployment("resnet", "1", "/srv/store/pkg", [record("tensorrt@Tesla-T4:int8:1/8/32"),
                                                            record("host:fp32:1/8/32")],
                          quantization=quantization())
    assert md["spec"]["optimization"]["calibration"] == {"uri": "file:///data/calibration.npz", "method": "entropy",
                                                         "holdoutFraction": 0.2}
    crd_validator().validate(md)
    assert objects.validate_spec(objects.normalized_spec(md)) == []


def test_percentile_and_holdout_fraction_are_copied_when_recorded() -> None:
    q = quantization("s3://datasets/calib/", method="percentile", percentile=99.99)
    q["calibration"]["holdout"] = 0.25
    assert calibration_spec(q) == {"uri": "s3://datasets/calib/", "method": "percentile", "percentile": 99.99,
                                   "holdoutFraction": 0.25}
    # A percentile recorded beside another method is not the CRD's to carry (its CEL rule refuses it).
    assert "percentile" not in (calibration_spec(quantization(method="minmax", percentile=99.0)) or {})
    assert calibration_spec({}) is None


def test_int8_engines_without_a_calibration_record_are_refused() -> None:
    with pytest.raises(ValueError, match="int8 engines to deploy, but no calibration record"):
        model_deployment("resnet", "1", "/srv/store/pkg", [record("tensorrt@Tesla-T4:int8:1/8/32")])
    fp16 = model_deployment("resnet", "1", "/srv/store/pkg", [record("tensorrt@Tesla-T4:fp16:1/8/32")])
    assert "calibration" not in fp16["spec"]["optimization"]


def test_the_build_job_for_a_deployed_int8_target_accepts_the_package_it_names() -> None:
    """deploy -> operator -> `kubetrt build --calibration`: the URI the build Job gets is the one the
    package records, even when lowering recorded a plain path."""
    q = quantization("/data/calibration.npz")
    md = model_deployment("resnet", "1", "/srv/store/pkg", [record("tensorrt@Tesla-T4:int8:1/8/32")],
                          quantization=q, namespace="models")
    md["metadata"].update(uid="uid-resnet", generation=1)
    (eb,) = reconcile.plan_model_deployment(md, Observed(), objects.OperatorConfig(), "2026-01-01T00:00:00Z").create
    command = objects.build_job(eb, objects.OperatorConfig())["spec"]["template"]["spec"]["containers"][0]["command"]
    uri = command[command.index("--calibration") + 1]
    assert uri == "file:///data/calibration.npz"
    manifest = Manifest("resnet", "1", "serving_default", [TensorSpec("x", "float32", (-1, 4))],
                        [TensorSpec("y", "float32", (-1, 2))],
                        files={MODEL_ONNX: DIGEST, MODEL_INT8_ONNX: DIGEST}, quantization=q)
    target = parse_target(command[command.index("--target") + 1])
    check_calibration(manifest, target, uri)  # the package's own data: accepted
    with pytest.raises(ValueError, match="calibrated with /data/calibration.npz"):
        check_calibration(manifest, target, "file:///data/other.npz")
