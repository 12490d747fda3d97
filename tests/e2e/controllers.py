"""The parts of a cluster nothing here runs, played by tests: the Job controller, the Deployment
controller and the kubelet (tests/e2e/kubelet.py) for the operator's build Jobs and serving Deployments.

Unlike tests/operators (which write a made-up build result), the build pod's terminated state
here is the real one: the operator's Job container is run with the kubelet, and what it wrote to
its termination log is what the Pod reports.
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import os
from typing import Any, Callable

from kubetrt.operators import names
from kubetrt.operators.kube import KubeClient
from operator_testlib import NS, ApiServerEmulator, eventually
from test_operator_integration import MD, objs

import kubelet

SERVING_URL = f"http://127.0.0.1:{names.SERVING_PORT}"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def owner_ref(obj: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def unfinished_jobs(api: ApiServerEmulator) -> dict[str, dict[str, Any]]:
    return {n: j for n, j in objs(api, "jobs").items()
            if not any(c.get("type") in ("Complete", "Failed") for c in (j.get("status") or {}).get("conditions") or [])}


async def wait_for_build_job(api: ApiServerEmulator, timeout: float = 20.0) -> dict[str, Any]:
    """The one build Job that has not finished yet (as created by the operator)."""
    jobs = await eventually(lambda: len(unfinished_jobs(api)) == 1 and unfinished_jobs(api), timeout=timeout,
                            describe=lambda: list(objs(api, "jobs")))
    job = next(iter(jobs.values()))
    job.setdefault("apiVersion", "batch/v1")
    job.setdefault("kind", "Job")
    return job


async def start_build_pod(client: KubeClient, job: dict[str, Any]) -> tuple[dict[str, Any], kubelet.Container]:
    """Job controller + kubelet: the Job's pod starts (Job status active), its container runs."""
    name = job["metadata"]["name"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{name}-{os.urandom(3).hex()[:5]}", "namespace": NS,
                        "labels": {**job["spec"]["template"]["metadata"]["labels"],
                                   "batch.kubernetes.io/job-name": name, "job-name": name},
                        "ownerReferences": [owner_ref(job)]},
           "spec": copy.deepcopy(job["spec"]["template"]["spec"])}
    container = await asyncio.to_thread(kubelet.start, job, pod_name=pod["metadata"]["name"])
    await asyncio.to_thread(client.patch_status, "batch/v1", "Job", NS, name, {"active": 1, "startTime": now()})
    return pod, container


async def report_pod(client: KubeClient, pod: dict[str, Any], result: kubelet.Terminated) -> None:
    """kubelet: the pod with the container's real terminated state (exit code, termination message)."""
    pod = copy.deepcopy(pod)
    spec = pod["spec"]["containers"][0]
    pod["status"] = {"phase": "Succeeded" if result.exit_code == 0 else "Failed", "containerStatuses": [{
        "name": spec["name"], "ready": False, "restartCount": 0, "image": spec["image"],
        "state": {"terminated": {"exitCode": result.exit_code, "reason": result.reason, "message": result.message,
                                 **({"signal": result.signal} if result.signal else {}), "finishedAt": now()}}}]}
    await asyncio.to_thread(client.create, pod)


async def finish_job(client: KubeClient, job: dict[str, Any], ok: bool) -> None:
    """Job controller: Complete after a succeeded pod, or Failed (BackoffLimitExceeded)."""
    stamp = now()
    if ok:
        status = {"active": 0, "succeeded": 1, "completionTime": stamp,
                  "conditions": [{"type": "Complete", "status": "True", "lastTransitionTime": stamp}]}
    else:
        status = {"active": 0, "failed": 1, "conditions": [
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded", "lastTransitionTime": stamp,
             "message": "Job has reached the specified backoff limit"}]}
    await asyncio.to_thread(client.patch_status, "batch/v1", "Job", NS, job["metadata"]["name"], status)


async def finish_build_pod(client: KubeClient, job: dict[str, Any], pod: dict[str, Any],
                           result: kubelet.Terminated) -> None:
    """The pod terminated as the container did; the Job completes or (no retries here) fails."""
    await report_pod(client, pod, result)
    await finish_job(client, job, result.exit_code == 0)


async def run_build_job(client: KubeClient, api: ApiServerEmulator, timeout: float = 180.0) -> kubelet.Terminated:
    """Run the operator's unfinished build Job to completion with the kubelet and report it."""
    job = await wait_for_build_job(api)
    pod, container = await start_build_pod(client, job)
    result = await asyncio.to_thread(container.wait, timeout)
    await finish_build_pod(client, job, pod, result)
    return result


async def wait_for_deployment(api: ApiServerEmulator, name: str, check: Callable[[dict[str, Any]], bool] = bool,
                              timeout: float = 20.0) -> dict[str, Any]:
    dep = await eventually(lambda: (d := objs(api, "deployments").get(name)) is not None and check(d) and d,
                           timeout=timeout, describe=lambda: objs(api, "deployments").get(name))
    dep.setdefault("apiVersion", "apps/v1")
    dep.setdefault("kind", "Deployment")
    return dep


async def start_serving_pod(dep: dict[str, Any], ready_timeout: float = 120.0) -> kubelet.Container:
    """kubelet: the Deployment's pod runs; returns once its readiness probe (/v2/health/ready) passes."""
    container = await asyncio.to_thread(kubelet.start, dep)
    try:
        await asyncio.to_thread(kubelet.wait_http_ready, container, SERVING_URL + "/v2/health/ready", ready_timeout)
    except BaseException:
        await asyncio.to_thread(container.stop, 5)
        raise
    return container


async def mark_deployment_ready(client: KubeClient, api: ApiServerEmulator, name: str, replicas: int = 1) -> None:
    """Deployment controller: the current generation rolled out, all replicas updated and ready."""
    generation = objs(api, "deployments")[name]["metadata"].get("generation", 1)
    await asyncio.to_thread(client.patch_status, "apps/v1", "Deployment", NS, name, {
        "observedGeneration": generation, "replicas": replicas, "updatedReplicas": replicas,
        "readyReplicas": replicas, "availableReplicas": replicas,
        "conditions": [{"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"}]})
