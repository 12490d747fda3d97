"""Revisions and canary replica counts (pure).

A revision is one ``spec.model`` (version, digest, package): a change of any of them makes a new
one. Without a mesh the operator carries a canary's traffic share by replica counts: the model's
Service selects the pods of both revisions and spreads requests over their ready pods.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from kubetrt.operators.names import (ANN_ENGINE_KEY, ANN_MODEL_VERSION, LABEL_REVISION, TRACK_CANARY, TRACK_STABLE,
                                     dns_label, revision_id, track_service_name)

NO_REVISION = "-"  # printer-column value while a ModelDeployment has no stable or no canary revision
ROLE_PREVIOUS = "previous"  # pods of a revision no Deployment asks for any more (an in-place roll)


def revision_of(model: Mapping[str, Any]) -> str:
    """The revision of an EngineBuild's ``spec.model`` (version, packageURI, digest)."""
    identity = {k: model.get(k) for k in ("version", "packageURI", "digest") if model.get(k)}
    return revision_id(str(model.get("version") or "1"), identity)


def spec_revision(spec: Mapping[str, Any]) -> str:
    """The revision of a ModelDeployment spec's ``model`` (as its EngineBuilds will carry it)."""
    model = spec.get("model") or {}
    return revision_of({"version": model.get("version"), "packageURI": (model.get("source") or {}).get("uri"),
                        "digest": model.get("digest")})


def canary_percent(spec: Mapping[str, Any]) -> int | None:
    """``spec.rollout.canaryTrafficPercent`` when it asks for a canary phase; None when a new
    revision takes all traffic once ready (unset, or 100: KServe's promotion)."""
    pct = (spec.get("rollout") or {}).get("canaryTrafficPercent")
    if pct is None or int(pct) >= 100:
        return None
    return int(pct)


def split_replicas(total: int, percent: int) -> tuple[int, int]:
    """(stable, canary) replicas for a canary taking ``percent`` of ``total``.

    The canary gets ceil(total * percent / 100) replicas, at least 1; the stable revision keeps
    the rest, at least 1 while percent < 100 (so a single-replica target runs one of each)."""
    if not 0 < percent <= 100:
        raise ValueError(f"canaryTrafficPercent={percent}: expected 1..100")
    total = max(int(total), 1)
    canary = max(1, math.ceil(total * percent / 100))
    if percent >= 100:
        return 0, canary
    return max(1, total - canary), canary


def canary_beside(stable: int, percent: int) -> int:
    """Canary replicas beside a stable Deployment whose count an HPA owns (left as it is): the
    count that gives the canary ``percent`` of the pods, ceil(stable * percent / (100 - percent)),
    at least 1."""
    if not 0 < percent < 100:
        raise ValueError(f"canaryTrafficPercent={percent}: expected 1..99 beside an autoscaled stable revision")
    return max(1, math.ceil(max(int(stable), 1) * percent / (100 - percent)))


def route_weight(percent: int | None, canaries_ready: Sequence[bool]) -> int:
    """The canary backend's HTTPRoute weight: ``percent`` (canaryTrafficPercent, exact) once every
    target's canary Deployment has all its pods ready, else 0 (a Gateway would answer the canary's
    share with errors while it has no ready endpoint); 0 without a canary or once it is promoted."""
    if percent is None or not canaries_ready or not all(canaries_ready):
        return 0
    if not 0 < percent < 100:
        raise ValueError(f"canaryTrafficPercent={percent}: expected 1..99 during a canary")
    return int(percent)


TRAFFIC_ROUTE = "HTTPRoute"  # status.traffic.mechanism: a Gateway splits by the HTTPRoute's weights
TRAFFIC_REPLICAS = "ReplicaCounts"  # the Service spreads requests over both revisions' ready pods


