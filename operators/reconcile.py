"""Reconcile (pure): from a ModelDeployment / EngineBuild and the observed children to a plan.

A plan says which objects must exist with which content, which must go, and the new status.
Applying it is the adapter's job (operators/sync.py); applying the plan of an unchanged world is a
no-op because every applied object carries the hash of its desired content.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from kubetrt.operators import analysis, objects, pods as podinfo, rollout, status
from kubetrt.operators.names import (ANN_ENGINE_BUILD, ANN_SPEC_HASH, API_VERSION, HTTP_ROUTE_API, KIND_ENGINE_BUILD,
                                     LABEL_TARGET, LABEL_TRACK, SCALED_OBJECT_API, TRACK_CANARY, TRACK_STABLE,
                                     canary_name)
from kubetrt.operators.objects import Obj, OperatorConfig
from kubetrt.runtime.target import TargetError


@dataclass
class Observed:
    """Children of one ModelDeployment as read from the API, keyed by name."""

    engine_builds: dict[str, Obj] = field(default_factory=dict)
    deployments: dict[str, Obj] = field(default_factory=dict)
    services: dict[str, Obj] = field(default_factory=dict)
    autoscalers: dict[str, Obj] = field(default_factory=dict)
    disruption_budgets: dict[str, Obj] = field(default_factory=dict)
    service_monitors: dict[str, Obj] | None = None  # None: the Prometheus Operator's CRD is not installed
    http_routes: dict[str, Obj] | None = None  # None: the Gateway API's HTTPRoute CRD is not installed
    scaled_objects: dict[str, Obj] | None = None  # None: KEDA's ScaledObject CRD is not installed
    pods: list[Obj] = field(default_factory=list)  # serving pods
    nodes: list[Obj] | None = None  # read only while a serving pod is unschedulable
    canary_metrics: list[str] | None = None  # the ready canary pods' /metrics, read only during an analysis
    metrics_error: str | None = None  # why they could not be read


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event to record on the object a plan is for (Normal or Warning)."""

    type: str
    reason: str
    message: str


@dataclass
class Plan:
    """What to change: ``apply`` objects (create or replace if their hash differs), ``create`` objects
    (create if absent, never update: EngineBuild specs are immutable), ``delete`` (apiVersion, kind,
    name) and the new ``status``."""

    apply: list[Obj] = field(default_factory=list)
    create: list[Obj] = field(default_factory=list)
    delete: list[tuple[str, str, str]] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    # The status carries a promotion or rollback decided by this plan: write it before acting on it,
    # so a plan made again from a fresh read (a 409) decides nothing different.
    decided: bool = False


def _verified(eb: Mapping[str, Any] | None) -> bool:
    st = (eb or {}).get("status") or {}
    return st.get("phase") == "Succeeded" and bool(st.get("verified")) and bool(st.get("engineKey"))


def needs_apply(desired: Mapping[str, Any], observed: Mapping[str, Any] | None) -> bool:
    """True when the observed object is absent or was applied from different desired content."""
    if observed is None:
        return True
    want = desired["metadata"]["annotations"][ANN_SPEC_HASH]
    have = ((observed.get("metadata") or {}).get("annotations") or {}).get(ANN_SPEC_HASH)
    return want != have


