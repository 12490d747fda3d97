"""Install artifacts: helm lint/template with a real helm binary, kubernetes-validate --strict, values schema."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kubetrt.operators import crds, rbac

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kubetrt"
K8S_VERSION = "1.31.0"


@pytest.fixture(scope="module")
def helm() -> str:
    path = os.environ.get("KUBETRT_HELM") or str(REPO / ".cache" / "bin" / "helm")
    if not os.access(path, os.X_OK):
        pytest.fail(f"helm not found at {path}: run scripts/get-helm.sh (or set KUBETRT_HELM)")
    return path


def run(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=60)


def builtin(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d and d["apiVersion"].split("/")[0] not in ("kubetrt.io", "kopf.dev",
                                                                             "monitoring.coreos.com")]


def test_helm_lint_passes(helm: str) -> None:
    res = run(helm, "lint", str(CHART), "--strict")
    assert res.returncode == 0, res.stdout + res.stderr


def test_values_schema_violation_fails_lint(helm: str) -> None:
    for bad in ("replicaCount=0", "image.pullPolicy=Sometimes", "operator.logFormat=xml"):
        res = run(helm, "lint", str(CHART), "--set", bad)
        assert res.returncode != 0, f"{bad} should fail: {res.stdout}"
        assert "schema" in (res.stdout + res.stderr).lower()


@pytest.fixture(scope="module")
def rendered(helm: str) -> list[dict[str, Any]]:
    res = run(helm, "template", "kubetrt", str(CHART), "--namespace", "kubetrt-system", "--include-crds",
              "--set", "serviceMonitor.enabled=true", "--set", "image.serving.tag=9.9.9")
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def test_rendered_builtin_objects_validate_strictly(rendered: list[dict[str, Any]]) -> None:
    objs = builtin(rendered)
    assert {d["kind"] for d in objs} >= {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                                         "CustomResourceDefinition"}
    for d in objs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_rendered_chart_wires_images_labels_rbac_and_crds(rendered: list[dict[str, Any]]) -> None:
    by_kind = {d["kind"]: d for d in rendered}
    dep = by_kind["Deployment"]
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KUBETRT_SERVING_IMAGE"] == "ghcr.io/kubetrt/serving:9.9.9"
    assert "--peering=kubetrt" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    for d in rendered:
        if d["kind"] != "CustomResourceDefinition":
            assert d["metadata"]["labels"]["app.kubernetes.io/name"] == "kubetrt"
            assert "app.kubernetes.io/managed-by" in d["metadata"]["labels"]
    assert by_kind["ClusterRole"]["rules"] == rbac.cluster_role_rules()
    assert by_kind["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    rendered_crds = sorted((d for d in rendered if d["kind"] == "CustomResourceDefinition"),
                           key=lambda d: d["metadata"]["name"])
    assert rendered_crds == sorted(crds.all_crds(), key=lambda d: d["metadata"]["name"])
    sc = dep["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]


def test_manifests_validate_strictly_and_apply_in_order() -> None:
    files = sorted(p.name for p in (REPO / "manifests").glob("*.yaml"))
    assert files[0] == "00-crds.yaml" and all(f[:2].isdigit() for f in files)
    kinds = []
    for name in files:
        docs = [d for d in yaml.safe_load_all((REPO / "manifests" / name).read_text()) if d]
        for d in builtin(docs):
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        kinds += [d["kind"] for d in docs]
    assert kinds.index("ClusterKopfPeering") > kinds.index("CustomResourceDefinition")
    role = next(d for d in yaml.safe_load_all((REPO / "manifests/03-rbac.yaml").read_text())
                if d["kind"] == "ClusterRole")
    assert role["rules"] == rbac.cluster_role_rules()


def test_get_helm_script_is_idempotent(helm: str) -> None:
    res = subprocess.run([str(REPO / "scripts" / "get-helm.sh"), str(Path(helm).parent)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == helm, res.stderr
