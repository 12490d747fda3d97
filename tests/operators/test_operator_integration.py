"""The real kopf operator (kubetrt's handlers) against an emulated API server (kmock-based).

Nothing here runs kube-controller-manager or kubelets, so tests play their part at that boundary:
they write Job/Deployment status and the build pod's termination message as those would.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

import pytest
from kubernetes.client.exceptions import ApiException

from kubetrt.operators import names, objects, rbac
from kubetrt.operators.kube import KubeClient

from operator_testlib import NS, ApiServerEmulator, eventually

MD = ("kubetrt.io/v1alpha1", "ModelDeployment")
TEST_AGENT = "kubetrt-tests"


@pytest.fixture
def client(api: ApiServerEmulator) -> KubeClient:
    """The test's own client, told apart from the operator's requests by its User-Agent."""
    c = KubeClient.for_host(str(api.url).rstrip("/"))
    c.api.user_agent = TEST_AGENT
    return c


def objs(api: ApiServerEmulator, plural: str) -> dict[str, dict[str, Any]]:
    return {name: obj.raw for (res, ns, name), obj in list(api.objects.items())
            if res.plural == plural and not obj.deleted}


def engine_key_served(deployment: dict[str, Any]) -> str:
    """The --engine-key the serving container is started with."""
    cmd = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    return cmd[cmd.index("--engine-key") + 1]


def condition(api: ApiServerEmulator, name: str, ctype: str) -> dict[str, Any] | None:
    md = objs(api, "modeldeployments").get(name) or {}
    return next((c for c in (md.get("status") or {}).get("conditions", []) if c["type"] == ctype), None)


async def finish_build(client: KubeClient, api: ApiServerEmulator, target: str, *, ok: bool = True,
                       key: str = "") -> str:
    """Play the Job controller and kubelet for the target's unfinished build Job: its pod
    terminates, the Job completes or fails."""
    job_name = next(n for n, j in objs(api, "jobs").items()
                    if j["metadata"]["labels"][names.LABEL_TARGET] == target and not (j.get("status") or {}).get("conditions"))
    message = (json.dumps({"engineKey": key, "verified": True, "report": {"summary": "max abs err 2e-3"}}) if ok
               else "Traceback (most recent call last):\nRuntimeError: CUDA out of memory")
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{job_name}-abcde", "namespace": NS,
                        "labels": {names.LABEL_BUILD: job_name, "batch.kubernetes.io/job-name": job_name}},
           "spec": {"containers": [{"name": "build", "image": "x"}]},
           "status": {"phase": "Succeeded" if ok else "Failed", "containerStatuses": [{
               "name": "build", "state": {"terminated": {"exitCode": 0 if ok else 1, "message": message,
                                                         "finishedAt": "2026-01-01T00:10:00Z"}}}]}}
    await asyncio.to_thread(client.create, pod)
    cond = ({"type": "Complete", "status": "True"} if ok else
            {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
             "message": "Job has reached the specified backoff limit"})
    job_status = {"succeeded": 1} if ok else {"failed": 3}
    await asyncio.to_thread(client.patch_status, "batch/v1", "Job", NS, job_name,
                            {**job_status, "conditions": [cond]})
    return job_name


async def deploy_one_target(client: KubeClient, api: ApiServerEmulator, md: dict[str, Any], index: int, key: str) -> None:
    """Create the ModelDeployment with only its index-th target, finish that build, and wait for
    the serving Deployment the operator then rolls out."""
    md["spec"]["targets"] = [md["spec"]["targets"][index]]
    target = md["spec"]["targets"][0]["name"]
    await asyncio.to_thread(client.create, md)
    await eventually(lambda: objs(api, "jobs"))
    await finish_build(client, api, target, key=key)
    await eventually(lambda: objs(api, "deployments").get(f"resnet-{target}"))


async def edit_model_deployment(client: KubeClient, change: Callable[[dict[str, Any]], None],
                                name: str = "resnet") -> None:
    """Edit as `kubectl edit` does: get, change, replace, and on a 409 (the operator wrote status
    in between, so the resourceVersion moved) read again and retry."""
    for _ in range(10):
        live = await asyncio.to_thread(client.get, *MD, NS, name)
        change(live)
        try:
            await asyncio.to_thread(client.replace, live, live)
            return
        except ApiException as exc:
            if exc.status != 409:
                raise
    raise AssertionError("replacing the ModelDeployment conflicted 10 times in a row")


async def make_ready(client: KubeClient, name: str, replicas: int) -> None:
    """Play the Deployment controller: all replicas updated and ready."""
    await asyncio.to_thread(client.patch_status, "apps/v1", "Deployment", NS, name, {
        "observedGeneration": 1, "replicas": replicas, "updatedReplicas": replicas, "readyReplicas": replicas,
        "availableReplicas": replicas})


def assert_rbac_allows_every_operator_request(api: ApiServerEmulator) -> set[tuple[str, str, str]]:
    used: set[tuple[str, str, str]] = set()
    for req in list(api):
        if req.resource is None or req.resource.plural is None or req.headers.get("User-Agent") == TEST_AGENT:
            continue
        method = req.method.value.upper()
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)
        if verb is None:
            verb = "watch" if req.params.get("watch") == "true" else ("get" if req.name else "list")
        resource = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
        used.add((req.resource.group or "", resource, verb))
    denied = sorted(u for u in used if not rbac.allows(*u))
    assert not denied, f"operator requests not granted by operators/rbac.py: {denied}"
    return used


async def test_create_build_serve_status_and_delete_with_emulated_gc(
        api: ApiServerEmulator, client: KubeClient, operator: Any, md: dict[str, Any]) -> None:
    await asyncio.to_thread(client.create, md)

    # One EngineBuild and one pinned build Job per target.
    jobs = await eventually(lambda: len(objs(api, "jobs")) == 3 and objs(api, "jobs"))
    assert len(objs(api, "enginebuilds")) == 3
    products = {j["metadata"]["labels"][names.LABEL_TARGET]:
                j["spec"]["template"]["spec"]["nodeSelector"].get("nvidia.com/gpu.product") for j in jobs.values()}
    assert products == {"h100": "NVIDIA-H100-80GB-HBM3", "t4": "Tesla-T4", "cpu": None}
    # the Service comes from the ModelDeployment's handler, the Jobs from the EngineBuilds' it created
    # first: the two handlers race, so the Service may land after the Jobs
    await eventually(lambda: "resnet" in objs(api, "services"))
    await eventually(lambda: (condition(api, "resnet", "Progressing") or {}).get("reason") == "EnginesBuilding")
    assert not objs(api, "deployments"), "nothing is served before an engine verified"

    # h100 verifies: its Deployment appears, pinned, serving that engine.
    await finish_build(client, api, "h100", key="trt-h100-fp16")
    dep = (await eventually(lambda: objs(api, "deployments").get("resnet-h100")))
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine_key_served(dep) == "trt-h100-fp16"
    eb = next(e for e in objs(api, "enginebuilds").values() if e["spec"]["target"]["name"] == "h100")
    assert eb["status"]["phase"] == "Succeeded" and eb["status"]["verified"] is True

    # t4 fails: Degraded with the build's reason; h100 keeps serving and the endpoint is Ready.
    await finish_build(client, api, "t4", ok=False)
    await make_ready(client, "resnet-h100", 2)
    degraded = await eventually(lambda: (condition(api, "resnet", "Degraded") or {}).get("status") == "True"
                                and condition(api, "resnet", "Degraded"))
    assert degraded["reason"] == "BackoffLimitExceeded" and "out of memory" in degraded["message"]
    not_ready = condition(api, "resnet", "Ready")
    assert (not_ready["status"], not_ready["reason"]) == ("False", "TargetsNotReady"), "cpu is still building"
    await finish_build(client, api, "cpu", key="host-fp16")
    await eventually(lambda: objs(api, "deployments").get("resnet-cpu"))
    await make_ready(client, "resnet-cpu", 1)
    ready = await eventually(lambda: (condition(api, "resnet", "Ready") or {}).get("status") == "True"
                             and condition(api, "resnet", "Ready"))
    assert condition(api, "resnet", "Degraded")["status"] == "True", "t4 is still failed"
    assert ready["reason"] == "Serving"
    status = objs(api, "modeldeployments")["resnet"]["status"]
    h100 = next(t for t in status["targets"] if t["name"] == "h100")
    assert (h100["engineKey"], h100["readyReplicas"]) == ("trt-h100-fp16", 2)
    assert status["observedGeneration"] == 1
    assert status["endpoint"] == "http://resnet.models.svc.cluster.local:8080"
    assert "resnet-t4" not in objs(api, "deployments")

    # Delete: everything the ModelDeployment created goes with it.
    await asyncio.to_thread(client.delete, *MD, NS, "resnet")
    await eventually(lambda: not any(objs(api, p) for p in
                                     ("modeldeployments", "enginebuilds", "jobs", "deployments", "services")),
                     describe=lambda: {p: list(objs(api, p)) for p in
                                       ("modeldeployments", "enginebuilds", "jobs", "deployments", "services")})
    assert_rbac_allows_every_operator_request(api)


async def test_converged_operator_writes_nothing_more(
        api: ApiServerEmulator, client: KubeClient, operator: Any, md: dict[str, Any]) -> None:
    await deploy_one_target(client, api, md, 2, key="host-fp16")  # cpu only
    await make_ready(client, "resnet-cpu", 1)
    await eventually(lambda: (condition(api, "resnet", "Ready") or {}).get("status") == "True")
    # Once converged, the operator's own follow-up events (status writes it caused) must settle
    # into no further writes: reconcile is idempotent, not a loop that keeps patching.
    await asyncio.sleep(0.5)
    before = len(list(api))
    await asyncio.sleep(1.5)
    writes = [f"{r.method.value} {r.url.path} {r.data}" for r in list(api)[before:]
              if r.method.value.upper() in ("POST", "PUT", "PATCH", "DELETE")
              and r.headers.get("User-Agent") != TEST_AGENT]
    assert not writes, writes
    assert_rbac_allows_every_operator_request(api)


async def test_spec_change_rolls_out_after_the_new_engine_verified(
        api: ApiServerEmulator, client: KubeClient, operator: Any, md: dict[str, Any]) -> None:
    await deploy_one_target(client, api, md, 0, key="fp16-key")  # h100 only

    await edit_model_deployment(client, lambda live: live["spec"]["targets"][0].update(precision="int8"))
    await eventually(lambda: len(objs(api, "jobs")) == 2)
    await asyncio.sleep(0.3)
    assert engine_key_served(objs(api, "deployments")["resnet-h100"]) == "fp16-key", "unverified engine must not reach pods"

    await finish_build(client, api, "h100", key="int8-key")
    await eventually(lambda: engine_key_served(objs(api, "deployments")["resnet-h100"]) == "int8-key")
    await eventually(lambda: len(objs(api, "enginebuilds")) == 1)  # the superseded build is removed
    md_now = objs(api, "modeldeployments")["resnet"]
    await eventually(lambda: objs(api, "modeldeployments")["resnet"]["status"]["observedGeneration"] == 2)
    assert md_now["metadata"]["generation"] == 2
    assert_rbac_allows_every_operator_request(api)
