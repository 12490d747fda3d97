"""The operator's RBAC rules: exactly the verbs it uses, in one place.

Written into manifests/03-rbac.yaml and helm/kubetrt/files/rbac-rules.yaml by
``python -m kubetrt.operators.crds --write``; integration tests check every API request the
running operator makes against these rules.
"""
from __future__ import annotations

from typing import Any

from kubetrt.operators.names import GROUP, PLURAL_ENGINE_BUILDS, PLURAL_MODEL_DEPLOYMENTS

# (apiGroup, resource, verbs, why)
RULES: list[tuple[str, str, list[str], str]] = [
    (GROUP, PLURAL_MODEL_DEPLOYMENTS, ["get", "list", "watch", "patch"],
     "watched by kopf; read by the reconciler; kopf patches its finalizer and annotations"),
    (GROUP, f"{PLURAL_MODEL_DEPLOYMENTS}/status", ["patch"], "status conditions"),
    (GROUP, PLURAL_ENGINE_BUILDS, ["get", "list", "watch", "create", "delete", "patch"],
     "one per target and engine identity; superseded ones are deleted"),
    (GROUP, f"{PLURAL_ENGINE_BUILDS}/status", ["patch"], "build phase and engine key"),
    ("batch", "jobs", ["get", "list", "watch", "create"], "the build Job of an EngineBuild"),
    ("", "pods", ["list", "watch"], "build pods: the build result (termination message) and why a build is "
     "stuck (unschedulable, image pull); serving pods: why a target is not ready"),
    ("", "pods/proxy", ["get"], "canary analysis: the canary pods' /metrics through the API server's pod proxy"),
    ("", "nodes", ["list"], "which node label an unschedulable pod asks for that no node has"),
    ("apps", "deployments", ["list", "watch", "create", "update", "delete"], "serving Deployments"),
    ("", "services", ["list", "create", "update", "delete"], "one Service per ModelDeployment"),
    ("autoscaling", "horizontalpodautoscalers", ["list", "create", "update", "delete"], "optional HPA"),
    ("policy", "poddisruptionbudgets", ["list", "create", "update", "delete"],
     "a PodDisruptionBudget per serving target (KUBETRT_POD_DISRUPTION_BUDGETS)"),
    ("monitoring.coreos.com", "servicemonitors", ["list", "create", "update", "delete"],
     "a ServiceMonitor per ModelDeployment, where the Prometheus Operator's CRD is installed"),
    ("gateway.networking.k8s.io", "httproutes", ["list", "create", "update", "delete"],
     "an HTTPRoute per ModelDeployment (weighted stable and canary backends), where the Gateway API's CRD is "
     "installed"),
    ("keda.sh", "scaledobjects", ["list", "create", "update", "delete"],
     "a KEDA ScaledObject per target autoscaled on load, where KEDA's CRD is installed and the operator has a "
     "Prometheus address"),
    ("", "events", ["create"], "the operator records stuck and failed builds and targets as Events (kopf)"),
    ("apiextensions.k8s.io", "customresourcedefinitions", ["list", "watch"], "kopf's resource discovery"),
    ("kopf.dev", "clusterkopfpeerings", ["list", "watch", "patch"], "kopf peering: one active replica"),
]


def cluster_role_rules() -> list[dict[str, Any]]:
    """Rules for the ClusterRole, one per resource (subresources separate), in a stable order."""
    return [{"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}
            for group, resource, verbs, _ in RULES]


def allows(group: str, resource: str, verb: str) -> bool:
    """Whether the rules grant ``verb`` on ``group``/``resource`` (resource may be 'x/status')."""
    return any(g == group and r == resource and verb in verbs for g, r, verbs, _ in RULES)
