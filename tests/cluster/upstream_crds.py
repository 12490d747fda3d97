"""Other projects' real CRDs, installed into the test control plane so that their own schemas validate
what the operator creates: the Gateway API's HTTPRoute, KEDA's ScaledObject and the Prometheus
Operator's ServiceMonitor, each at a pinned release, fetched through the Go module proxy
(`go mod download`, cached in Go's module cache) from the module that ships it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kube_cluster import kubectl, say, wait_established

# CRD name -> (Go module, pinned version, the CRD's file in that module)
PINNED: dict[str, tuple[str, str, str]] = {
    "httproutes.gateway.networking.k8s.io": (
        "sigs.k8s.io/gateway-api", "v1.6.3", "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"),
    "scaledobjects.keda.sh": (
        "github.com/kedacore/keda/v2", "v2.21.0", "config/crd/bases/keda.sh_scaledobjects.yaml"),
    "servicemonitors.monitoring.coreos.com": (
        "github.com/prometheus-operator/prometheus-operator", "v0.85.0",
        "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml"),
}
HTTP_ROUTE = "httproutes.gateway.networking.k8s.io"
SCALED_OBJECT = "scaledobjects.keda.sh"
SERVICE_MONITOR = "servicemonitors.monitoring.coreos.com"


def crd_file(name: str) -> Path:
    """The CRD's YAML as its pinned release ships it (downloaded once into Go's module cache)."""
    module, version, path = PINNED[name]
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("Go is needed to fetch the upstream CRDs (go mod download)")
    with tempfile.TemporaryDirectory(prefix="kubetrt-crds-") as tmp:
        subprocess.run([go, "mod", "init", "kubetrt.test/crds"], cwd=tmp, check=True, capture_output=True)
        res = subprocess.run([go, "mod", "download", "-json", f"{module}@{version}"], cwd=tmp, capture_output=True,
                             text=True, timeout=600, env={**os.environ, "GOFLAGS": "-mod=mod"})
    if res.returncode != 0:
        raise RuntimeError(f"go mod download {module}@{version}: {res.stdout}{res.stderr}")
    found = Path(json.loads(res.stdout)["Dir"]) / path
    if not found.is_file():
        raise RuntimeError(f"{module}@{version} has no {path}")
    return found


def install(name: str) -> Path:
    """Apply the CRD (server-side: the HTTPRoute CRD is too large for kubectl's last-applied
    annotation) and wait until the API server serves it."""
    path = crd_file(name)
    module, version, _ = PINNED[name]
    say(f"installing the CRD {name} of {module}@{version}")
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    wait_established(name)
    return path
