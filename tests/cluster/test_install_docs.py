"""README "On a cluster" step 2 as written, on a real API server: the kubectl install command and
the image commands, the chart's labelled namespace, and the CRD upgrade before `helm upgrade`.

scripts/e2e-cluster.sh runs this file first on a clean control plane (before test_manifests.py):
the one-line kubectl install must create the CRDs and then the objects of their kinds in one go.
The commands are read out of the README and run by bash; only REGISTRY becomes the images
scripts/e2e-images.sh built, and the chart's release moves aside so it cannot meet the kubectl one.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess

import pytest
import yaml

import kubetrt
from kube_cluster import OPERATOR_NAMESPACE, REPO, env_path, helm, kubectl, kubectl_json, say, wait_until
from node_agent import CPU_NODE, NodeAgent
from podman_pods import TAG

pytestmark = pytest.mark.cluster

README = REPO / "README.md"
CHART = REPO / "helm" / "kubetrt"
DOCS_RELEASE, DOCS_NAMESPACE = "kt-docs", "kt-docs-system"  # the chart's release beside the kubectl install


def _install_step() -> str:
    text = README.read_text()
    start = text.index("2. Install the CRDs, RBAC and the operator")
    return text[start:text.index("\n3. ", start)]


def _commands(section: str, program: str) -> list[str]:
    """The section's code-block lines that run `program` (continuation lines joined)."""
    commands, current = [], ""
    for line in section.splitlines():
        if not line.startswith("       ") and not current:
            continue
        current += line.strip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.startswith(f"{program} "):
            commands.append(current)
        current = ""
    return commands


def _kubectl_part() -> str:
    section = _install_step()
    return section[section.index("**a. kubectl**"):section.index("**b. Helm**")]


def _helm_part() -> str:
    section = _install_step()
    return section[section.index("**b. Helm**"):]


def _with_test_images(command: str) -> str:
    command = re.sub(r"REGISTRY/kubetrt/([a-z-]+):" + re.escape(kubetrt.__version__), rf"localhost/kubetrt/\1:{TAG}", command)
    return command.replace("REGISTRY/kubetrt/", "localhost/kubetrt/")


def _bash(command: str) -> subprocess.CompletedProcess[str]:
    """`command` as a user's shell runs it, with the pinned kubectl and helm first on PATH."""
    helm_dir = env_path("KUBETRT_CLUSTER_HELM").parent
    env = {**os.environ, "PATH": f"{env_path('KUBETRT_CLUSTER_BIN')}:{helm_dir}:{os.environ['PATH']}",
           "KUBECONFIG": str(env_path("KUBECONFIG"))}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", command], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=300)


