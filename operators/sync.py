"""Read observed state, plan (reconcile.py), apply the plan through the adapter (kube.py).

Each function reconciles one object completely and can be called from any trigger (its own
event, a child's event, an operator restart); a per-object lock keeps concurrent triggers in order.
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import kopf
import kubernetes

from kubetrt.operators import pods as podinfo, reconcile, status
from kubetrt.operators.kube import KubeClient
from kubetrt.operators.names import (API_VERSION, HTTP_ROUTE_API, KIND_ENGINE_BUILD, KIND_MODEL_DEPLOYMENT,
                                     LABEL_APP_COMPONENT, LABEL_APP_MANAGED_BY, LABEL_BUILD, LABEL_MD, LABEL_TRACK,
                                     MANAGED_BY, SCALED_OBJECT_API, SERVICE_MONITOR_API, SERVING_PORT, TRACK_CANARY,
                                     label_value)
from kubetrt.operators.objects import OperatorConfig

log = logging.getLogger("kubetrt.operators.sync")
MD = (API_VERSION, KIND_MODEL_DEPLOYMENT)
EB = (API_VERSION, KIND_ENGINE_BUILD)

# Records an Event on an object (handlers.py posts it through kopf); the default only logs it.
Recorder = Callable[[Mapping[str, Any], reconcile.Event], None]


def log_event(obj: Mapping[str, Any], event: reconcile.Event) -> None:
    meta = obj.get("metadata") or {}
    log.info("event %s %s/%s %s: %s: %s", obj.get("kind"), meta.get("namespace"), meta.get("name"), event.type,
             event.reason, event.message)


STATUS_ATTEMPTS = 5  # reads, plans and status writes of one sync before it gives up (a 409 each time)

_locks: defaultdict[tuple[str, str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()


def _lock(kind: str, namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks[(kind, namespace, name)]


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def observe(kube: KubeClient, namespace: str, md_name: str) -> reconcile.Observed:
    """Children of a ModelDeployment, found by its label (and owned by it)."""
    sel = {LABEL_MD: label_value(md_name), LABEL_APP_MANAGED_BY: MANAGED_BY}

    def by_name(api: str, kind: str) -> dict[str, Any]:
        return {o["metadata"]["name"]: o for o in kube.list(api, kind, namespace, sel)}
    pods = kube.list("v1", "Pod", namespace, {**sel, LABEL_APP_COMPONENT: "serving"})

    def optional(api: tuple[str, str, str]) -> dict[str, Any] | None:
        """Objects of another project's CRD; None where it is not served."""
        if not crd_served(kube, api):
            return None
        try:
            return by_name(*api[:2])
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            _discovered.clear()  # the CRD went away since discovery said otherwise
            return None
    # KEDA's own HPA (keda-hpa-<name>) copies the ScaledObject's labels: only the operator's own are listed.
    autoscalers = {k: v for k, v in by_name("autoscaling/v2", "HorizontalPodAutoscaler").items()
                   if _controller_kind(v) in (None, KIND_MODEL_DEPLOYMENT)}
    return reconcile.Observed(
        engine_builds=by_name(*EB),
        deployments=by_name("apps/v1", "Deployment"),
        services=by_name("v1", "Service"),
        autoscalers=autoscalers,
        disruption_budgets=by_name("policy/v1", "PodDisruptionBudget"),
        service_monitors=optional(SERVICE_MONITOR_API),
        http_routes=optional(HTTP_ROUTE_API),
        scaled_objects=optional(SCALED_OBJECT_API),
        pods=pods,
        nodes=nodes_if_unschedulable(kube, pods),
    )


# Reads one serving pod's /metrics text; pluggable so that a cluster whose API server cannot reach
# pod addresses (or tests) can read them another way.
MetricsSource = Callable[[KubeClient, Mapping[str, Any]], str]


def proxy_metrics(kube: KubeClient, pod: Mapping[str, Any]) -> str:
    """A pod's /metrics through the API server's pod proxy: the operator needs no route to pods."""
    meta = pod["metadata"]
    return kube.pod_proxy_get(meta["namespace"], meta["name"], SERVING_PORT, "metrics")


