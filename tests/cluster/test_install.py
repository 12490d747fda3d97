"""`helm install kubetrt helm/kubetrt` with the real helm, on a control plane that never had the
plain manifests applied (scripts/e2e-cluster.sh restarts it clean after test_manifests.py)."""
from __future__ import annotations

import pytest

from kube_cluster import Release, helm, kubectl
from test_manifests import _crds_established

pytestmark = pytest.mark.cluster


def test_helm_install(release: Release) -> None:
    status = helm("status", "kubetrt", "-n", release.namespace, "-o", "json").stdout
    assert '"status":"deployed"' in status.replace(" ", ""), status[:500]
    _crds_established()
    kubectl("get", "clusterkopfpeering", "kubetrt")
    (pod,) = release.operator_pods()
    assert pod["spec"]["nodeName"] == "cpu-node-1"
