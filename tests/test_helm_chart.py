"""The chart's conventions, rendered by the real helm (scripts/get-helm.sh): name overrides, image
tags from appVersion, `global` from a parent chart, the labelled namespace, pull secrets, and a
chart README whose values table lists every value values.yaml has."""
from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from helm_binary import helm, run  # noqa: F401  helm is a fixture

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "kubetrt"
NAMESPACE = "kubetrt-system"



def render(helm: str, *args: str, release: str = "kubetrt", chart: Path = CHART) -> list[dict[str, Any]]:
    res = run(helm, "template", release, str(chart), "--namespace", NAMESPACE, *args)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = by_kind(docs, "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return dict(container)


def image_env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if e["name"].endswith(("_IMAGE", "_IMAGE_GPU"))}


def test_image_tags_default_to_app_version(helm: str) -> None:
    app_version = str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    images = {k: v for k, v in values["image"].items() if isinstance(v, dict)}
    assert images and all(v["tag"] == "" for v in images.values()), images
    container = operator_container(render(helm))
    for ref in [container["image"], *image_env(container).values()]:
        assert ref.endswith(f":{app_version}"), ref
    pinned = operator_container(render(helm, "--set", "image.serving.tag=9.9.9", "--set", "image.operator.tag=1.2.3"))
    assert pinned["image"] == f"{images['operator']['repository']}:1.2.3"
    assert image_env(pinned)["KUBETRT_SERVING_IMAGE"] == f"{images['serving']['repository']}:9.9.9"
    assert image_env(pinned)["KUBETRT_BUILDER_IMAGE"].endswith(f":{app_version}")


def _names(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {d["kind"]: d["metadata"]["name"] for d in docs if d["kind"] != "ClusterKopfPeering"}


def test_name_overrides(helm: str) -> None:
    assert set(_names(render(helm)).values()) == {"kubetrt-operator"}
    assert set(_names(render(helm, release="ml")).values()) == {"ml-kubetrt-operator"}
    assert set(_names(render(helm, "--set", "nameOverride=trt", release="ml")).values()) == {"ml-trt-operator"}
    docs = render(helm, "--set", "fullnameOverride=inference", release="ml")
    assert set(_names(docs).values()) == {"inference-operator"}
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "inference-operator"
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == "inference-operator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "inference-operator", "namespace": NAMESPACE}]
    labels = by_kind(render(helm, "--set", "nameOverride=trt"), "Deployment")[0]["spec"]["selector"]["matchLabels"]
    assert labels["app.kubernetes.io/name"] == "trt"
    bad = run(helm, "template", "x", str(CHART), "--set", "fullnameOverride=Not_A_Name")
    assert bad.returncode != 0 and "fullnameOverride" in bad.stderr, bad.stderr


@pytest.fixture
def parent_chart(tmp_path: Path) -> Iterator[Path]:
    """An umbrella chart with kubetrt as its subchart and a `global` of its own."""
    parent = tmp_path / "platform"
    (parent / "charts").mkdir(parents=True)
    (parent / "templates").mkdir()
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0", "icon": "https://example.com/icon.png",
        "dependencies": [{"name": "kubetrt", "version": yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]}]}))
    (parent / "values.yaml").write_text(yaml.safe_dump({"global": {"imageRegistry": "registry.example.com"},
                                                        "kubetrt": {"replicaCount": 2}}))
    shutil.copytree(CHART, parent / "charts" / "kubetrt")
    yield parent


def test_works_as_a_subchart_with_global_values(helm: str, parent_chart: Path) -> None:
    res = run(helm, "lint", str(parent_chart), "--strict")
    assert res.returncode == 0, res.stdout + res.stderr
    (dep,) = by_kind(render(helm, chart=parent_chart, release="platform"), "Deployment")
    assert dep["spec"]["replicas"] == 2
    assert run(helm, "lint", str(CHART), "--set", "global.anything=1").returncode == 0


def test_namespace_labelled_only_when_managed(helm: str) -> None:
    assert not by_kind(render(helm), "Namespace")
    (ns,) = by_kind(render(helm, "--set", "namespace.manage=true"), "Namespace")
    manifest_ns = yaml.safe_load((REPO / "manifests" / "01-namespace.yaml").read_text())
    assert ns["metadata"]["name"] == NAMESPACE
    pod_security = {k: v for k, v in manifest_ns["metadata"]["labels"].items() if k.startswith("pod-security.")}
    assert pod_security and pod_security.items() <= ns["metadata"]["labels"].items()
    assert ns["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_image_pull_secrets_reach_the_operator_pod(helm: str) -> None:
    (dep,) = by_kind(render(helm, "--set", "imagePullSecrets[0].name=regcred"), "Deployment")
    assert dep["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    (dep,) = by_kind(render(helm), "Deployment")
    assert "imagePullSecrets" not in dep["spec"]["template"]["spec"]


def _leaf_keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    """Dotted keys of values.yaml down to the documented level: maps that are values themselves
    (empty maps, labels, resources) stay one key."""
    keys: set[str] = set()
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k not in ("labels", "resources", "requests", "limits"):
            keys |= _leaf_keys(v, f"{key}.")
        else:
            keys.add(key)
    return keys


def test_chart_readme_documents_every_value(helm: str) -> None:
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", readme, re.M))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert documented == _leaf_keys(values), (
        f"undocumented: {sorted(_leaf_keys(values) - documented)}; not in values.yaml: {sorted(documented - _leaf_keys(values))}")
    for topic in ("helm install", "helm upgrade", "crds/", "helm uninstall", "--create-namespace", "imagePullSecrets"):
        assert topic in readme, topic
    # The chart README's commands name the chart's real path and release namespace.
    assert "helm/kubetrt" in readme and NAMESPACE in readme
    # helm packages the README: it must not be excluded by .helmignore.
    res = run(helm, "show", "readme", str(CHART))
    assert res.returncode == 0 and res.stdout.strip() == readme.strip()
