"""`kubectl apply -f manifests/` on a real API server, the CRDs' printer columns and `kubectl explain`.

scripts/e2e-cluster.sh runs this file first, then restarts the control plane clean for the rest
(the chart installs on a cluster that never had these objects: a CRD deleted right after it was
created stays Terminating for minutes, "storage is (re)initializing", on a real API server).
"""
from __future__ import annotations

import pytest

from kube_cluster import OPERATOR_NAMESPACE, kubectl, kubectl_json, say, wait_established, wait_until
from kubetrt.operators import crds
from node_agent import NodeAgent

pytestmark = pytest.mark.cluster


def _printer_columns() -> dict[str, list[str]]:
    return {c["spec"]["names"]["plural"]: [col["name"] for col in c["spec"]["versions"][0]["additionalPrinterColumns"]]
            for c in crds.all_crds() if c["spec"]["group"] == "kubetrt.io"}


def _crds_established() -> None:
    for plural in _printer_columns():
        wait_established(f"{plural}.kubetrt.io")


def test_kubectl_apply_manifests(agent: NodeAgent) -> None:
    # The CRDs first: kubectl maps every object of one apply before it creates any, so the
    # ClusterKopfPeering in 04-peering.yaml has no kind yet on a cluster without its CRD.
    say("kubectl apply -f manifests/00-crds.yaml; wait until the CRDs are Established; kubectl apply -f manifests/")
    kubectl("apply", "-f", "manifests/00-crds.yaml")
    _crds_established()
    wait_established("clusterkopfpeerings.kopf.dev")
    out = kubectl("apply", "-f", "manifests/").stdout
    print(out, flush=True)
    for kind, name in [("namespace", OPERATOR_NAMESPACE), ("clusterrole", "kubetrt-operator"),
                       ("clusterrolebinding", "kubetrt-operator"), ("clusterkopfpeering", "kubetrt")]:
        kubectl("get", kind, name)
    kubectl("get", "serviceaccount", "kubetrt-operator", "-n", OPERATOR_NAMESPACE)
    # The Deployment's pod passes the namespace's Pod Security "restricted" admission.
    wait_until("the operator Deployment's ReplicaSet created its pod (Pod Security restricted)",
               lambda: kubectl_json("get", "pods", "-n", OPERATOR_NAMESPACE)["items"], timeout=60,
               detail=lambda: kubectl("get", "events", "-n", OPERATOR_NAMESPACE).stdout)
    columns = kubectl("get", "crd", "modeldeployments.kubetrt.io", "-o",
                      "jsonpath={.spec.versions[0].additionalPrinterColumns[*].name}").stdout.split()
    assert columns == _printer_columns()["modeldeployments"]
    header = kubectl("get", "modeldeployments", "-A").stdout + kubectl("get", "modeldeployments", "-A").stderr
    assert "No resources found" in header


def test_printer_columns_and_explain(agent: NodeAgent) -> None:
    for plural, columns in _printer_columns().items():
        got = kubectl("get", "crd", f"{plural}.kubetrt.io", "-o",
                      "jsonpath={.spec.versions[0].additionalPrinterColumns[*].name}").stdout.split()
        assert got == columns, (plural, got)
    explain = kubectl("explain", "modeldeployment.spec").stdout
    print(explain[:1500], flush=True)
    for field in ("model", "store", "targets", "optimization", "batching", "rollout"):
        assert f"\n  {field}\t" in explain or f"\n  {field} " in explain, f"{field} missing from kubectl explain:\n{explain}"
    targets = kubectl("explain", "modeldeployment.spec.targets").stdout
    assert "gpuProduct" in targets and "cpu" in targets
