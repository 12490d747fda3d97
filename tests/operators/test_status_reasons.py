"""Status that explains: a stuck build pod's reason in the EngineBuild and the ModelDeployment, an
unready serving pod's in its target, Events on the transitions, and what `kubectl get` shows."""
from __future__ import annotations

from typing import Any

import pytest

from kubetrt.operators import crds, names, pods, reconcile, status
from kubetrt.operators.reconcile import Event, Observed

from operator_testlib import CONFIG, md_body
from test_operator_reconcile import NOW, cond, converge, verify

H100 = "NVIDIA-H100-80GB-HBM3"


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/os": "linux", **labels}}}


NODES = [node("cpu-1"), node("gpu-a100", **{names.GPU_PRODUCT_LABEL: "NVIDIA-A100-SXM4-80GB", "pool": "gpu"}),
         node("gpu-h100", **{names.GPU_PRODUCT_LABEL: H100})]


def pending_pod(selector: dict[str, str], message: str = "0/3 nodes are available: 3 node(s) didn't match "
                "Pod's node affinity/selector.") -> dict[str, Any]:
    return {"metadata": {"name": "build-x-abcde", "labels": {}}, "spec": {"nodeSelector": selector},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}}


def waiting_pod(reason: str, message: str, image: str = "corp/builder-gpu:1") -> dict[str, Any]:
    return {"metadata": {"name": "build-x-abcde", "labels": {}}, "spec": {},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}],
                       "containerStatuses": [{"name": "build", "image": image, "ready": False,
                                              "state": {"waiting": {"reason": reason, "message": message}}}]}}


def test_unschedulable_names_the_label_no_node_has() -> None:
    missing = pending_pod({"kubernetes.io/os": "linux", names.GPU_PRODUCT_LABEL: "NVIDIA-H200"})
    assert pods.pod_problem(missing, NODES) == pods.Problem(
        "Unschedulable", f"unschedulable: no node labelled {names.GPU_PRODUCT_LABEL}=NVIDIA-H200")
    apart = pending_pod({"pool": "gpu", names.GPU_PRODUCT_LABEL: H100})  # each label exists, never together
    assert pods.pod_problem(apart, NODES).message == (
        f"unschedulable: no node has all of the labels {names.GPU_PRODUCT_LABEL}={H100}, pool=gpu")
    taint = pending_pod({names.GPU_PRODUCT_LABEL: H100}, "0/3 nodes are available: 1 node(s) had untolerated taint")
    assert pods.pod_problem(taint, NODES).message == "unschedulable: 0/3 nodes are available: 1 node(s) had untolerated taint"
    assert "unschedulable: 0/3" in pods.pod_problem(missing, None).message, "without nodes: the scheduler's words"


@pytest.mark.parametrize("reason,message,expected", [
    ("ImagePullBackOff", 'Back-off pulling image "corp/builder-gpu:1"', "cannot pull image corp/builder-gpu:1: Back-off"),
    ("ErrImagePull", "pull access denied, repository does not exist", "cannot pull image corp/builder-gpu:1: pull access"),
    ("CreateContainerConfigError", 'secret "s3-creds" not found', 'container build: secret "s3-creds" not found'),
])
def test_stuck_containers_say_what_to_fix(reason: str, message: str, expected: str) -> None:
    problem = pods.pod_problem(waiting_pod(reason, message))
    assert problem is not None and problem.reason == reason and problem.message.startswith(expected), problem


def test_a_pod_that_is_merely_starting_is_no_problem() -> None:
    assert pods.pod_problem(waiting_pod("ContainerCreating", "")) is None
    assert pods.pod_problem({"status": {"phase": "Pending"}}) is None


def eb() -> dict[str, Any]:
    md = md_body()
    plan = reconcile.plan_model_deployment(md, Observed(), CONFIG, NOW)
    return next(e for e in plan.create if e["spec"]["target"]["name"] == "h100")


