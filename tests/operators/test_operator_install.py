"""Install artifacts: helm lint/template with a real helm binary, kubernetes-validate --strict, values schema."""
from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from helm_binary import helm, run  # noqa: F401  helm is a fixture

from kubetrt.operators import crds, handlers, install, names, rbac
from kubetrt.operators.objects import OperatorConfig

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "kubetrt"
K8S_VERSION = "1.31.0"


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


# ----------------------------------------------------------------------------- operator Deployment (install.py)
# What helm renders and the plain manifests do not have, by design: helm's release labels (and the
# release instance in the selector, so two releases do not select each other's pods).
HELM_RELEASE_LABELS = {"app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "helm.sh/chart"}
HELM_ONLY_LABELS: dict[tuple[str, ...], set[str]] = {
    ("metadata", "labels"): HELM_RELEASE_LABELS,
    ("spec", "template", "metadata", "labels"): HELM_RELEASE_LABELS,
    ("spec", "selector", "matchLabels"): {"app.kubernetes.io/instance"},
}


def render_deployment(helm: str, *args: str) -> dict[str, Any]:
    res = run(helm, "template", "kubetrt", str(CHART), "--namespace", "kubetrt-system",
              "--show-only", "templates/deployment.yaml", *args)
    assert res.returncode == 0, res.stderr
    assert "GENERATED" not in res.stdout  # the template's header is a Helm comment
    return yaml.safe_load(res.stdout)


def without_helm_only_labels(dep: dict[str, Any]) -> dict[str, Any]:
    """``dep`` minus HELM_ONLY_LABELS, each of which must be there."""
    out = copy.deepcopy(dep)
    for path, keys in HELM_ONLY_LABELS.items():
        labels = out
        for key in path:
            labels = labels[key]
        assert keys <= set(labels), (path, labels)
        for key in keys:
            del labels[key]
    return out


def test_generated_operator_files_match_the_python_source_of_truth() -> None:
    files = install.generated_files()
    assert set(files) == {REPO / "manifests/05-operator.yaml", CHART / "templates/deployment.yaml",
                          CHART / "files/grafana-dashboard.json"}
    stale = [str(p) for p, content in files.items() if not p.exists() or p.read_text() != content]
    assert not stale, f"regenerate with `python -m kubetrt.operators.install --write`: {stale}"
    assert install.main(["--check"]) == 0


def test_default_chart_renders_the_manifest_deployment(helm: str) -> None:
    manifest = [d for d in yaml.safe_load_all((REPO / "manifests/05-operator.yaml").read_text()) if d]
    assert [d["kind"] for d in manifest] == ["Deployment"]
    assert without_helm_only_labels(render_deployment(helm)) == manifest[0] == install.default_deployment()


def test_chart_values_reach_the_rendered_deployment(helm: str, tmp_path: Path) -> None:
    values, app_version = install.chart_defaults()
    values["image"]["operator"]["tag"] = "1.2.3"
    values["image"]["serving"] = {"repository": "registry.example/kubetrt/serving", "tag": "2.0.0"}
    values["image"]["pullPolicy"] = "Always"
    values["replicaCount"] = 2
    values["peering"]["name"] = "team-a"
    values["operator"].update(jobTTLSeconds=600, clusterDomain="corp.internal", logFormat="plain")
    values["serviceAccount"] = {"create": True, "name": "custom-sa", "annotations": {}}
    values["resources"]["limits"] = {"cpu": "1", "memory": "1Gi"}  # helm merges maps: keep the full tree
    values.update(
        podAnnotations={"example.com/team": "ml"},
        imagePullSecrets=[{"name": "regcred"}],
        nodeSelector={"kubernetes.io/os": "linux"},
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    )
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(values))
    rendered = render_deployment(helm, "-f", str(values_file))
    kubernetes_validate.validate(rendered, K8S_VERSION, strict=True)
    assert without_helm_only_labels(rendered) == install.operator_deployment(
        **install.settings_from_values(values, app_version))

    pod = rendered["spec"]["template"]["spec"]
    c = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert c["image"] == "ghcr.io/kubetrt/operator:1.2.3" and c["imagePullPolicy"] == "Always"
    assert env["KUBETRT_SERVING_IMAGE"] == "registry.example/kubetrt/serving:2.0.0"
    assert env["KUBETRT_JOB_TTL_SECONDS"] == "600" and env["KUBETRT_CLUSTER_DOMAIN"] == "corp.internal"
    assert "--peering=team-a" in c["args"] and "--log-format=plain" in c["args"]
    assert rendered["spec"]["replicas"] == 2 and pod["serviceAccountName"] == "custom-sa"
    assert c["resources"] == values["resources"] and pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == values["nodeSelector"] and pod["tolerations"] == values["tolerations"]
    assert pod["affinity"] == values["affinity"]
    assert rendered["spec"]["template"]["metadata"]["annotations"] == {"example.com/team": "ml"}

    res = run(helm, "template", "kubetrt", str(CHART), "--show-only", "templates/deployment.yaml",
              "--set", "image.operator.tag=4.5.6")
    assert yaml.safe_load(res.stdout)["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":4.5.6")


def test_every_env_var_of_the_operator_is_read_by_its_code() -> None:
    dep = install.default_deployment()
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = OperatorConfig.from_env({k: v for k, v in env.items() if v is not None})
    assert config == OperatorConfig(), "the chart's defaults and the operator's built-in defaults differ"
    for name in env:
        if name == "POD_NAME":  # kopf peering: each replica's priority
            assert handlers.peering_priority({name: "a"}) != handlers.peering_priority({name: "b"})
            continue
        if name == names.ENV_POD_DISRUPTION_BUDGETS:  # a switch: any other value is refused, naming it
            assert OperatorConfig.from_env({name: "false"}) != OperatorConfig()
            with pytest.raises(ValueError, match=f"{name}='12345': expected true or false"):
                OperatorConfig.from_env({name: "12345"})
            continue
        if name == names.ENV_PROMETHEUS_URL:  # a URL: anything else is refused, naming it
            assert OperatorConfig.from_env({name: "http://prometheus:9090/"}).prometheus_url == "http://prometheus:9090"
            with pytest.raises(ValueError, match=f"{name}='12345': expected an http:// or https:// URL"):
                OperatorConfig.from_env({name: "12345"})
            continue
        changed = OperatorConfig.from_env({name: "12345"})
        assert changed != OperatorConfig(), f"{name} is set by the Deployment but read by nothing"