def test_readme_kubectl_install_on_a_clean_cluster(agent: NodeAgent) -> None:
    assert not kubectl("get", "crd", "-o", "name").stdout.strip(), "this test needs a cluster without CRDs"
    install, *images = _commands(_kubectl_part(), "kubectl")
    assert "manifests/00-crds.yaml" in install and install.rstrip().endswith("kubectl apply -f manifests/"), install
    say(f"README: {install}")
    proc = _bash(install)
    assert proc.returncode == 0, f"the README's install command failed:\n{proc.stdout}\n{proc.stderr}"
    assert "clusterkopfpeering.kopf.dev/kubetrt created" in proc.stdout, proc.stdout
    assert images, "the README shows how to run a registry's images"
    for command in images:
        say(f"README: {_with_test_images(command)}")
        proc = _bash(_with_test_images(command))
        assert proc.returncode == 0, f"{command}:\n{proc.stderr}"

    # The operator runs only if those commands took: the manifests' ghcr.io images are not on the
    # node (the node agent never pulls), the ones e2e-images.sh built are.
    def running() -> list[dict]:
        pods = kubectl_json("get", "pods", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator")["items"]
        return [p for p in pods if p["status"].get("phase") == "Running"
                and p["spec"]["containers"][0]["image"] == f"localhost/kubetrt/operator:{TAG}"]
    (pod,) = wait_until("the operator pod running the README's image", running, timeout=180,
                        detail=lambda: kubectl("get", "pods", "-A", "-o", "wide").stdout + "\n".join(agent.errors[-5:]))
    assert pod["spec"]["nodeName"] == CPU_NODE
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    for var, image in (("KUBETRT_SERVING_IMAGE", "serving"), ("KUBETRT_BUILDER_IMAGE", "builder"),
                       ("KUBETRT_SERVING_IMAGE_GPU", "serving-gpu"), ("KUBETRT_BUILDER_IMAGE_GPU", "builder-gpu")):
        assert env[var] == f"localhost/kubetrt/{image}:{TAG}", var


def _helm_args(command: str) -> list[str]:
    """A README helm command's arguments for the test's own release and namespace."""
    args = shlex.split(_with_test_images(command))[1:]
    args = [DOCS_RELEASE if a == "kubetrt" else DOCS_NAMESPACE if a == OPERATOR_NAMESPACE else a for a in args]
    # Beside the kubectl install: its own peering; its operator pod never scheduled (no node has the label).
    return [*args, "--set", f"peering.name={DOCS_RELEASE}", "--set", "nodeSelector.kubetrt-test/none=none"]


def test_readme_helm_install_labels_its_namespace(agent: NodeAgent) -> None:
    (install,) = [c for c in _commands(_helm_part(), "helm") if c.startswith("helm install")]
    assert "--create-namespace" in install and "namespace.manage=true" in install, install
    say(f"README: {install} (as release {DOCS_RELEASE} in {DOCS_NAMESPACE})")
    helm(*_helm_args(install))
    labels = kubectl_json("get", "namespace", DOCS_NAMESPACE)["metadata"]["labels"]
    manifest = yaml.safe_load((REPO / "manifests" / "01-namespace.yaml").read_text())
    assert labels["pod-security.kubernetes.io/enforce"] == manifest["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    # The label's effect: Pod Security admission refuses a pod with no security context there
    # (root allowed, privilege escalation, no seccomp profile), which an unlabelled namespace takes...
    plain = ("run", "plain", "--image", f"localhost/kubetrt/operator:{TAG}", "--dry-run=server")
    kubectl(*plain, "-n", "default")
    refused = kubectl(*plain, "-n", DOCS_NAMESPACE, check=False)
    assert refused.returncode != 0 and 'violates PodSecurity "restricted' in refused.stderr, refused.stderr
    # ...and admitted the chart's operator pod (its ReplicaSet created it).
    wait_until("the chart's operator pod admitted", lambda: kubectl_json("get", "pods", "-n", DOCS_NAMESPACE)["items"],
               timeout=60, detail=lambda: kubectl("get", "events", "-n", DOCS_NAMESPACE).stdout)


def test_readme_crd_upgrade_then_helm_upgrade(agent: NodeAgent) -> None:
    """A CRD an older release installed (a printer column short) is brought up to date by the
    README's upgrade commands, which `helm upgrade` alone would never do."""
    upgrade = [c for c in _commands(_helm_part(), "kubectl") + _commands(_helm_part(), "helm")
               if "crds/" in c or c.startswith("helm upgrade")]
    assert len(upgrade) == 2 and "crds/" in upgrade[0], upgrade
    crd_file = CHART / "crds" / "modeldeployments.kubetrt.io.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    older = {**crd, "spec": {**crd["spec"], "versions": [{**crd["spec"]["versions"][0],
                                                         "additionalPrinterColumns": columns[:-1]}]}}
    kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=yaml.safe_dump(older))

    def live_columns() -> list[str]:
        return kubectl("get", "crd", crd["metadata"]["name"], "-o",
                       "jsonpath={.spec.versions[0].additionalPrinterColumns[*].name}").stdout.split()
    assert live_columns() == [c["name"] for c in columns[:-1]]
    helm(*_helm_args(upgrade[1]))
    assert live_columns() == [c["name"] for c in columns[:-1]], "helm upgrade changed a CRD (it should not)"
    say(f"README: {upgrade[0]}; {upgrade[1]}")
    proc = _bash(upgrade[0])
    assert proc.returncode == 0, proc.stderr
    helm(*_helm_args(upgrade[1]))
    assert live_columns() == [c["name"] for c in columns]


def test_helm_uninstall_keeps_the_managed_namespace(agent: NodeAgent) -> None:
    helm("uninstall", DOCS_RELEASE, "-n", DOCS_NAMESPACE, "--wait", "--timeout", "120s")
    assert kubectl_json("get", "namespace", DOCS_NAMESPACE)["status"]["phase"] == "Active"
    assert not kubectl_json("get", "deployments", "-n", DOCS_NAMESPACE)["items"]
    kubectl("delete", "namespace", DOCS_NAMESPACE, "--wait=false")

