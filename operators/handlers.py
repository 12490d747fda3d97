"""kopf handlers: thin triggers around operators/sync.py.

Run: ``kopf run --all-namespaces --peering=kubetrt -m kubetrt.operators.handlers``.
Every trigger (the object's own changes, its children's events, operator restarts via on.resume)
calls the same idempotent sync function, so a missed event only delays convergence until the next
trigger. No kopf timers: they force a finalizer onto every ModelDeployment, which blocks deletion
(and its ownerReference cascade) whenever the operator is down or uninstalled first.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Any, Mapping, cast

import kopf

from kubetrt.operators import reconcile, sync
from kubetrt.operators.kube import KubeClient
from kubetrt.operators.names import (ENV_POD_NAME, FINALIZER, GROUP, KIND_ENGINE_BUILD, KIND_MODEL_DEPLOYMENT,
                                     LABEL_APP_COMPONENT, LABEL_APP_MANAGED_BY, LABEL_BUILD, LABEL_MD, MANAGED_BY,
                                     PLURAL_ENGINE_BUILDS, PLURAL_MODEL_DEPLOYMENTS, VERSION)
from kubetrt.operators.objects import OperatorConfig

log = logging.getLogger("kubetrt.operators")
MD = (GROUP, VERSION, PLURAL_MODEL_DEPLOYMENTS)
EB = (GROUP, VERSION, PLURAL_ENGINE_BUILDS)
MANAGED = {LABEL_APP_MANAGED_BY: MANAGED_BY}


def peering_priority(env: Mapping[str, str] | None = None) -> int:
    """Distinct priority per replica (from the pod name) so exactly one replica acts, the rest wait.

    kopf pauses operators that see a higher-priority peer; equal priorities would both run.
    KUBETRT_PEERING_PRIORITY overrides it (e.g. 1000 for a debugging session that should win).
    """
    env = os.environ if env is None else env
    if env.get("KUBETRT_PEERING_PRIORITY"):
        return int(env["KUBETRT_PEERING_PRIORITY"])
    ident = env.get(ENV_POD_NAME) or env.get("HOSTNAME") or "kubetrt"
    return int(hashlib.sha256(ident.encode()).hexdigest()[:7], 16) % 100_000


def post_event(obj: Mapping[str, Any], event: reconcile.Event) -> None:
    """Record ``event`` on ``obj`` as a Kubernetes Event through kopf's poster (it runs in the
    operator's loop; kopf.event may be called from the sync handlers' threads)."""
    sync.log_event(obj, event)
    kopf.event(cast(kopf.Body, dict(obj)), type=event.type, reason=event.reason, message=event.message[:1024])


def _owner(meta: Mapping[str, Any], kind: str) -> str | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == kind and str(ref.get("apiVersion", "")).startswith(GROUP + "/"):
            return str(ref["name"])
    return None


def register(registry: kopf.OperatorRegistry) -> None:
    """Register the handlers into ``registry`` (the default one on import; tests use their own)."""

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        settings.posting.level = logging.WARNING  # k8s Events only for problems: quiet by default
        settings.peering.priority = peering_priority()
        settings.persistence.finalizer = FINALIZER
        if "config" not in memo:
            memo.config = OperatorConfig.from_env()
        if "kube" not in memo:
            memo.kube = KubeClient.from_environment()

    # ModelDeployment: its own lifecycle.
    @kopf.on.resume(*MD, registry=registry)
    @kopf.on.create(*MD, registry=registry)
    @kopf.on.update(*MD, field="spec", registry=registry)
    def model_deployment_changed(namespace: str | None, name: str, spec: kopf.Spec, memo: kopf.Memo,
                                 **_: Any) -> None:
        st = sync.sync_model_deployment(memo.kube, memo.config, _namespaced(namespace), name, post_event)
        # A canary analysis decides on time passing, which no watch event reports: kopf retries
        # this handler until the spec's revision is promoted or rolled back.
        if st is not None and reconcile.rollout_unsettled(dict(spec), st):
            raise kopf.TemporaryError("canary analysis in progress", delay=reconcile.ANALYSIS_PERIOD_SECONDS)

    # EngineBuild: ensure its Job; every change of it (status included) re-syncs its ModelDeployment.
    @kopf.on.event(*EB, registry=registry)
    def engine_build_event(type: str | None, body: kopf.Body, namespace: str | None, name: str,
                           memo: kopf.Memo, **_: Any) -> None:
        namespace = _namespaced(namespace)
        if type != "DELETED":
            sync.sync_engine_build(memo.kube, memo.config, namespace, name, post_event)
        owner = body.get("spec", {}).get("modelDeployment", {}).get("name") or _owner(body.meta, KIND_MODEL_DEPLOYMENT)
        if owner:
            sync.sync_model_deployment(memo.kube, memo.config, namespace, owner, post_event)

    # Children: build Jobs move their EngineBuild; serving Deployments move their ModelDeployment.
    @kopf.on.event("batch", "v1", "jobs", labels=MANAGED, registry=registry)
    def job_event(meta: kopf.Meta, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
        owner = _owner(meta, KIND_ENGINE_BUILD)
        if owner:
            sync.sync_engine_build(memo.kube, memo.config, _namespaced(namespace), owner, post_event)

    @kopf.on.event("apps", "v1", "deployments", labels=MANAGED, registry=registry)
    def deployment_event(meta: kopf.Meta, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
        owner = _owner(meta, KIND_MODEL_DEPLOYMENT)
        if owner:
            sync.sync_model_deployment(memo.kube, memo.config, _namespaced(namespace), owner, post_event)

    # Pods: a Job or Deployment does not change when its pod cannot be scheduled, pulled or made
    # ready; the pod's own events carry those reasons into the build's and the target's status.
    @kopf.on.event("", "v1", "pods", labels=MANAGED, registry=registry)
    def pod_event(type: str | None, meta: kopf.Meta, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
        labels = meta.get("labels") or {}
        namespace = _namespaced(namespace)
        if labels.get(LABEL_BUILD):
            sync.sync_engine_build(memo.kube, memo.config, namespace, labels[LABEL_BUILD], post_event)
        elif labels.get(LABEL_APP_COMPONENT) == "serving" and labels.get(LABEL_MD):
            sync.sync_model_deployment(memo.kube, memo.config, namespace, labels[LABEL_MD], post_event)



def _namespaced(namespace: str | None) -> str:
    """kopf types the namespace optional for cluster-scoped kinds; every kind handled here is namespaced."""
    if namespace is None:
        raise kopf.PermanentError("expected a namespaced object (ModelDeployment, EngineBuild, Job, Deployment)")
    return namespace


register(kopf.get_default_registry())
