"""Status computation (pure): EngineBuild status from its Job, ModelDeployment status from its parts."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from kubetrt.operators import objects, pods as podinfo, rollout
from kubetrt.operators.names import LABEL_BUILD, LABEL_TARGET, SERVING_PORT, TRACK_CANARY, TRACK_STABLE

TERMINAL_PHASES = ("Succeeded", "Failed")
MESSAGE_LIMIT = 1024


# ----------------------------------------------------------------------------- EngineBuild
def parse_build_result(message: str | None) -> dict[str, Any] | None:
    """Parse the JSON the build writes to /dev/termination-log (the whole text, or its last line)."""
    if not message or not message.strip():
        return None
    for candidate in (message.strip(), message.strip().splitlines()[-1]):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def termination_message(pods: Sequence[Mapping[str, Any]], container: str = "build") -> str | None:
    """The newest terminated message of ``container`` among the Job's pods, if any."""
    found: list[tuple[str, str]] = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") != container:
                continue
            for state in (cs.get("state") or {}, cs.get("lastState") or {}):
                term = state.get("terminated") or {}
                if term.get("message"):
                    found.append((str(term.get("finishedAt") or ""), term["message"]))
    return max(found)[1] if found else None


def _finished_at(pods: Sequence[Mapping[str, Any]], container: str = "build") -> str:
    """When the newest terminated ``container`` of the pods finished ("" if none says)."""
    stamps = [str(((cs.get("state") or {}).get("terminated") or {}).get("finishedAt") or "")
              for p in pods for cs in (p.get("status") or {}).get("containerStatuses") or [] if cs.get("name") == container]
    return max(stamps, default="")


def _tail(text: str | None) -> str:
    text = (text or "").strip()
    return text if len(text) <= MESSAGE_LIMIT else "…" + text[-MESSAGE_LIMIT:]