def plan_model_deployment(md: Mapping[str, Any], observed: Observed, config: OperatorConfig, now: str) -> Plan:
    """Desired children and status of a ModelDeployment.

    Per target: the EngineBuild for the current spec must exist. The Deployment serves the engine
    of that build once it verified; until then it keeps serving the engine it already has (the
    build named in its annotation), so an unverified engine never reaches pods. Builds that are
    neither current nor serving are deleted; so are children of targets that were removed.
    """
    spec = objects.normalized_spec(md)
    md_name = md["metadata"]["name"]
    plan = Plan()
    errors = objects.validate_spec(spec)
    if errors:
        plan.status = status.model_deployment_status(md, spec, [], errors, config, now)
        return plan

    pct = rollout.canary_percent(spec)
    old_status = md.get("status") or {}
    want_rev = rollout.spec_revision(spec)
    analysis_spec = (spec.get("rollout") or {}).get("canaryAnalysis") if pct is not None else None
    rolled_back = dict(old_status.get("rolledBack") or {})
    held_back = analysis_spec is not None and rolled_back.get("revision") == want_rev
    if old_status.get("promotedRevision") == want_rev:
        pct = None  # its canary passed: the stable Deployments take it
    views: list[status.TargetView] = []
    keep_builds: set[str] = set()
    keep_deployments: set[str] = set()
    keep_autoscalers: set[str] = set()
    keep_budgets: set[str] = set()
    keep_scalers: set[str] = set()
    choice = (objects.autoscaling_choice(spec["autoscaling"], observed.scaled_objects is not None, config.prometheus_url)
              if spec["autoscaling"]["enabled"] else None)
    for raw_target in spec["targets"]:
        target = objects.resolve_target(spec, raw_target)
        eb = objects.engine_build(md, spec, target, config)
        eb_name = eb["metadata"]["name"]
        current = observed.engine_builds.get(eb_name)
        if current is None:
            plan.create.append(eb)
        keep_builds.add(eb_name)

        dep_name = objects.deployment_name(md_name, target["name"])
        can_name = canary_name(dep_name)
        dep_observed = observed.deployments.get(dep_name)
        can_observed = observed.deployments.get(can_name)
        in_use: Mapping[str, Any] | None = None
        if dep_observed is not None:
            in_use_name = ((dep_observed.get("metadata") or {}).get("annotations") or {}).get(ANN_ENGINE_BUILD)
            if in_use_name and _verified(observed.engine_builds.get(in_use_name)):
                in_use = observed.engine_builds[in_use_name]
        serving, canary = _serving_builds(current, in_use, pct, held_back)
        total = int(target.get("replicas", 1))
        if spec["autoscaling"]["enabled"]:
            total = max(spec["autoscaling"]["minReplicas"], 1)
        stable_replicas: int | None = None
        canary_replicas = 0
        if canary is not None and pct is not None:
            if spec["autoscaling"]["enabled"]:
                have = int(((dep_observed or {}).get("spec") or {}).get("replicas") or total)
                canary_replicas = rollout.canary_beside(have, pct)
            else:
                stable_replicas, canary_replicas = rollout.split_replicas(total, pct)
                if not status.deployment_done(can_observed, canary_replicas):
                    stable_replicas = None  # the stable revision gives up replicas once the canary's are ready
        desired_replicas = stable_replicas if stable_replicas is not None else total
        dep_current = False
        stable_done = False
        if serving is not None:
            keep_builds.add(serving["metadata"]["name"])
            dep = objects.with_spec_hash(objects.serving_deployment(md, spec, target, serving, config,
                                                                    replicas=stable_replicas))
            keep_deployments.add(dep_name)
            dep_current = not needs_apply(dep, dep_observed)
            if not dep_current:
                plan.apply.append(dep)
            stable_done = dep_current and status.deployment_done(dep_observed, desired_replicas)
            if choice is not None and choice.mechanism == objects.KEDA:
                scaler = objects.with_spec_hash(objects.scaled_object(md, spec, target, config.prometheus_url))
                keep_scalers.add(scaler["metadata"]["name"])
                if needs_apply(scaler, (observed.scaled_objects or {}).get(scaler["metadata"]["name"])):
                    plan.apply.append(scaler)
            elif choice is not None:
                hpa = objects.with_spec_hash(objects.autoscaler(md, spec, target))
                keep_autoscalers.add(hpa["metadata"]["name"])
                if needs_apply(hpa, observed.autoscalers.get(hpa["metadata"]["name"])):
                    plan.apply.append(hpa)
        elif dep_observed is not None:
            keep_deployments.add(dep_name)  # nothing verified to serve yet: leave what runs alone
        if config.pod_disruption_budgets:
            pdb = objects.with_spec_hash(objects.pod_disruption_budget(md, target))
            keep_budgets.add(pdb["metadata"]["name"])
            if needs_apply(pdb, observed.disruption_budgets.get(pdb["metadata"]["name"])):
                plan.apply.append(pdb)
        can_current = False
        if canary is not None:
            can = objects.with_spec_hash(objects.serving_deployment(md, spec, target, canary, config,
                                                                    track=TRACK_CANARY, replicas=canary_replicas))
            keep_deployments.add(can_name)
            can_current = not needs_apply(can, can_observed)
            if not can_current:
                plan.apply.append(can)
        elif (can_observed is not None and current is not None and serving is current and not stable_done
              and rollout.deployment_revision(can_observed) == rollout.revision_of(current["spec"]["model"])):
            keep_deployments.add(can_name)  # promoted: it serves until the stable Deployment runs its revision
        pods = [p for p in observed.pods if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_TARGET)
                == target["name"]]
        views.append(status.TargetView(target=target, build=current, serving=serving, deployment=dep_observed,
                                       deployment_current=dep_current, desired_replicas=desired_replicas,
                                       pods=pods, nodes=observed.nodes, canary=canary,
                                       canary_deployment=observed.deployments.get(can_name) if canary else None,
                                       canary_current=can_current, canary_replicas=canary_replicas))

    main_role = main_service_role(views)
    services = [objects.service(md, main_role)]
    if any(objects.role(v.target) == objects.ROLE_FALLBACK for v in views):
        services.append(objects.service(md, objects.ROLE_FALLBACK, objects.fallback_service_name(md_name)))
    canary_weight = rollout.route_weight(pct, [v.canary_current and status.deployment_done(
        v.canary_deployment, v.canary_replicas) for v in views if v.canary is not None])
    if observed.http_routes is not None:
        services += [objects.track_service(md, track, main_role) for track in (TRACK_STABLE, TRACK_CANARY)]
    for svc in map(objects.with_spec_hash, services):
        if needs_apply(svc, observed.services.get(svc["metadata"]["name"])):
            plan.apply.append(svc)
    if observed.http_routes is not None:  # after its backends' Services
        route = objects.with_spec_hash(objects.http_route(md, spec, canary_weight))
        if needs_apply(route, observed.http_routes.get(route["metadata"]["name"])):
            plan.apply.append(route)
        plan.delete += [(*HTTP_ROUTE_API[:2], n) for n in sorted(observed.http_routes)
                        if n != route["metadata"]["name"]]
    keep_services = {s["metadata"]["name"] for s in services}
    if observed.service_monitors is not None:
        monitor = objects.with_spec_hash(objects.service_monitor(md))
        if needs_apply(monitor, observed.service_monitors.get(monitor["metadata"]["name"])):
            plan.apply.append(monitor)
        plan.delete += [(*objects.SERVICE_MONITOR_API, n) for n in sorted(observed.service_monitors)
                        if n != monitor["metadata"]["name"]]

    plan.delete += [(API_VERSION, KIND_ENGINE_BUILD, n) for n in sorted(observed.engine_builds)
                    if n not in keep_builds]
    plan.delete += [("apps/v1", "Deployment", n) for n in sorted(observed.deployments) if n not in keep_deployments]
    plan.delete += [("autoscaling/v2", "HorizontalPodAutoscaler", n) for n in sorted(observed.autoscalers)
                    if n not in keep_autoscalers]
    plan.delete += [("v1", "Service", n) for n in sorted(observed.services) if n not in keep_services]
    plan.delete += [("policy/v1", "PodDisruptionBudget", n) for n in sorted(observed.disruption_budgets)
                    if n not in keep_budgets]
    plan.delete += [(*SCALED_OBJECT_API[:2], n) for n in sorted(observed.scaled_objects or {}) if n not in keep_scalers]
    plan.status = status.model_deployment_status(md, spec, views, [], config, now)
    plan.status["traffic"] = rollout.traffic_status(md_name, spec, observed.http_routes is not None, canary_weight)
    plan.status["autoscaling"] = (None if choice is None else
                                  {"mechanism": choice.mechanism, "message": choice.reason})
    canary_state: dict[str, Any] | None = None
    if analysis_spec is not None and not held_back:
        canary_state, judged = judge_canary(analysis_spec, views, observed, old_status, want_rev, now)
        if judged is not None and judged.state in (analysis.PASS, analysis.FAIL):
            # Decided: plan again from the decision, so this very plan promotes or rolls back.
            decided = dict(old_status)
            if judged.state == analysis.PASS:
                decided["promotedRevision"] = want_rev
            else:
                decided["rolledBack"] = {"revision": want_rev, "reason": judged.reason, "message": judged.message}
            again = plan_model_deployment({**md, "status": decided}, observed, config, now)
            again.status["canary"] = {"revision": want_rev, **(canary_state or {}), "verdict": judged.state,
                                      "message": judged.message}
            again.events = model_deployment_events(old_status, again.status)
            again.decided = True
            return again
    # While a revision is rolled back, a failed build of the spec's revision is that rollback's cause.
    other_trouble = any(status.problem(v) and status.build_phase(v.build) != "Failed" for v in views)
    _rollout_status(plan.status, canary_state, old_status, rolled_back if held_back else None, want_rev, now,
                    other_trouble)
    plan.events = model_deployment_events(old_status, plan.status)
    return plan


