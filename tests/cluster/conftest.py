"""Fixtures of the tests on a real control plane (tests/cluster, `pytest -m cluster`).

scripts/e2e-cluster.sh builds the images and the control plane, starts it and runs these tests
(the default pytest run deselects them); selected without it, they fail and say how to run them.

* ``admin``: an API client with the admin certificate e2e-cluster.sh wrote;
* ``agent``: the Node objects (one CPU node, an H100 and an A100 node, as GPU Feature Discovery
  labels them) and the node agent that runs the CPU node's pods (node_agent.py);
* ``release``: the chart installed with the real helm, with the images e2e-images.sh built: the
  operator runs as its Deployment says, as the chart's ServiceAccount, on the CPU node;
* ``model``: tests/containers' pipeline fixture (the example CNN lowered, its host engine taken out
  of the store again so that the EngineBuild Job must build it).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import kubernetes
import pytest

HERE = Path(__file__).resolve().parent
CONTAINERS = HERE.parent / "containers"
for path in (HERE, CONTAINERS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import file_modules  # noqa: E402
from kubetrt.operators import names  # noqa: E402
from kube_cluster import (OPERATOR_NAMESPACE, RELEASE, Release, api_client, env_path, helm, helm_values,  # noqa: E402
                          kubectl, say, wait_until)
from node_agent import CPU_NODE, GPU_NODES, NodeAgent, node_objects, register_nodes  # noqa: E402
from podman_pods import images_missing  # noqa: E402


model = file_modules.load("kubetrt_tests_containers_conftest", CONTAINERS / "conftest.py").model


@pytest.fixture(scope="session", autouse=True)
def control_plane() -> None:
    problem = None
    if not os.environ.get("KUBECONFIG") or not os.environ.get("KUBETRT_CLUSTER_BIN"):
        problem = "no test control plane ($KUBECONFIG, $KUBETRT_CLUSTER_BIN)"
    else:
        problem = images_missing()
    if problem:
        pytest.fail(f"{problem}: run scripts/e2e-cluster.sh (as root)", pytrace=False)


@pytest.fixture(scope="session")
def admin() -> kubernetes.client.ApiClient:
    return api_client()


@pytest.fixture(scope="session")
def agent(admin: kubernetes.client.ApiClient) -> Iterator[NodeAgent]:
    nodes = node_objects((names.GPU_TAINT_KEY, names.GPU_TAINT_EFFECT), names.GPU_RESOURCE, names.GPU_PRODUCT_LABEL)
    register_nodes(admin, nodes)
    node_agent = NodeAgent(admin, [n["metadata"]["name"] for n in nodes],
                           api_port=int(os.environ.get("KUBETRT_CLUSTER_API_PORT", "6443")))
    node_agent.start()
    say(f"nodes {CPU_NODE} (runs pods with podman), {', '.join(f'{n} ({p})' for n, p in GPU_NODES.items())}")
    try:
        yield node_agent
    finally:
        node_agent.stop()
        if node_agent.errors:
            print("node agent errors:", *node_agent.errors[-20:], sep="\n  ", flush=True)


@pytest.fixture(scope="session")
def release(agent: NodeAgent) -> Iterator[Release]:
    """`helm install kubetrt helm/kubetrt` on a cluster with no kubetrt objects (test_install.py
    applies manifests/ first and deletes them again)."""
    say("helm install kubetrt helm/kubetrt (images of scripts/e2e-images.sh)")
    # A Prometheus address: autoscaling on load becomes a KEDA ScaledObject once KEDA's CRD is installed
    # (test_rollouts.py); no Prometheus runs here, KEDA's schema checks the object.
    helm("install", RELEASE, "helm/kubetrt", "-n", OPERATOR_NAMESPACE, "--create-namespace", *helm_values(),
         "--set", "operator.prometheusURL=http://prometheus-operated.monitoring.svc:9090",
         "--wait", "--timeout", "180s")
    rel = Release(OPERATOR_NAMESPACE, f"{RELEASE}-operator")

    def running() -> bool:
        pods = rel.operator_pods()
        return bool(pods) and all(p["status"].get("phase") == "Running" for p in pods)
    wait_until("the operator pod running on the CPU node", running, timeout=120,
               detail=lambda: kubectl("get", "pods", "-A", "-o", "wide").stdout + "\n" + "\n".join(agent.errors[-5:]))
    yield rel
    helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait", check=False)


__all__ = ["admin", "agent", "control_plane", "env_path", "model", "release"]