def engine_build_status(eb: Mapping[str, Any], job: Mapping[str, Any] | None,
                        pods: Sequence[Mapping[str, Any]],
                        nodes: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Status of an EngineBuild from its Job and the Job's pods; terminal phases are final.

    A Job counts a pod that cannot be scheduled, pulled or configured as active: such a build is
    Pending with the pod's reason (pods.pod_problem), so it does not read as running until its
    deadline. ``nodes`` (read only for an unschedulable pod) name the node label none has."""
    old = dict(eb.get("status") or {})
    if old.get("phase") in TERMINAL_PHASES:
        return old
    base: dict[str, Any] = {"jobName": eb["metadata"]["name"]}
    if eb["metadata"].get("generation") is not None:
        base["observedGeneration"] = eb["metadata"]["generation"]
    if job is None:
        return {**base, "phase": "Pending", "reason": "JobCreating", "message": "creating the build Job"}
    js = job.get("status") or {}
    if js.get("startTime"):
        base["startTime"] = js["startTime"]
    true_conditions = {c.get("type"): c for c in js.get("conditions") or [] if c.get("status") == "True"}
    message = termination_message(pods)
    if "Complete" in true_conditions or int(js.get("succeeded") or 0) >= 1:
        done = {**base, "completionTime": js.get("completionTime") or true_conditions.get("Complete", {}).get(
            "lastTransitionTime", "")}
        result = parse_build_result(message)
        if result is None:
            return {**done, "phase": "Failed", "verified": False, "reason": "NoBuildResult",
                    "message": "the build Job succeeded but wrote no JSON result to /dev/termination-log"}
        raw_report = result.get("report")
        report: dict[str, Any] = dict(raw_report) if isinstance(raw_report, dict) else {}
        summary = str(report.get("summary") or result.get("summary") or "")
        report["summary"] = summary
        if not result.get("verified"):
            return {**done, "phase": "Failed", "verified": False, "reason": "VerificationFailed",
                    "engineKey": str(result.get("engineKey") or ""), "report": report,
                    "message": _tail(summary or "the engine did not match the golden outputs")}
        if not result.get("engineKey"):
            return {**done, "phase": "Failed", "verified": False, "reason": "NoEngineKey",
                    "report": report, "message": "the build result names no engineKey"}
        return {**done, "phase": "Succeeded", "verified": True, "reason": "Verified",
                "engineKey": str(result["engineKey"]), "report": report,
                "message": _tail(summary or "engine built and verified")}
    failed = true_conditions.get("Failed")
    refused = parse_build_result(message)
    if refused is not None and refused.get("verified") is False:
        # A build pod ran and refused its engine: the model itself is wrong (its golden check failed)
        # and a retry would refuse it again, so the build fails at the first refusal, whether or not
        # the Job has given up yet.
        summary = str((refused.get("report") or {}).get("summary") or "the engine did not match the golden outputs")
        return {**base, "phase": "Failed", "verified": False, "reason": "VerificationFailed",
                "completionTime": failed.get("lastTransitionTime", "") if failed else _finished_at(pods),
                "message": _tail(summary)}
    if failed is not None:
        return {**base, "phase": "Failed", "verified": False, "reason": failed.get("reason") or "JobFailed",
                "completionTime": failed.get("lastTransitionTime", ""),
                "message": _tail(message or failed.get("message") or "the build Job failed")}
    live = [p for p in pods if ((p.get("status") or {}).get("phase") or "Pending") in ("Pending", "Running")]
    problems = [pr for pr in (podinfo.pod_problem(p, nodes) for p in live) if pr is not None]
    if problems and len(problems) == len(live):
        return {**base, "phase": "Pending", "reason": problems[0].reason, "message": problems[0].message}
    if any((p.get("status") or {}).get("phase") == "Running" for p in live) or (
            int(js.get("active") or 0) > 0 and not live):
        return {**base, "phase": "Running", "reason": "JobRunning", "message": "building and verifying the engine"}
    return {**base, "phase": "Pending", "reason": "JobPending", "message": "waiting for the build pod to be scheduled and start"}


# ----------------------------------------------------------------------------- ModelDeployment
@dataclass
class TargetView:
    """What the reconcile decided and observed for one target."""

    target: dict[str, Any]
    build: Mapping[str, Any] | None  # EngineBuild of the current spec (observed), if it exists
    serving: Mapping[str, Any] | None  # verified EngineBuild whose engine the pods serve
    deployment: Mapping[str, Any] | None  # observed Deployment
    deployment_current: bool  # observed Deployment already equals the desired one
    desired_replicas: int
    pods: Sequence[Mapping[str, Any]] = ()  # the target's serving pods
    nodes: Sequence[Mapping[str, Any]] | None = None  # read when one of them is unschedulable
    canary: Mapping[str, Any] | None = None  # verified EngineBuild of a new revision in its canary phase
    canary_deployment: Mapping[str, Any] | None = None  # its observed Deployment
    canary_current: bool = False
    canary_replicas: int = 0


def _build_problem(view: TargetView) -> str | None:
    bst = (view.build or {}).get("status") or {}
    if bst.get("phase") == "Failed":
        return f"engine build failed: {bst.get('reason', 'Failed')}: {bst.get('message', '')}".strip()
    if bst.get("phase") == "Pending" and bst.get("reason") in podinfo.PROBLEM_REASONS:
        return f"engine build pending: {bst.get('message') or bst['reason']}"
    return None


def _serving_problem(view: TargetView) -> str | None:
    """The reason of the first stuck serving pod of the current template (pods.pod_problem)."""
    for pod in view.pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        problem = podinfo.pod_problem(pod, view.nodes)
        if problem is not None:
            return f"serving pod {pod['metadata']['name']}: {problem.message}"
    return None


def problem(view: TargetView) -> str | None:
    """What keeps a target from serving that needs someone to act, or None."""
    return _build_problem(view) or _serving_problem(view)


def _unready(view: TargetView) -> str:
    """Why the rollout is not done: the first unready pod's reason."""
    for pod in view.pods:
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        reason = podinfo.unready_reason(pod, view.nodes)
        if reason:
            return f"rolling out: pod {pod['metadata']['name']}: {reason}"
    return "rolling out"


def build_phase(eb: Mapping[str, Any] | None) -> str:
    """An EngineBuild's phase (Pending until it has one)."""
    return str(((eb or {}).get("status") or {}).get("phase") or "Pending")


def deployment_done(dep: Mapping[str, Any] | None, want: int) -> bool:
    """Whether an observed Deployment has rolled out its template to ``want`` ready replicas."""
    if dep is None:
        return False
    st = dep.get("status") or {}
    gen = (dep.get("metadata") or {}).get("generation")
    if gen is not None and st.get("observedGeneration") is not None and st["observedGeneration"] < gen:
        return False
    return int(st.get("updatedReplicas") or 0) >= want and int(st.get("readyReplicas") or 0) >= want


def _rollout_done(view: TargetView) -> bool:
    if view.deployment is None or not view.deployment_current:
        return False
    if view.canary is not None and not (view.canary_current and deployment_done(view.canary_deployment,
                                                                                view.canary_replicas)):
        return False
    return deployment_done(view.deployment, view.desired_replicas)


def target_status(view: TargetView) -> dict[str, Any]:
    t = view.target
    st = (view.deployment or {}).get("status") or {}
    out: dict[str, Any] = {
        "name": t["name"],
        "gpuProduct": t.get("gpuProduct", ""),
        "engineKey": str(((view.serving or {}).get("status") or {}).get("engineKey") or ""),
        "engineBuild": (view.build or {}).get("metadata", {}).get("name", ""),
        "buildPhase": build_phase(view.build),
        "replicas": view.desired_replicas,
        "readyReplicas": int(st.get("readyReplicas") or 0),
        "role": objects.role(t),
    }
    stuck = problem(view)
    if stuck:
        out["message"] = stuck
    elif view.serving is None:
        out["message"] = f"waiting for a verified engine (build {out['buildPhase']})"
    elif not _rollout_done(view):
        out["message"] = _unready(view)
    else:
        out["message"] = ""
    return out


def _cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message}


