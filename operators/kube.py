"""Kubernetes API adapter over the official client: plain dicts in and out, one code path for all kinds.

Only the verbs the operator needs are exposed; RBAC (manifests/03-rbac.yaml, the chart's
ClusterRole) grants exactly these on exactly these resources.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Mapping

import kubernetes

from kubetrt.operators.names import (API_VERSION, KIND_ENGINE_BUILD, KIND_MODEL_DEPLOYMENT, PLURAL_ENGINE_BUILDS,
                                     PLURAL_MODEL_DEPLOYMENTS)

log = logging.getLogger("kubetrt.operators.kube")

# (apiVersion, kind) -> plural. Core-group kinds live under /api, the rest under /apis.
RESOURCES: dict[tuple[str, str], str] = {
    (API_VERSION, KIND_MODEL_DEPLOYMENT): PLURAL_MODEL_DEPLOYMENTS,
    (API_VERSION, KIND_ENGINE_BUILD): PLURAL_ENGINE_BUILDS,
    ("apps/v1", "Deployment"): "deployments",
    ("batch/v1", "Job"): "jobs",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "horizontalpodautoscalers",
}


class KubeClient:
    """A small dict-based client: get, list, create, replace, patch_status, delete."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api = api_client

    @classmethod
    def from_environment(cls) -> "KubeClient":
        """In-cluster config in a pod, else the local kubeconfig."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return cls(kubernetes.client.ApiClient())

    @classmethod
    def for_host(cls, host: str, token: str | None = None) -> "KubeClient":
        """A client for an explicit API server URL (tests, local development)."""
        cfg = kubernetes.client.Configuration()
        cfg.host = host
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return cls(kubernetes.client.ApiClient(cfg))

    @staticmethod
    def _path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
              sub: str | None = None) -> str:
        plural = RESOURCES[(api_version, kind)]
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        path = f"{base}/namespaces/{namespace}/{plural}" if namespace else f"{base}/{plural}"
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    def _call(self, method: str, path: str, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json") -> dict[str, Any]:
        resp = self.api.call_api(
            path, method, query_params=query or [], body=body,
            header_params={"Accept": "application/json", "Content-Type": content_type},
            auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
        data = resp.data
        return json.loads(data) if data else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", self._path(api_version, kind, namespace, name))
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Objects with all ``labels``; also filtered here, so a server that ignores selectors is fine."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        data = self._call("GET", self._path(api_version, kind, namespace), query=[("labelSelector", selector)])
        items = []
        for item in data.get("items") or []:
            have = (item.get("metadata") or {}).get("labels") or {}
            if item.get("metadata", {}).get("namespace", namespace) == namespace and all(
                    have.get(k) == v for k, v in labels.items()):
                item.setdefault("apiVersion", api_version)
                item.setdefault("kind", kind)
                items.append(item)
        return items

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        log.info("create %s %s/%s", obj["kind"], meta.get("namespace"), meta["name"])
        return self._call("POST", self._path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj)

    def replace(self, obj: Mapping[str, Any], observed: Mapping[str, Any]) -> dict[str, Any]:
        """PUT ``obj`` over ``observed`` (optimistic concurrency on its resourceVersion)."""
        body = json.loads(json.dumps(obj))
        meta = body["metadata"]
        rv = (observed.get("metadata") or {}).get("resourceVersion")
        if rv:
            meta["resourceVersion"] = rv
        log.info("replace %s %s/%s", obj["kind"], meta.get("namespace"), meta["name"])
        return self._call("PUT", self._path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]),
                          body=body)

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                     status: Mapping[str, Any]) -> dict[str, Any] | None:
        """Merge-patch the status subresource; None if the object is gone."""
        try:
            return self._call("PATCH", self._path(api_version, kind, namespace, name, "status"),
                              body={"status": dict(status)}, content_type="application/merge-patch+json")
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete with background propagation (dependents are garbage-collected); False if absent."""
        log.info("delete %s %s/%s", kind, namespace, name)
        try:
            self._call("DELETE", self._path(api_version, kind, namespace, name),
                       body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
            return True
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
