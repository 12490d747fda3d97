"""Read observed state, plan (reconcile.py), apply the plan through the adapter (kube.py).

Each function reconciles one object completely and can be called from any trigger (its own
event, a child's event, an operator restart); a per-object lock keeps concurrent triggers in order.
"""
from __future__ import annotations

import datetime
import logging
import threading
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import kopf
import kubernetes

from kubetrt.operators import pods as podinfo, reconcile, status
from kubetrt.operators.kube import KubeClient
from kubetrt.operators.names import (API_VERSION, KIND_ENGINE_BUILD, KIND_MODEL_DEPLOYMENT, LABEL_APP_COMPONENT,
                                     LABEL_APP_MANAGED_BY, LABEL_BUILD, LABEL_MD, MANAGED_BY, label_value)
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
    return reconcile.Observed(
        engine_builds=by_name(*EB),
        deployments=by_name("apps/v1", "Deployment"),
        services=by_name("v1", "Service"),
        autoscalers=by_name("autoscaling/v2", "HorizontalPodAutoscaler"),
        pods=pods,
        nodes=nodes_if_unschedulable(kube, pods),
    )


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
                          record: Recorder = log_event) -> dict[str, Any] | None:
    """Reconcile one ModelDeployment; returns the status written (None if it is gone). The plan's
    Events are recorded once its status is written."""
    with _lock("md", namespace, name):
        for attempt in range(STATUS_ATTEMPTS):
            md = _read_live(kube, MD, namespace, name)
            if md is None:
                return None
            observed = observe(kube, namespace, name)
            plan = reconcile.plan_model_deployment(md, observed, config, now_iso())
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