def conditions(views: list[TargetView], errors: list[str]) -> list[dict[str, Any]]:
    """Ready, Progressing, Degraded and EnginesReady for the targets (see operators/README.md)."""
    if errors:
        msg = "; ".join(errors)
        return [_cond("Ready", False, "InvalidSpec", msg), _cond("Progressing", False, "InvalidSpec", msg),
                _cond("Degraded", True, "InvalidSpec", msg), _cond("EnginesReady", False, "InvalidSpec", msg)]
    failed = [v for v in views if build_phase(v.build) == "Failed"]
    building = [v for v in views if build_phase(v.build) in ("Pending", "Running")]
    verified = [v for v in views if build_phase(v.build) == "Succeeded"]
    rolling = [v for v in views if v.serving is not None and not _rollout_done(v)]
    names = lambda vs: ", ".join(v.target["name"] for v in vs)  # noqa: E731

    if len(verified) == len(views):
        engines = _cond("EnginesReady", True, "AllEnginesVerified", f"{len(views)} engine(s) verified")
    elif failed:
        engines = _cond("EnginesReady", False, "EngineBuildFailed", f"build failed for: {names(failed)}")
    else:
        engines = _cond("EnginesReady", False, "EnginesBuilding", f"building engines for: {names(building)}")

    troubled = [(v, problem(v)) for v in views if problem(v)]
    if troubled:
        reasons = {_problem_reason(v) for v, _ in troubled}
        reason = reasons.pop() if len(reasons) == 1 else "TargetsFailing"
        detail = "; ".join(f"target {v.target['name']}: {msg}" for v, msg in troubled)
        degraded = _cond("Degraded", True, reason, _tail(detail))
    else:
        degraded = _cond("Degraded", False, "AsExpected", "")

    canaries = [v for v in views if v.canary is not None]
    if building:
        progressing = _cond("Progressing", True, "EnginesBuilding", f"building engines for: {names(building)}")
    elif canaries and not rolling:
        progressing = _cond("Progressing", True, "Canary", "canary revision {} serving {} of {} pod(s) of: {}".format(
            rollout.revision_of(canaries[0].canary["spec"]["model"]),  # type: ignore[index]
            sum(v.canary_replicas for v in canaries), sum(v.canary_replicas + v.desired_replicas for v in canaries),
            names(canaries)))
    elif rolling:
        progressing = _cond("Progressing", True, "RollingOut", f"rolling out: {names(rolling)}")
    else:
        progressing = _cond("Progressing", False, "Stable", "")

    serving = [v for v in views if int(((v.deployment or {}).get("status") or {}).get("readyReplicas") or 0) > 0]
    pending = [v for v in views if v not in failed and not _rollout_done(v)]
    if serving and not pending:
        ready = _cond("Ready", True, "Serving", f"{len(serving)}/{len(views)} target(s) serving")
    elif serving:
        ready = _cond("Ready", False, "TargetsNotReady", f"not ready yet: {names(pending)}")
    else:
        ready = _cond("Ready", False, "NoReadyReplicas", "no target has ready replicas yet")
    return [ready, progressing, degraded, engines]