def traffic_status(md_name: str, spec: Mapping[str, Any], route_served: bool, canary_weight: int) -> dict[str, Any]:
    """``status.traffic``: what carries a canary's share. The model's Service always splits by replica
    counts (in-cluster clients); an HTTPRoute attached to a Gateway (spec.rollout.gateway) carries the
    exact share for the traffic that comes through that Gateway."""
    service = dns_label(md_name)
    by_replicas = f"the Service {service} spreads requests over the ready pods of both revisions (replica counts)"
    if not route_served:
        return {"mechanism": TRAFFIC_REPLICAS,
                "message": f"{by_replicas}; no HTTPRoute: the Gateway API's HTTPRoute CRD is not served"}
    weights = f"{track_service_name(md_name, TRACK_STABLE)} {100 - canary_weight}"
    if canary_weight:
        weights += f", {track_service_name(md_name, TRACK_CANARY)} {canary_weight}"
    gateway = (spec.get("rollout") or {}).get("gateway") or {}
    out: dict[str, Any] = {"httpRoute": service, "stableWeight": 100 - canary_weight, "canaryWeight": canary_weight}
    if not gateway:
        return {**out, "mechanism": TRAFFIC_REPLICAS,
                "message": f"HTTPRoute {service} (weights {weights}) is attached to no Gateway: spec.rollout.gateway "
                           f"is unset; {by_replicas}"}
    parent = f"{gateway.get('namespace') or '(its namespace)'}/{gateway['name']}"
    if gateway.get("sectionName"):
        parent += f" listener {gateway['sectionName']}"
    return {**out, "mechanism": TRAFFIC_ROUTE,
            "message": f"HTTPRoute {service} on Gateway {parent}: weights {weights} (exact, for requests through "
                       f"the Gateway); in-cluster, {by_replicas}"}


def deployment_revision(dep: Mapping[str, Any] | None) -> str | None:
    """The revision a Deployment's pod template runs (None for none, or a pre-revision one)."""
    template = (((dep or {}).get("spec") or {}).get("template") or {}).get("metadata") or {}
    return (template.get("labels") or {}).get(LABEL_REVISION) or None


def _ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def revisions(stable: Sequence[Mapping[str, Any]], canary: Sequence[Mapping[str, Any]],
              pods: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``status.revisions``: the revisions of the verified EngineBuilds the stable and the canary
    Deployments serve, and of any pod still running another, each with its model version, engine
    keys, ready pods and traffic share (its share of the ready serving pods, which the Service
    spreads requests over), stable first."""
    found: dict[str, dict[str, Any]] = {}

    def entry(rev: str, role: str) -> dict[str, Any]:
        return found.setdefault(rev, {"name": rev, "role": role, "modelVersion": "", "engineKeys": set(),
                                      "readyReplicas": 0, "trafficPercent": 0})

    for role, builds in ((TRACK_STABLE, stable), (TRACK_CANARY, canary)):
        for build in builds:
            model = (build.get("spec") or {}).get("model") or {}
            e = entry(revision_of(model), role)
            e["modelVersion"] = str(model.get("version") or "")
            key = (build.get("status") or {}).get("engineKey")
            if key:
                e["engineKeys"].add(str(key))
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    ready_total = sum(1 for p in live if _ready(p) and (p["metadata"].get("labels") or {}).get(LABEL_REVISION))
    for pod in live:
        meta = pod.get("metadata") or {}
        rev = (meta.get("labels") or {}).get(LABEL_REVISION)
        if not rev:
            continue
        e = entry(rev, ROLE_PREVIOUS)
        ann = meta.get("annotations") or {}
        e["modelVersion"] = e["modelVersion"] or ann.get(ANN_MODEL_VERSION, "")
        if ann.get(ANN_ENGINE_KEY):
            e["engineKeys"].add(ann[ANN_ENGINE_KEY])
        if _ready(pod):
            e["readyReplicas"] += 1
    order = {TRACK_STABLE: 0, TRACK_CANARY: 1, ROLE_PREVIOUS: 2}
    out = []
    for e in sorted(found.values(), key=lambda e: (order[e["role"]], e["name"])):
        e["engineKeys"] = sorted(e["engineKeys"])
        e["trafficPercent"] = round(100 * e["readyReplicas"] / ready_total) if ready_total else 0
        out.append(e)
    return out