def read_canary_metrics(kube: KubeClient, md: Mapping[str, Any], pods: Sequence[Mapping[str, Any]],
                        source: MetricsSource) -> tuple[list[str] | None, str | None]:
    """The ready canary pods' metrics texts, read only while a canary analysis is configured;
    (None, why) when one cannot be read."""
    if not ((md.get("spec") or {}).get("rollout") or {}).get("canaryAnalysis"):
        return None, None
    canary = [p for p in pods if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_TRACK) == TRACK_CANARY
              and not p["metadata"].get("deletionTimestamp") and podinfo.is_ready(p)]
    if not canary:
        return None, "no ready canary pod"
    texts = []
    for pod in canary:
        try:
            texts.append(source(kube, pod))
        except Exception as exc:  # noqa: BLE001 - any failure to read is reported, the analysis waits
            return None, f"pod {pod['metadata'].get('name')}: {type(exc).__name__}: {str(exc)[:200]}"
    return texts, None


def _controller_kind(obj: Mapping[str, Any]) -> str | None:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return next((str(r.get("kind")) for r in refs if r.get("controller")), None)


DISCOVERY_TTL_SECONDS = 60.0  # how long the answer "is this CRD installed" is reused
_discovered: dict[tuple[str, str], tuple[float, bool]] = {}


def crd_served(kube: KubeClient, api: tuple[str, str, str]) -> bool:
    """Whether another project's CRD (apiVersion, kind, plural: the ServiceMonitor, the HTTPRoute, the
    ScaledObject) is served (API discovery, cached a minute: a CRD installed later is picked up
    without restarting the operator)."""
    key = (api[0], api[2])
    seen = _discovered.get(key)
    if seen is None or time.monotonic() - seen[0] > DISCOVERY_TTL_SECONDS:
        seen = (time.monotonic(), kube.serves(*key))
        _discovered[key] = seen
    return seen[1]


def nodes_if_unschedulable(kube: KubeClient, pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]] | None:
    """The nodes, read only when one of ``pods`` is unschedulable: they say which label none has."""
    if not any(podinfo.is_unschedulable(p) for p in pods):
        return None
    return kube.list("v1", "Node", None, {})


def _create(kube: KubeClient, obj: Mapping[str, Any]) -> None:
    try:
        kube.create(obj)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:  # created concurrently: the next reconcile compares it
            raise


def apply_plan(kube: KubeClient, namespace: str, plan: reconcile.Plan, observed: reconcile.Observed) -> None:
    """Create/replace/delete as planned. Replacing keeps server-owned fields (clusterIP, HPA replicas)."""
    index = {("Deployment", k): v for k, v in observed.deployments.items()}
    index.update({("Service", k): v for k, v in observed.services.items()})
    index.update({("HorizontalPodAutoscaler", k): v for k, v in observed.autoscalers.items()})
    index.update({("PodDisruptionBudget", k): v for k, v in observed.disruption_budgets.items()})
    index.update({("ServiceMonitor", k): v for k, v in (observed.service_monitors or {}).items()})
    index.update({("HTTPRoute", k): v for k, v in (observed.http_routes or {}).items()})
    index.update({("ScaledObject", k): v for k, v in (observed.scaled_objects or {}).items()})
    for obj in plan.create:
        _create(kube, obj)
    for obj in plan.apply:
        current = index.get((obj["kind"], obj["metadata"]["name"]))
        if current is None:
            _create(kube, obj)
            continue
        if obj["kind"] == "Service":
            for key in ("clusterIP", "clusterIPs"):
                if key in (current.get("spec") or {}):
                    obj["spec"][key] = current["spec"][key]
        if obj["kind"] == "Deployment" and "replicas" not in obj["spec"] and "replicas" in (current.get("spec") or {}):
            obj["spec"]["replicas"] = current["spec"]["replicas"]  # owned by the HPA
        kube.replace(obj, current)
    for api_version, kind, name in plan.delete:
        kube.delete(api_version, kind, namespace, name)