def _problem_reason(view: TargetView) -> str:
    bst = (view.build or {}).get("status") or {}
    if _build_problem(view):
        return str(bst.get("reason") or "EngineBuildFailed")
    for pod in view.pods:
        found = podinfo.pod_problem(pod, view.nodes)
        if found is not None:
            return found.reason
    return "TargetFailing"


def summary(conds: Sequence[Mapping[str, Any]], first: str = "Degraded") -> str:
    """One line for `kubectl get`: what is wrong, else the rollback that holds (its revision and
    cause), else what is in progress, else what serves; ``first`` the condition that goes first
    (RolledBack, when the only trouble is the rolled-back revision's failed build)."""
    by_type = {c["type"]: c for c in conds}
    for ctype in dict.fromkeys((first, "Degraded", "RolledBack", "Progressing")):
        cond = by_type.get(ctype) or {}
        if cond.get("status") == "True" and cond.get("message"):
            return str(cond["message"])
    return str((by_type.get("Ready") or {}).get("message") or "")


def merge_conditions(old: list[Mapping[str, Any]], new: list[dict[str, Any]], now: str,
                     generation: int | None) -> list[dict[str, Any]]:
    """Keep lastTransitionTime of conditions whose status did not change (so re-runs write nothing)."""
    previous = {c.get("type"): c for c in old or []}
    out = []
    for cond in new:
        prev = previous.get(cond["type"])
        stamp = prev.get("lastTransitionTime") if prev and prev.get("status") == cond["status"] else None
        merged = {**cond, "lastTransitionTime": stamp or now}
        if generation is not None:
            merged["observedGeneration"] = generation
        out.append(merged)
    return out


def revision_status(views: Sequence[TargetView]) -> dict[str, Any]:
    """``revisions``, ``currentRevision`` (what the stable Deployments serve) and ``canaryRevision``
    (a new revision in its canary phase; ``-`` when none, so printer columns never go blank)."""
    stable = [v.serving for v in views if v.serving is not None]
    canary = [v.canary for v in views if v.canary is not None]
    revs = rollout.revisions(stable, canary, [p for v in views for p in v.pods])
    pick = lambda role: next((r["name"] for r in revs if r["role"] == role), rollout.NO_REVISION)  # noqa: E731
    return {"revisions": revs, "currentRevision": pick(TRACK_STABLE), "canaryRevision": pick(TRACK_CANARY)}


def model_deployment_status(md: Mapping[str, Any], spec: Mapping[str, Any], views: list[TargetView],
                            errors: list[str], config: objects.OperatorConfig, now: str) -> dict[str, Any]:
    """The full status of a ModelDeployment."""
    meta = md["metadata"]
    gen = meta.get("generation")
    old = md.get("status") or {}
    svc = objects.service_name(meta["name"])
    endpoint = f"http://{svc}.{meta['namespace']}.svc.{config.cluster_domain}:{SERVING_PORT}"
    # The model URL names what the pods serve: while a new version builds, that is the old one.
    serving = next((v.serving for v in views if v.serving), None)
    model = (serving or {}).get("spec", {}).get("model") or spec.get("model") or {}
    conds = conditions(views, errors)
    status: dict[str, Any] = {
        "conditions": merge_conditions(old.get("conditions") or [], conds, now, gen),
        "targets": [target_status(v) for v in views],
        "endpoint": endpoint,
        "url": endpoint,
        "message": _tail(summary(conds)),
        "modelURL": f"{endpoint}/v2/models/{model.get('name', '')}/versions/{model.get('version', '1')}",
        "readyTargets": f"{sum(1 for v in views if _rollout_done(v))}/{len(views)}",
        **revision_status(views),
    }
    if gen is not None:
        status["observedGeneration"] = gen
    return status
