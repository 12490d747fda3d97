"""Why a pod does not run or is not ready, in words a user can act on (pure: pods and nodes in,
reasons out).

A Job counts a Pending pod as active and a Deployment an unready pod as progressing, so without
this a build that can never be scheduled, or a pod whose image cannot be pulled, looks like work in
progress until a deadline passes. The reasons come from what the scheduler and the kubelet write
into the pod's status; for an unschedulable pod the nodes say which of its node labels none has.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

UNSCHEDULABLE = "Unschedulable"
IMAGE_PULL_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
# Waiting reasons a container does not leave by waiting: the pod needs a change (image, Secret,
# ConfigMap, command) or keeps crashing.
STUCK_REASONS = (*IMAGE_PULL_REASONS, "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
                 "CrashLoopBackOff")
# Reasons of a build or a pod that needs someone to act (EngineBuild status, Degraded, Events).
PROBLEM_REASONS = (UNSCHEDULABLE, *STUCK_REASONS)
MESSAGE_LIMIT = 512


@dataclass(frozen=True)
class Problem:
    """Why one pod is stuck: a CamelCase reason and a message naming what to fix."""

    reason: str
    message: str


def _labels(node: Mapping[str, Any]) -> Mapping[str, str]:
    return (node.get("metadata") or {}).get("labels") or {}


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 1] + "…"


def unschedulable_message(pod: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]] | None,
                          scheduler_message: str) -> str:
    """"unschedulable: no node labelled KEY=VALUE" for the first of the pod's node labels no node
    has; the scheduler's own words where every label exists (taints, resources)."""
    selector = (pod.get("spec") or {}).get("nodeSelector") or {}
    if nodes is not None and selector:
        for key, value in sorted(selector.items()):
            if not any(_labels(n).get(key) == value for n in nodes):
                return f"unschedulable: no node labelled {key}={value}"
        if not any(all(_labels(n).get(k) == v for k, v in selector.items()) for n in nodes):
            wanted = ", ".join(f"{k}={v}" for k, v in sorted(selector.items()))
            return f"unschedulable: no node has all of the labels {wanted}"
    return _short(f"unschedulable: {scheduler_message or 'no node fits the pod'}")


def is_unschedulable(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == UNSCHEDULABLE
               for c in (pod.get("status") or {}).get("conditions") or [])


def _container_problem(cs: Mapping[str, Any]) -> Problem | None:
    waiting = (cs.get("state") or {}).get("waiting") or {}
    reason = str(waiting.get("reason") or "")
    if reason not in STUCK_REASONS:
        return None
    detail = str(waiting.get("message") or "")
    if reason in IMAGE_PULL_REASONS:
        return Problem(reason, _short(f"cannot pull image {cs.get('image', '')}: {detail or reason}"))
    if reason == "CrashLoopBackOff":
        last = ((cs.get("lastState") or {}).get("terminated") or {})
        said = str(last.get("message") or "").strip().splitlines()
        exit_code = last.get("exitCode", "?")
        return Problem(reason, _short(f"container {cs.get('name')} keeps exiting (code {exit_code})"
                                      + (f": {said[-1]}" if said else "")))
    return Problem(reason, _short(f"container {cs.get('name')}: {detail or reason}"))


def pod_problem(pod: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]] | None = None) -> Problem | None:
    """Why ``pod`` is stuck, or None while it may still start (or runs). ``nodes``, when read,
    name the label an unschedulable pod's nodeSelector asks for that no node has."""
    st = pod.get("status") or {}
    if st.get("phase") in ("Succeeded", "Failed"):
        return None
    for cond in st.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == UNSCHEDULABLE:
            return Problem(UNSCHEDULABLE, unschedulable_message(pod, nodes, str(cond.get("message") or "")))
    for cs in [*(st.get("initContainerStatuses") or []), *(st.get("containerStatuses") or [])]:
        problem = _container_problem(cs)
        if problem is not None:
            return problem
    return None


def unready_reason(pod: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]] | None = None) -> str | None:
    """Why a serving pod is not ready: stuck (pod_problem), else starting or failing its readiness
    probe (whose answer, /v2/health/ready, names the artifact at fault). None for a ready pod."""
    problem = pod_problem(pod, nodes)
    if problem is not None:
        return problem.message
    st = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    if ready:
        return None
    if st.get("phase") in ("Succeeded", "Failed"):
        return _short(f"pod {str(st['phase']).lower()}: {st.get('reason') or ''} {st.get('message') or ''}".strip())
    running = [cs for cs in st.get("containerStatuses") or [] if "running" in (cs.get("state") or {})]
    if running:
        return "not ready: its readiness probe (/v2/health/ready) fails: loading, or the package or engine is bad"
    return "starting"


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Whether the pod's Ready condition is True (the Service sends it requests)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])
