"""CRDs: generated YAML in sync with operators/crds.py; schemas accept the examples, reject bad specs."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kubetrt.operators import crds, objects, rbac

from operator_testlib import CALIBRATION_URI, md_body

REPO = Path(__file__).resolve().parents[2]


def validator(crd: dict[str, Any]) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(crds.object_schema(crd))


def test_generated_yaml_matches_the_python_source_of_truth() -> None:
    files = crds.generated_files()
    assert REPO / "manifests/00-crds.yaml" in files and REPO / "manifests/03-rbac.yaml" in files
    stale = [str(p) for p, content in files.items() if not p.exists() or p.read_text() != content]
    assert not stale, f"regenerate with `python -m kubetrt.operators.crds --write`: {stale}"
    assert crds.main(["--check"]) == 0


def test_check_detects_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "00-crds.yaml"
    target.write_text("stale")
    monkeypatch.setattr(crds, "generated_files", lambda: {target: "fresh"})
    monkeypatch.setattr(crds, "REPO_ROOT", tmp_path)
    assert crds.main(["--check"]) == 1
    assert crds.main(["--write"]) == 0 and target.read_text() == "fresh"
    assert crds.main(["--check"]) == 0


def test_chart_crds_are_the_manifest_crds() -> None:
    manifest = list(yaml.safe_load_all((REPO / "manifests/00-crds.yaml").read_text()))
    chart = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "helm/kubetrt/crds").glob("*.yaml"))]
    key = lambda o: o["metadata"]["name"]  # noqa: E731
    assert sorted(manifest, key=key) == sorted(chart, key=key)
    assert {key(o) for o in manifest} == {"modeldeployments.kubetrt.io", "enginebuilds.kubetrt.io",
                                           "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


def test_crd_metadata_status_subresource_printer_columns_short_names() -> None:
    for crd, short in ((crds.model_deployment_crd(), "md"), (crds.engine_build_crd(), "eb")):
        version = crd["spec"]["versions"][0]
        assert crd["spec"]["group"] == "kubetrt.io" and version["name"] == "v1alpha1"
        assert version["subresources"] == {"status": {}}
        assert short in crd["spec"]["names"]["shortNames"]
        assert len(version["additionalPrinterColumns"]) >= 4
    md_spec = crds.model_deployment_spec_schema()
    assert md_spec["required"] == ["model", "store", "targets"]
    target = md_spec["properties"]["targets"]["items"]
    assert sorted(target["properties"]["backend"]["enum"]) == ["cuda", "host", "tensorrt"]  # what the runtime builds
    assert target["properties"]["precision"]["enum"] == ["fp32", "fp16", "int8"]
    assert target["properties"]["replicas"]["minimum"] == 0
    # No single default: unset, GPU targets build fp16 and CPU targets fp32 (objects.resolve_target).
    assert "default" not in md_spec["properties"]["optimization"]["properties"]["precision"]
    eb_status = crds.engine_build_status_schema()
    assert eb_status["properties"]["phase"]["enum"] == ["Pending", "Running", "Succeeded", "Failed"]


@pytest.mark.parametrize("path", sorted((REPO / "manifests/examples").glob("modeldeployment-*.yaml")), ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path: Path) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs
    for doc in docs:
        assert doc["kind"] == "ModelDeployment"
        validator(crds.model_deployment_crd()).validate(doc)
        assert objects.validate_spec(objects.normalized_spec(doc)) == [], "the CEL rules (as the operator checks them)"


def test_examples_cover_cpu_only_and_two_gpu_products() -> None:
    docs = [d for p in (REPO / "manifests/examples").glob("modeldeployment-*.yaml") for d in yaml.safe_load_all(p.read_text())]
    products = {t.get("gpuProduct") for d in docs for t in d["spec"]["targets"]}
    assert {"NVIDIA-H100-80GB-HBM3", "Tesla-T4"} <= products
    assert any(all(t.get("cpu") for t in d["spec"]["targets"]) for d in docs)


def _set(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    cur: Any = out
    parts = path.split(".")
    for part in parts[:-1]:
        cur = cur[int(part)] if part.isdigit() else cur[part]
    last = parts[-1]
    if value is _DELETE:
        del cur[last]
    elif last.isdigit():
        cur[int(last)] = value
    else:
        cur[last] = value
    return out


_DELETE = object()
# Schema constraints jsonschema can check. The CRDs' CEL rules (a target's kind and backend, int8
# calibration, batch profile order, ...) are evaluated only by a real API server:
# tests/cluster/test_validation.py has one case per rule.
INVALID = {
    "no targets": ("spec.targets", []),
    "missing store": ("spec.store", _DELETE),
    "missing model source": ("spec.model.source", _DELETE),
    "bad precision": ("spec.targets.0.precision", "fp8"),
    "bad backend": ("spec.targets.0.backend", "openvino"),
    "negative replicas": ("spec.targets.0.replicas", -1),
    "bad uri scheme": ("spec.model.source.uri", "http://example.com/model"),
    "gs:// package (the engine store reads s3://, file:// and pvc:// only)": ("spec.model.source.uri", "gs://bucket/model"),
    "gs:// engine store": ("spec.store.uri", "gs://bucket/engines"),
    "bad target name": ("spec.targets.0.name", "H100_GPU"),
    "zero max batch": ("spec.batching", {"maxBatchSize": 0}),
    "utilization over 100": ("spec.autoscaling", {"enabled": True, "targetCPUUtilizationPercentage": 150}),
    "bad quantity": ("spec.targets.0.resources", {"requests": {"cpu": "two"}}),
}


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_spec_is_rejected_by_the_crd_schema(name: str) -> None:
    path, value = INVALID[name]
    bad = _set(md_body(), path, value)
    v = validator(crds.model_deployment_crd())
    assert v.is_valid(md_body())
    assert not v.is_valid(bad), f"{name} should be rejected"


def test_calibration_data_may_be_named_by_a_gs_uri() -> None:
    """Compared with the package's record, never read: the pipeline may have read it from GCS."""
    v = validator(crds.model_deployment_crd())
    assert v.is_valid(_set(md_body(), "spec.optimization", {"calibration": {"uri": "gs://datasets/calibration"}}))


def test_apply_defaults_matches_api_server_defaulting() -> None:
    spec = crds.apply_defaults(crds.model_deployment_spec_schema(), md_body()["spec"])
    assert spec["optimization"] == {"maxBatchSize": 32,
                                    "batchProfile": {"min": 1, "opt": 8, "max": 32},
                                    "calibration": {"uri": CALIBRATION_URI, "method": "minmax",
                                                    "holdoutFraction": 0.2}}
    assert spec["model"]["signature"] == "serving_default" and spec["model"]["version"] == "3"
    assert spec["targets"][1]["replicas"] == 1 and spec["targets"][0]["replicas"] == 2
    assert spec["autoscaling"]["enabled"] is False
    assert spec["rollout"] == {"maxSurge": "25%", "maxUnavailable": 0}
    assert spec["batching"]["maxQueueDelayMicroseconds"] == 0


def test_rbac_rules_are_unique_and_named() -> None:
    keys = [(g, r) for g, r, _, _ in rbac.RULES]
    assert len(keys) == len(set(keys))
    assert rbac.allows("batch", "jobs", "create") and not rbac.allows("batch", "jobs", "delete")
    assert not rbac.allows("", "secrets", "get")
