"""The control plane scripts/e2e-cluster.sh started, as the cluster tests use it: kubectl and helm
of that run, an admin API client, waiting with clear failures, the control plane's logs."""
from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

import kubernetes
import yaml

from podman_pods import TAG, say

REPO = Path(__file__).resolve().parents[2]
RELEASE = "kubetrt"
OPERATOR_NAMESPACE = "kubetrt-system"
T = TypeVar("T")


def env_path(name: str) -> Path:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"${name} is not set: run the cluster tests with scripts/e2e-cluster.sh")
    return Path(value)


def kubectl(*args: str, check: bool = True, stdin: str | None = None, timeout: float = 120.0,
            kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl of the pinned release against the test cluster; a failure shows its stderr."""
    cmd = [str(env_path("KUBETRT_CLUSTER_BIN") / "kubectl"),
           "--kubeconfig", str(kubeconfig or env_path("KUBECONFIG")), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def kubectl_json(*args: str) -> Any:
    return yaml.safe_load(kubectl(*args, "-o", "json").stdout)


def helm(*args: str, check: bool = True, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    cmd = [str(env_path("KUBETRT_CLUSTER_HELM")), "--kubeconfig", str(env_path("KUBECONFIG")), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def api_client(kubeconfig: Path | None = None) -> kubernetes.client.ApiClient:
    return kubernetes.config.new_client_from_config(str(kubeconfig or env_path("KUBECONFIG")))


def wait_until(what: str, check: Callable[[], T | None], timeout: float = 120.0, period: float = 0.5,
               detail: Callable[[], str] | None = None) -> T:
    """Poll `check` until it returns something truthy; fail naming `what` (and `detail()`)."""
    start = time.monotonic()
    last_error = ""
    while time.monotonic() - start < timeout:
        try:
            value = check()
            if value:
                return value
        except kubernetes.client.ApiException as e:
            last_error = f" (last API error: {e.status} {e.reason})"
        time.sleep(period)
    more = detail() if detail else ""
    raise AssertionError(f"{what}: not within {timeout:.0f}s{last_error}\n{more}")


def wait_established(crd: str, timeout: float = 60.0) -> None:
    """Wait until the API server serves the CRD `crd` (its Established condition is True). Not
    `kubectl wait --for=condition=Established`: that fails at once, instead of waiting, on a CRD
    whose status the API server has not written yet (no conditions at all)."""
    def established() -> bool:
        status = kubectl_json("get", "crd", crd).get("status") or {}
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in status.get("conditions") or [])

    wait_until(f"the CRD {crd} established", established, timeout=timeout,
               detail=lambda: kubectl("get", "crd", crd, "-o", "yaml", check=False).stdout[-2000:])


@dataclass
class Release:
    """The chart, installed; the operator's pod as the node agent runs it."""

    namespace: str
    deployment: str

    def operator_pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = kubectl_json("get", "pods", "-n", self.namespace, "-l",
                                                      "app.kubernetes.io/component=operator")["items"]
        return items


def helm_values() -> list[str]:
    """The chart's values that point it at the images scripts/e2e-images.sh built."""
    out = []
    for part in ("operator", "serving", "builder"):
        out += ["--set", f"image.{part}.repository=localhost/kubetrt/{part}", "--set", f"image.{part}.tag={TAG}"]
    return [*out, "--set", "image.pullPolicy=Never"]


__all__ = ["OPERATOR_NAMESPACE", "RELEASE", "REPO", "Release", "helm_values", "api_client", "env_path", "helm", "kubectl",
           "kubectl_json", "say", "wait_until"]