def test_a_build_whose_pod_cannot_be_scheduled_is_pending_with_that_reason_and_an_event() -> None:
    build = eb()
    job = {"status": {"active": 1, "startTime": NOW}}
    pod = pending_pod({names.GPU_PRODUCT_LABEL: "NVIDIA-H200"})
    plan = reconcile.plan_engine_build(build, job, [pod], CONFIG, NODES)
    assert (plan.status["phase"], plan.status["reason"]) == ("Pending", "Unschedulable")
    assert plan.status["message"] == f"unschedulable: no node labelled {names.GPU_PRODUCT_LABEL}=NVIDIA-H200"
    assert plan.events == [Event("Warning", "Unschedulable", plan.status["message"])]
    build["status"] = plan.status
    assert reconcile.plan_engine_build(build, job, [pod], CONFIG, NODES).events == [], "once per transition"
    running = {**pod, "status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]}}
    plan = reconcile.plan_engine_build(build, job, [running], CONFIG, NODES)
    assert (plan.status["phase"], plan.status["reason"], plan.events) == ("Running", "JobRunning", [])


def stuck_md() -> tuple[reconcile.Plan, Observed]:
    md = md_body()
    plan, obs = converge(md, Observed())
    verify(obs, "cpu")
    h100 = next(e for e in obs.engine_builds.values() if e["spec"]["target"]["name"] == "h100")
    h100["status"] = {"phase": "Pending", "reason": "Unschedulable",
                      "message": f"unschedulable: no node labelled {names.GPU_PRODUCT_LABEL}={H100}"}
    return converge(md, obs)


def test_a_stuck_build_degrades_the_model_deployment_and_says_why_in_one_line() -> None:
    plan, _ = stuck_md()
    st = plan.status
    degraded = cond(st, "Degraded")
    want = f"unschedulable: no node labelled {names.GPU_PRODUCT_LABEL}={H100}"
    assert (degraded["status"], degraded["reason"]) == ("True", "Unschedulable")
    assert degraded["message"] == f"target h100: engine build pending: {want}"
    assert cond(st, "Ready")["status"] == "False"
    assert st["message"] == degraded["message"], "the printer column's line says what is wrong first"
    h100 = next(t for t in st["targets"] if t["name"] == "h100")
    assert h100["message"] == f"engine build pending: {want}"
    assert st["url"] == "http://resnet.models.svc.cluster.local:8080"
    assert plan.events == [Event("Warning", "Unschedulable", degraded["message"])]


def test_printer_columns_show_ready_degraded_url_and_the_message() -> None:
    columns = {c["name"]: c for c in crds.model_deployment_crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    for name, path in (("Degraded", '.status.conditions[?(@.type=="Degraded")].status'), ("URL", ".status.url"),
                       ("Message", ".status.message"), ("Ready", '.status.conditions[?(@.type=="Ready")].status')):
        assert columns[name]["jsonPath"] == path and columns[name].get("priority", 0) == 0, name


def serving_pod(target: str, state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": f"resnet-{target}-5d8f-abcde",
                         "labels": {names.LABEL_TARGET: target, names.LABEL_APP_COMPONENT: "serving"}},
            "status": {"phase": "Running" if "running" in state else "Pending",
                       "conditions": [{"type": "PodScheduled", "status": "True"},
                                      {"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "serving", "image": "corp/serving:1", "ready": ready,
                                              "state": state}]}}


def test_an_unready_serving_pod_gives_its_target_the_reason() -> None:
    md = md_body(targets=[{"name": "cpu", "cpu": True}])
    plan, obs = converge(md, Observed())
    verify(obs, "cpu")
    plan, obs = converge(md, obs)
    obs.pods = [serving_pod("cpu", {"running": {"startedAt": NOW}})]
    plan, obs = converge(md, obs)
    (cpu,) = plan.status["targets"]
    assert cpu["message"].startswith("rolling out: pod resnet-cpu-5d8f-abcde: not ready: its readiness probe"), cpu
    assert cond(plan.status, "Degraded")["status"] == "False", "unready is not failed"
    obs.pods = [serving_pod("cpu", {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}})]
    plan, obs = converge(md, obs)
    (cpu,) = plan.status["targets"]
    assert cpu["message"] == ("serving pod resnet-cpu-5d8f-abcde: cannot pull image corp/serving:1: no such image")
    degraded = cond(plan.status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ImagePullBackOff")


def test_model_deployment_events_on_transitions_only() -> None:
    bad = {"conditions": [{"type": "Degraded", "status": "True", "reason": "Unschedulable", "message": "m"},
                          {"type": "Ready", "status": "False"}]}
    good = {"conditions": [{"type": "Degraded", "status": "False"}, {"type": "Ready", "status": "True",
                                                                     "message": "1/1 target(s) serving"}]}
    assert reconcile.model_deployment_events({}, bad) == [Event("Warning", "Unschedulable", "m")]
    assert reconcile.model_deployment_events(bad, bad) == []
    assert reconcile.model_deployment_events(bad, good) == [
        Event("Normal", "Recovered", "no target is failing any more"), Event("Normal", "Ready", "1/1 target(s) serving")]


def test_engine_build_status_still_reads_a_plain_pending_pod_as_waiting() -> None:
    st = status.engine_build_status(eb(), {"status": {"active": 1}}, [{"status": {"phase": "Pending"}}])
    assert (st["phase"], st["reason"]) == ("Pending", "JobPending")