def _read_live(kube: KubeClient, what: tuple[str, str], namespace: str, name: str) -> dict[str, Any] | None:
    """The object as the API server has it now, with apiVersion, kind and namespace filled in (the
    planners and _status_written read them); None if it is gone or being deleted."""
    obj = kube.get(*what, namespace, name)
    if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
        return None
    obj.setdefault("apiVersion", what[0])
    obj.setdefault("kind", what[1])
    obj["metadata"].setdefault("namespace", namespace)
    return obj


def _status_written(kube: KubeClient, what: tuple[str, str], obj: Mapping[str, Any], status: Mapping[str, Any]) -> bool:
    """Write `status` over the version of `obj` it was computed from; False on a 409 Conflict (the
    object changed since it was read: the caller plans again from a fresh read)."""
    meta = obj["metadata"]
    try:
        kube.patch_status(*what, meta["namespace"], meta["name"], status, resource_version=meta.get("resourceVersion"))
        return True
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
        log.info("%s %s/%s changed while its status was computed: planning again", what[1], meta["namespace"],
                 meta["name"])
        return False


def sync_model_deployment(kube: KubeClient, config: OperatorConfig, namespace: str, name: str,
                          record: Recorder = log_event, metrics: MetricsSource = proxy_metrics
                          ) -> dict[str, Any] | None:
    """Reconcile one ModelDeployment; returns the status written (None if it is gone). The plan's
    Events are recorded once its status is written."""
    with _lock("md", namespace, name):
        for attempt in range(STATUS_ATTEMPTS):
            md = _read_live(kube, MD, namespace, name)
            if md is None:
                return None
            observed = observe(kube, namespace, name)
            observed.canary_metrics, observed.metrics_error = read_canary_metrics(kube, md, observed.pods, metrics)
            plan = reconcile.plan_model_deployment(md, observed, config, now_iso())
            if plan.decided:
                if not _status_written(kube, MD, md, plan.status):
                    continue
                apply_plan(kube, namespace, plan, observed)
                for event in plan.events:
                    record(md, event)
                return plan.status
            apply_plan(kube, namespace, plan, observed)
            if not reconcile.status_changed(md.get("status"), plan.status):
                return plan.status
            if _status_written(kube, MD, md, plan.status):
                for event in plan.events:
                    record(md, event)
                return plan.status
        raise kopf.TemporaryError(f"ModelDeployment {namespace}/{name} kept changing while its status was written",
                                  delay=5)


def sync_engine_build(kube: KubeClient, config: OperatorConfig, namespace: str, name: str,
                      record: Recorder = log_event) -> dict[str, Any] | None:
    """Reconcile one EngineBuild: ensure its Job, follow the Job and its pods into the status."""
    with _lock("eb", namespace, name):
        for attempt in range(STATUS_ATTEMPTS):
            eb = _read_live(kube, EB, namespace, name)
            if eb is None:
                return None
            job = kube.get("batch/v1", "Job", namespace, name)
            pods: list[dict[str, Any]] = []
            if job is not None and (eb.get("status") or {}).get("phase") not in status.TERMINAL_PHASES:
                pods = kube.list("v1", "Pod", namespace, {LABEL_BUILD: name})
            plan = reconcile.plan_engine_build(eb, job, pods, config, nodes_if_unschedulable(kube, pods))
            if plan.create_job is not None:
                _create(kube, plan.create_job)
            if not reconcile.status_changed(eb.get("status"), plan.status):
                return plan.status
            if _status_written(kube, EB, eb, plan.status):
                for event in plan.events:
                    record(eb, event)
                log.info("enginebuild %s/%s phase=%s reason=%s", namespace, name, plan.status.get("phase"),
                         plan.status.get("reason"))
                return plan.status
        raise kopf.TemporaryError(f"EngineBuild {namespace}/{name} kept changing while its status was written", delay=5)