ANALYSIS_PERIOD_SECONDS = 5.0  # how often an unsettled canary analysis is judged again


def rollout_unsettled(spec: Mapping[str, Any], st: Mapping[str, Any]) -> bool:
    """Whether a canary analysis still has to decide: the spec's revision is neither what the stable
    Deployments serve nor rolled back (the handler then syncs again every ANALYSIS_PERIOD_SECONDS)."""
    spec = objects.normalized_spec({"spec": spec})
    if rollout.canary_percent(spec) is None or not (spec.get("rollout") or {}).get("canaryAnalysis"):
        return False
    want = rollout.spec_revision(spec)
    return st.get("currentRevision") not in (want, None) and (st.get("rolledBack") or {}).get("revision") != want


def _seconds(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def judge_canary(spec: Mapping[str, Any], views: Sequence[status.TargetView], observed: Observed,
                 old_status: Mapping[str, Any], want_rev: str, now: str
                 ) -> tuple[dict[str, Any] | None, analysis.Verdict | None]:
    """The canary analysis of revision ``want_rev``: (``status.canary``, verdict). A failed engine
    build of the new revision (its golden check) or a stuck canary pod fails it at once; then its
    metrics decide, from the moment every canary pod is ready."""
    for v in views:
        bst = (v.build or {}).get("status") or {}
        if (bst.get("phase") == "Failed" and v.serving is not None
                and rollout.revision_of(v.serving["spec"]["model"]) != want_rev):
            reason = "GoldenCheckFailed" if bst.get("reason") == "VerificationFailed" else "EngineBuildFailed"
            return None, analysis.Verdict(analysis.FAIL, reason, f"target {v.target['name']}: the engine of "
                                          f"revision {want_rev} failed: {bst.get('reason')}: {bst.get('message', '')}")
    canaries = [v for v in views if v.canary is not None]
    if not canaries:
        return None, None
    for v in canaries:
        for pod in v.pods:
            meta = pod.get("metadata") or {}
            if (meta.get("labels") or {}).get(LABEL_TRACK) != TRACK_CANARY or meta.get("deletionTimestamp"):
                continue
            stuck = podinfo.pod_problem(pod, v.nodes)
            if stuck is not None:
                return None, analysis.Verdict(analysis.FAIL, stuck.reason,
                                              f"canary pod {meta.get('name')}: {stuck.message}")
    state: dict[str, Any] = {"revision": want_rev, "verdict": analysis.WAIT}
    if not all(v.canary_current and status.deployment_done(v.canary_deployment, v.canary_replicas) for v in canaries):
        return {**state, "message": "canary analysis: waiting for every canary pod to be ready"}, None
    old = old_status.get("canary") or {}
    since = str(old["readySince"]) if old.get("revision") == want_rev and old.get("readySince") else now
    state["readySince"] = since
    if observed.canary_metrics is None:
        return {**state, "message": f"canary analysis: metrics unavailable: {observed.metrics_error or 'not read'}"}, None
    try:
        measured = analysis.canary_metrics(observed.canary_metrics)
    except analysis.MetricsError as e:
        return {**state, "message": f"canary analysis: unreadable metrics: {e}"}, None
    judged = analysis.verdict(spec, measured, _seconds(now) - _seconds(since))
    return {**state, "verdict": judged.state, "message": judged.message}, judged


def _rollout_status(st: dict[str, Any], canary_state: Mapping[str, Any] | None, old: Mapping[str, Any],
                    rolled_back: Mapping[str, Any] | None, want_rev: str, now: str, other_trouble: bool = False) -> None:
    """The analysis' part of a status: ``canary`` (None clears it), the remembered decisions, and the
    RolledBack condition while the spec's revision is rolled back, which ``message`` then names
    (unless a target is degraded by something else: ``other_trouble``)."""
    decided = old.get("canary") or {}
    if canary_state:
        st["canary"] = dict(canary_state)
    elif decided.get("revision") == want_rev and decided.get("verdict") in (analysis.PASS, analysis.FAIL):
        st["canary"] = dict(decided)  # the analysis that decided the spec's revision stays readable
    else:
        st["canary"] = None
    for key in ("promotedRevision", "rolledBack"):
        if old.get(key):
            st[key] = old[key]
    if canary_state and canary_state.get("message"):
        for c in st["conditions"]:
            if c["type"] == "Progressing" and c.get("reason") == "Canary":
                c["message"] = canary_state["message"]
        st["message"] = status.summary(st["conditions"])
    if rolled_back:
        prev: Mapping[str, Any] = next((c for c in old.get("conditions") or [] if c.get("type") == "RolledBack"), {})
        st["conditions"].append({
            "type": "RolledBack", "status": "True", "reason": rolled_back.get("reason", "RolledBack"),
            "message": f"revision {rolled_back.get('revision')} rolled back ({rolled_back.get('reason', 'RolledBack')}): "
                       f"{rolled_back.get('message', '')}",
            "lastTransitionTime": prev.get("lastTransitionTime") if prev.get("status") == "True" else now})
        if not other_trouble:
            st["message"] = status.summary(st["conditions"], first="RolledBack")


def _serving_builds(current: Mapping[str, Any] | None, in_use: Mapping[str, Any] | None, pct: int | None,
                    held_back: bool = False) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """(stable, canary) builds of one target: the current spec's build once it verified, else the
    one the stable Deployment serves. A verified build of a new revision goes to a canary beside
    the stable revision while ``pct`` asks for a canary phase (none while that revision is
    ``held_back``: rolled back); otherwise it replaces the stable one (a rolling update that keeps
    every old pod until a new one is ready)."""
    if not _verified(current):
        return in_use, None
    assert current is not None
    if in_use is None or pct is None or rollout.revision_of(in_use["spec"]["model"]) == rollout.revision_of(
            current["spec"]["model"]):
        return current, None
    return in_use, (None if held_back else current)


def _ready_pods(view: status.TargetView) -> int:
    return int(((view.deployment or {}).get("status") or {}).get("readyReplicas") or 0)


def main_service_role(views: Sequence[status.TargetView]) -> str:
    """The role whose pods the model's Service selects: the primary targets', unless none of them
    has a ready pod and a fallback target has."""
    primary = [v for v in views if objects.role(v.target) == objects.ROLE_PRIMARY]
    fallback = [v for v in views if objects.role(v.target) == objects.ROLE_FALLBACK]
    if fallback and not any(_ready_pods(v) for v in primary) and any(_ready_pods(v) for v in fallback):
        return objects.ROLE_FALLBACK
    return objects.ROLE_PRIMARY


def _condition(st: Mapping[str, Any], ctype: str) -> Mapping[str, Any]:
    return next((c for c in st.get("conditions") or [] if c.get("type") == ctype), {})


def model_deployment_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    """Events for what changed: a Warning when Degraded turns True or its message changes, a
    Normal event when it clears and when Ready turns True."""
    events = []
    was, now = _condition(old, "Degraded"), _condition(new, "Degraded")
    if now.get("status") == "True" and (was.get("status") != "True" or was.get("message") != now.get("message")):
        events.append(Event("Warning", str(now.get("reason") or "Degraded"), str(now.get("message") or "")))
    elif now.get("status") == "False" and was.get("status") == "True":
        events.append(Event("Normal", "Recovered", "no target is failing any more"))
    back_was, back_now = old.get("rolledBack") or {}, new.get("rolledBack") or {}
    if back_now and back_now != back_was:
        events.append(Event("Warning", "RolledBack", f"revision {back_now.get('revision')} rolled back: "
                            f"{back_now.get('reason')}: {back_now.get('message')}"))
    if new.get("promotedRevision") and new.get("promotedRevision") != old.get("promotedRevision"):
        events.append(Event("Normal", "Promoted", f"revision {new['promotedRevision']} promoted: "
                            f"{(new.get('canary') or {}).get('message', '')}"))
    for key, reason in (("autoscaling", "Autoscaling"), ("traffic", "Traffic")):
        was_mech, now_mech = (old.get(key) or {}).get("mechanism"), (new.get(key) or {}).get("mechanism")
        if now_mech and now_mech != was_mech and (was_mech or key == "autoscaling"):
            events.append(Event("Normal", reason, f"{now_mech}: {(new.get(key) or {}).get('message', '')}"))
    ready_was, ready_now = _condition(old, "Ready"), _condition(new, "Ready")
    if ready_now.get("status") == "True" and ready_was.get("status") != "True":
        events.append(Event("Normal", "Ready", str(ready_now.get("message") or "")))
    return events


def engine_build_events(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Event]:
    """Events for a build's transitions: a Warning when it gets stuck (pods.PROBLEM_REASONS) or
    fails, a Normal event when its engine verified."""
    if (old.get("phase"), old.get("reason"), old.get("message")) == (new.get("phase"), new.get("reason"),
                                                                     new.get("message")):
        return []
    reason, message = str(new.get("reason") or ""), str(new.get("message") or "")
    if new.get("phase") == "Failed" or reason in podinfo.PROBLEM_REASONS:
        return [Event("Warning", reason or "BuildFailed", message)]
    if new.get("phase") == "Succeeded" and old.get("phase") != "Succeeded":
        return [Event("Normal", "Verified", message)]
    return []


@dataclass
class BuildPlan:
    """For one EngineBuild: the Job to create (if absent) and the new status."""

    create_job: Obj | None
    status: dict[str, Any]
    events: list[Event] = field(default_factory=list)


def plan_engine_build(eb: Mapping[str, Any], job: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]],
                      config: OperatorConfig, nodes: Sequence[Mapping[str, Any]] | None = None) -> BuildPlan:
    """A build's Job exists until the build is terminal; its status follows the Job and its pods.

    A target the runtime cannot build (only a hand-written EngineBuild can hold one: the operator
    validates the targets of a ModelDeployment) fails the build without a Job.
    """
    old = eb.get("status") or {}
    new_status = status.engine_build_status(eb, job, pods, nodes)
    plan = BuildPlan(create_job=None, status=new_status)
    if job is None and new_status.get("phase") not in status.TERMINAL_PHASES:
        try:
            plan.create_job = objects.build_job(eb, config)
        except TargetError as e:
            plan.status = {**new_status, "phase": "Failed", "verified": False, "reason": "InvalidTarget",
                           "message": str(e)}
    plan.events = engine_build_events(old, plan.status)
    return plan


def status_changed(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` would change anything the operator owns in ``old``."""
    old = old or {}
    return any(old.get(k) != v for k, v in new.items())
