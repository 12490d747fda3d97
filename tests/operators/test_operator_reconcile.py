"""Reconcile functions (pure): desired objects, engine gating, status, idempotency."""
from __future__ import annotations

import pytest

import copy
import json
from typing import Any

from kubetrt.operators import names, objects, reconcile, status
from kubetrt.operators.reconcile import Observed
from kubetrt.pipeline import deploy
from kubetrt.runtime.target import parse_target

from operator_testlib import CALIBRATION_URI, CONFIG, md_body

NOW = "2026-01-01T00:00:00Z"


def apply(plan: reconcile.Plan, observed: Observed) -> Observed:
    """Apply a plan to an in-memory Observed, as the API server would store it."""
    out = copy.deepcopy(observed)
    table = {"EngineBuild": out.engine_builds, "Deployment": out.deployments, "Service": out.services,
             "HorizontalPodAutoscaler": out.autoscalers, "PodDisruptionBudget": out.disruption_budgets}
    for kind, served in (("ServiceMonitor", out.service_monitors), ("HTTPRoute", out.http_routes),
                         ("ScaledObject", out.scaled_objects)):
        if served is not None:  # the CRD is installed
            table[kind] = served
    for obj in plan.create + plan.apply:
        table[obj["kind"]][obj["metadata"]["name"]] = copy.deepcopy(obj)
    for _, kind, name in plan.delete:
        table[kind].pop(name)
    return out


def verify(observed: Observed, target: str, key: str | None = None) -> str:
    """Mark a target's current build verified (what the build Job's result does)."""
    for name, eb in observed.engine_builds.items():
        if eb["spec"]["target"]["name"] == target and not eb.get("status"):
            eb["status"] = {"phase": "Succeeded", "verified": True, "engineKey": key or f"key-{name}",
                            "reason": "Verified"}
            return name
    raise AssertionError(f"no pending build for {target}")


def fail(observed: Observed, target: str, reason: str = "BackoffLimitExceeded") -> None:
    for eb in observed.engine_builds.values():
        if eb["spec"]["target"]["name"] == target and not eb.get("status"):
            eb["status"] = {"phase": "Failed", "verified": False, "reason": reason, "message": "trtexec: OOM"}
            return
    raise AssertionError(f"no pending build for {target}")


def cond(st: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in st["conditions"] if c["type"] == ctype)


def converge(md: dict[str, Any], observed: Observed) -> tuple[reconcile.Plan, Observed]:
    plan = reconcile.plan_model_deployment(md, observed, CONFIG, NOW)
    return plan, apply(plan, observed)


def test_new_deployment_creates_one_engine_build_per_target_and_a_service() -> None:
    plan = reconcile.plan_model_deployment(md_body(), Observed(), CONFIG, NOW)
    assert [o["kind"] for o in plan.create] == ["EngineBuild"] * 3
    assert [o["kind"] for o in plan.apply] == ["PodDisruptionBudget"] * 3 + ["Service"]
    assert not plan.delete
    h100, t4, cpu = plan.create
    assert h100["spec"]["target"] == {"name": "h100", "gpuProduct": "NVIDIA-H100-80GB-HBM3", "gpus": 1,
                                      "backend": "tensorrt", "precision": "fp16", "maxBatchSize": 32,
                                      "batchProfile": {"min": 1, "opt": 8, "max": 32}}
    assert t4["spec"]["target"]["precision"] == "int8"
    assert cpu["spec"]["target"]["backend"] == "host" and cpu["spec"]["target"]["cpu"] is True
    assert h100["spec"]["image"] == CONFIG.builder_image_gpu  # a GPU target: the GPU builder image
    assert h100["metadata"]["ownerReferences"] == [{"apiVersion": "kubetrt.io/v1alpha1", "kind": "ModelDeployment",
                                                    "name": "resnet", "uid": "uid-resnet", "controller": True,
                                                    "blockOwnerDeletion": True}]
    st = plan.status
    assert st["observedGeneration"] == 1
    assert cond(st, "EnginesReady")["status"] == "False" and cond(st, "Progressing")["reason"] == "EnginesBuilding"
    assert cond(st, "Ready")["status"] == "False" and cond(st, "Degraded")["status"] == "False"
    assert st["endpoint"] == "http://resnet.models.svc.cluster.local:8080"
    assert [t["buildPhase"] for t in st["targets"]] == ["Pending"] * 3


def test_build_job_is_pinned_to_the_gpu_product_and_runs_the_build_command() -> None:
    eb = reconcile.plan_model_deployment(md_body(), Observed(), CONFIG, NOW).create[1]
    job = objects.build_job(eb, CONFIG)
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "Tesla-T4"
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    (c,) = pod["containers"]
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert c["command"] == ["kubetrt", "build", "--package", "s3://models/resnet50/pkg", "--target",
                            "tensorrt@Tesla-T4:int8:1/8/32",
                            "--store", "s3://engines/resnet50", "--termination-log", c["terminationMessagePath"],
                            "--calibration", CALIBRATION_URI]  # t4 builds int8
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    assert c["securityContext"]["readOnlyRootFilesystem"] and not c["securityContext"]["allowPrivilegeEscalation"]
    assert pod["restartPolicy"] == "Never" and pod["securityContext"]["runAsNonRoot"]
    assert job["metadata"]["ownerReferences"][0]["kind"] == "EngineBuild"
    assert job["spec"]["template"]["metadata"]["labels"][names.LABEL_BUILD] == eb["metadata"]["name"]


def test_cpu_build_job_has_no_gpu_pinning() -> None:
    eb = reconcile.plan_model_deployment(md_body(), Observed(), CONFIG, NOW).create[2]
    pod = objects.build_job(eb, CONFIG)["spec"]["template"]["spec"]
    assert "nvidia.com/gpu.product" not in pod["nodeSelector"] and pod["tolerations"] == []
    assert "nvidia.com/gpu" not in json.dumps(pod["containers"][0]["resources"])
    command = pod["containers"][0]["command"]
    assert command[command.index("--target") + 1] == "host:fp32:1/8/32"  # a CPU target's default precision


def test_targets_the_pipeline_deploys_are_the_targets_the_operator_builds() -> None:
    for spec in ("host:fp32:1/4/8", "cuda@Tesla-T4:fp16:2/8/64", "tensorrt@NVIDIA-H100-80GB-HBM3:int8:1/1/1"):
        target = parse_target(spec)
        profile = {"min": target.profile.min, "opt": target.profile.opt, "max": target.profile.max}
        crd = {"name": "t", **deploy.crd_target(target), "batchProfile": profile}
        assert objects.engine_target(crd) == target
        assert objects.engine_target(crd).spec() == spec
    assert deploy.crd_target(parse_target("host")) == {"backend": "host", "precision": "fp32", "cpu": True}


def test_engine_build_with_a_target_the_runtime_cannot_build_fails_without_a_job() -> None:
    eb = reconcile.plan_model_deployment(md_body(), Observed(), CONFIG, NOW).create[0]
    eb["spec"]["target"]["batchProfile"] = {"min": 8, "opt": 4, "max": 32}  # only a hand-written EngineBuild
    plan = reconcile.plan_engine_build(eb, None, [], CONFIG)
    assert plan.create_job is None
    assert (plan.status["phase"], plan.status["reason"]) == ("Failed", "InvalidTarget")
    assert "expected 1 <= min <= opt <= max" in plan.status["message"]


def flag(deployment: dict, name: str) -> str:
    cmd = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    return cmd[cmd.index(name) + 1]


def test_file_uris_are_mounted_from_the_node_at_the_same_path() -> None:
    md = md_body(model={"name": "m", "source": {"uri": "file:///srv/store/abc/package"}},
                 store={"uri": "file:///srv/store"}, targets=[{"name": "cpu", "cpu": True}])
    eb = reconcile.plan_model_deployment(md, Observed(), CONFIG, NOW).create[0]
    pod = objects.build_job(eb, CONFIG)["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    assert cmd[cmd.index("--package") + 1] == "/srv/store/abc/package" and cmd[cmd.index("--store") + 1] == "/srv/store"
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in pod["containers"][0]["volumeMounts"]}
    assert host == {"package": "/srv/store/abc/package", "store": "/srv/store"}
    assert mounts["package"] == ("/srv/store/abc/package", True) and mounts["store"] == ("/srv/store", False)


def test_pvc_uris_are_mounted_and_passed_as_paths() -> None:
    md = md_body(model={"name": "m", "source": {"uri": "pvc://models/m/pkg"}}, store={"uri": "pvc://engines"})
    eb = reconcile.plan_model_deployment(md, Observed(), CONFIG, NOW).create[0]
    pod = objects.build_job(eb, CONFIG)["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    assert cmd[cmd.index("--package") + 1] == "/mnt/package/m/pkg" and cmd[cmd.index("--store") + 1] == "/mnt/store"
    claims = {v["persistentVolumeClaim"]["claimName"]: v["persistentVolumeClaim"]["readOnly"]
              for v in pod["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {"models": True, "engines": False}


@pytest.mark.parametrize("resources,source", [(None, "requests.cpu"), ({"limits": {"cpu": "3"}}, "limits.cpu")])
def test_serving_threads_follow_the_pods_cpu_not_the_nodes(resources: dict | None, source: str) -> None:
    targets = [{"name": "cpu", "cpu": True, **({"resources": resources} if resources else {})}]
    md = md_body(targets=targets)
    plan, obs = converge(md, Observed())
    verify(obs, "cpu", "host-x86_64-fp32-b1.8.32")
    plan, obs = converge(md, obs)
    (dep,) = [o for o in plan.apply if o["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    refs = {e["name"]: e["valueFrom"]["resourceFieldRef"] for e in c["env"] if "valueFrom" in e}
    for name in ("OMP_NUM_THREADS", "KUBETRT_THREADS", "KUBETRT_JIT_THREADS"):
        assert refs[name] == {"containerName": c["name"], "resource": source, "divisor": "1"}


def test_verified_engine_yields_a_pinned_hardened_deployment() -> None:
    md = md_body()
    plan, obs = converge(md, Observed())
    key = "tensorrt-NVIDIA-H100-80GB-HBM3-sm90-trt10.8-fp16-b1.8.32"
    verify(obs, "h100", key)
    plan, obs = converge(md, obs)
    deps = [o for o in plan.apply if o["kind"] == "Deployment"]
    assert [d["metadata"]["name"] for d in deps] == ["resnet-h100"]
    dep = deps[0]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert dep["spec"]["replicas"] == 2
    assert pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["resources"]["requests"]["cpu"] == "500m"
    assert c["command"] == ["kubetrt", "serve", "s3://models/resnet50/pkg", "--store", "s3://engines/resnet50",
                            "--engine-key", key, "--cache-dir", "/var/cache/kubetrt", "--model-name", "resnet50",
                            "--model-version", "3", "--device", "tensorrt", "--host", "0.0.0.0", "--port", "8080", "--grpc-port", "8081",
                            "--max-batch-size", "32", "--max-queue-delay-us", "0",
                            "--max-queue-size", "1024", "--request-timeout-s", "30.0"]
    assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp", "/var/cache/kubetrt"}
    assert {e["name"] for e in c["env"]} == {"HOME", "OMP_NUM_THREADS", "KUBETRT_THREADS", "KUBETRT_JIT_THREADS"}
    assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False and sc["runAsNonRoot"]
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8080"
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "uid-resnet"
    assert dep["spec"]["selector"]["matchLabels"] == {"kubetrt.io/model-deployment": "resnet",
                                                      "kubetrt.io/target": "h100"}
    svc = obs.services["resnet"]
    assert svc["spec"]["selector"] == {"kubetrt.io/model-deployment": "resnet",
                                       "app.kubernetes.io/component": "serving", "kubetrt.io/role": "primary"}
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": "25%", "maxUnavailable": 0}


def test_reconcile_twice_changes_nothing() -> None:
    md = md_body(autoscaling={"enabled": True, "maxReplicas": 6})
    _, obs = converge(md, Observed())
    for t in ("h100", "t4", "cpu"):
        verify(obs, t)
    first, obs = converge(md, obs)
    assert first.apply
    md["status"] = first.status
    second = reconcile.plan_model_deployment(md, obs, CONFIG, "2030-01-01T00:00:00Z")
    assert (second.apply, second.create, second.delete) == ([], [], [])
    assert not reconcile.status_changed(md["status"], second.status)


def test_autoscaling_creates_hpas_and_leaves_replicas_to_them() -> None:
    md = md_body(autoscaling={"enabled": True, "minReplicas": 2, "maxReplicas": 6,
                              "targetCPUUtilizationPercentage": 60})
    _, obs = converge(md, Observed())
    verify(obs, "t4")
    plan, obs = converge(md, obs)
    hpa = obs.autoscalers["resnet-t4"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "resnet-t4"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 60
    assert "replicas" not in obs.deployments["resnet-t4"]["spec"]
    md["spec"]["autoscaling"]["enabled"] = False
    plan, obs = converge(md, obs)
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "resnet-t4") in plan.delete
    assert obs.deployments["resnet-t4"]["spec"]["replicas"] == 1


def test_new_engine_reaches_pods_only_after_it_verified() -> None:
    md = md_body()
    _, obs = converge(md, Observed())
    old_build = verify(obs, "h100", "old-key")
    _, obs = converge(md, obs)
    assert names.ANN_ENGINE_KEY in obs.deployments["resnet-h100"]["metadata"]["annotations"]

    md["metadata"]["generation"] = 2
    md["spec"]["targets"][0]["precision"] = "int8"  # needs a new engine
    plan, obs = converge(md, obs)
    (new_eb,) = [o for o in plan.create if o["spec"]["target"]["name"] == "h100"]
    assert new_eb["metadata"]["name"] != old_build
    assert not [o for o in plan.apply if o["kind"] == "Deployment"], "pods must keep the verified engine"
    assert flag(obs.deployments["resnet-h100"], "--engine-key") == "old-key"
    assert old_build in obs.engine_builds, "the serving build must be kept"
    h100 = next(t for t in plan.status["targets"] if t["name"] == "h100")
    assert h100["engineKey"] == "old-key" and h100["buildPhase"] == "Pending"
    assert status.conditions  # Progressing while the new build runs
    assert cond(plan.status, "Progressing")["status"] == "True"

    verify(obs, "h100", "new-key")
    plan, obs = converge(md, obs)
    (dep,) = [o for o in plan.apply if o["kind"] == "Deployment"]
    assert flag(dep, "--engine-key") == "new-key"
    assert ("kubetrt.io/v1alpha1", "EngineBuild", old_build) in plan.delete


def test_replica_change_rolls_out_without_a_new_build() -> None:
    md = md_body()
    _, obs = converge(md, Observed())
    verify(obs, "cpu")
    _, obs = converge(md, obs)
    md["spec"]["targets"][2]["replicas"] = 4
    plan, obs = converge(md, obs)
    assert not plan.create
    (dep,) = [o for o in plan.apply if o["kind"] == "Deployment"]
    assert dep["spec"]["replicas"] == 4


def test_failed_build_is_degraded_with_its_reason_while_other_targets_serve() -> None:
    md = md_body()
    _, obs = converge(md, Observed())
    verify(obs, "h100")
    verify(obs, "cpu")
    fail(obs, "t4", "BackoffLimitExceeded")
    _, obs = converge(md, obs)
    for name, want in (("resnet-h100", 2), ("resnet-cpu", 1)):
        obs.deployments[name]["status"] = {"replicas": want, "readyReplicas": want, "updatedReplicas": want,
                                           "availableReplicas": want}
    plan, _ = converge(md, obs)
    st = plan.status
    degraded = cond(st, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "BackoffLimitExceeded"
    assert "t4" in degraded["message"] and "OOM" in degraded["message"]
    assert cond(st, "EnginesReady")["reason"] == "EngineBuildFailed"
    assert cond(st, "Ready")["status"] == "True", "the working targets keep serving"
    assert st["readyTargets"] == "2/3"
    t4 = next(t for t in st["targets"] if t["name"] == "t4")
    assert t4["buildPhase"] == "Failed" and "BackoffLimitExceeded" in t4["message"]
    assert "resnet-t4" not in obs.deployments


def test_all_targets_ready_is_ready_and_stable() -> None:
    md = md_body()
    _, obs = converge(md, Observed())
    for t in ("h100", "t4", "cpu"):
        verify(obs, t)
    _, obs = converge(md, obs)
    for dep in obs.deployments.values():
        n = dep["spec"]["replicas"]
        dep["status"] = {"readyReplicas": n, "updatedReplicas": n, "replicas": n}
    plan, _ = converge(md, obs)
    got = {c["type"]: (c["status"], c["reason"]) for c in plan.status["conditions"]}
    assert got == {"Ready": ("True", "Serving"), "Progressing": ("False", "Stable"),
                   "Degraded": ("False", "AsExpected"), "EnginesReady": ("True", "AllEnginesVerified")}
    assert [t["readyReplicas"] for t in plan.status["targets"]] == [2, 1, 1]


def test_removed_target_is_cleaned_up() -> None:
    md = md_body()
    _, obs = converge(md, Observed())
    verify(obs, "t4")
    _, obs = converge(md, obs)
    md["spec"]["targets"] = [t for t in md["spec"]["targets"] if t["name"] != "t4"]
    plan, obs = converge(md, obs)
    assert ("apps/v1", "Deployment", "resnet-t4") in plan.delete
    assert not [eb for eb in obs.engine_builds.values() if eb["spec"]["target"]["name"] == "t4"]


def test_semantically_invalid_spec_is_degraded_and_creates_nothing() -> None:
    md = md_body()
    md["spec"]["targets"].append({"name": "t4", "gpuProduct": "Tesla-T4"})
    plan = reconcile.plan_model_deployment(md, Observed(), CONFIG, NOW)
    assert (plan.apply, plan.create) == ([], [])
    assert cond(plan.status, "Degraded")["reason"] == "InvalidSpec"
    assert "duplicate target names: t4" in cond(plan.status, "Degraded")["message"]


def test_condition_transition_time_only_moves_when_status_changes() -> None:
    old = [{"type": "Ready", "status": "False", "reason": "X", "message": "", "lastTransitionTime": "t0"}]
    same = status.merge_conditions(old, [{"type": "Ready", "status": "False", "reason": "Y", "message": ""}], "t1", 3)
    flipped = status.merge_conditions(old, [{"type": "Ready", "status": "True", "reason": "Y", "message": ""}], "t1", 3)
    assert same[0]["lastTransitionTime"] == "t0" and flipped[0]["lastTransitionTime"] == "t1"
    assert same[0]["observedGeneration"] == 3


def _eb() -> dict[str, Any]:
    return reconcile.plan_model_deployment(md_body(), Observed(), CONFIG, NOW).create[0]


def _pod(message: str) -> dict[str, Any]:
    return {"status": {"containerStatuses": [{"name": "build", "state": {"terminated": {
        "exitCode": 0, "message": message, "finishedAt": "2026-01-01T00:10:00Z"}}}]}}


def test_engine_build_status_follows_its_job() -> None:
    eb = _eb()
    plan = reconcile.plan_engine_build(eb, None, [], CONFIG)
    assert plan.create_job is not None and plan.status["phase"] == "Pending"
    assert status.engine_build_status(eb, {"status": {"active": 1}}, [])["phase"] == "Running"
    done = {"status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}}
    result = json.dumps({"engineKey": "k1", "verified": True, "report": {"summary": "max abs err 1e-3"}})
    st = status.engine_build_status(eb, done, [_pod("building...\n" + result)])
    assert (st["phase"], st["engineKey"], st["verified"]) == ("Succeeded", "k1", True)
    assert st["report"]["summary"] == "max abs err 1e-3"
    unverified = json.dumps({"engineKey": "k1", "verified": False, "report": {"summary": "err 0.4 > 0.01"}})
    st = status.engine_build_status(eb, done, [_pod(unverified)])
    assert (st["phase"], st["reason"]) == ("Failed", "VerificationFailed") and "0.4" in st["message"]
    assert status.engine_build_status(eb, done, [])["reason"] == "NoBuildResult"
    failed = {"status": {"failed": 3, "conditions": [{"type": "Failed", "status": "True",
                                                       "reason": "BackoffLimitExceeded", "message": "3 failures"}]}}
    st = status.engine_build_status(eb, failed, [_pod("Traceback ...\nRuntimeError: CUDA out of memory")])
    assert (st["phase"], st["reason"]) == ("Failed", "BackoffLimitExceeded") and "out of memory" in st["message"]
    # A Job that has failed (by its podFailurePolicy on `kubetrt build`'s refusal, or after its
    # retries): the result its pods wrote says why.
    st = status.engine_build_status(eb, failed, [_pod(unverified)])
    assert (st["phase"], st["reason"], st["message"]) == ("Failed", "VerificationFailed", "err 0.4 > 0.01")


def test_a_refused_engine_fails_the_build_at_its_first_pod_not_after_the_jobs_retries() -> None:
    eb = _eb()
    unverified = json.dumps({"engineKey": "", "verified": False, "report": {"summary": "err 0.4 > 0.01"}})
    retrying = {"status": {"active": 1, "failed": 1}}  # the Job started its second pod
    refused = _pod(unverified)
    st = status.engine_build_status(eb, retrying, [refused, {"status": {"phase": "Running"}}])
    assert (st["phase"], st["reason"], st["message"]) == ("Failed", "VerificationFailed", "err 0.4 > 0.01")
    assert st["completionTime"] == "2026-01-01T00:10:00Z"
    crashed = _pod("Traceback ...\nOSError: connection reset")
    crashed["status"]["phase"] = "Failed"
    assert status.engine_build_status(eb, retrying, [crashed])["phase"] == "Running", "other failures are retried"


def test_terminal_build_status_is_final_and_needs_no_job() -> None:
    eb = _eb()
    eb["status"] = {"phase": "Succeeded", "verified": True, "engineKey": "k"}
    plan = reconcile.plan_engine_build(eb, None, [], CONFIG)  # Job garbage-collected after its TTL
    assert plan.create_job is None and plan.status == eb["status"]


def test_engine_identity_ignores_replicas_but_not_precision() -> None:
    a = md_body()
    b = md_body()
    b["spec"]["targets"][0]["replicas"] = 7
    c = md_body()
    c["spec"]["targets"][0]["precision"] = "fp32"
    name = lambda md: reconcile.plan_model_deployment(md, Observed(), CONFIG, NOW).create[0]["metadata"]["name"]  # noqa
    assert name(a) == name(b) != name(c)


def test_names_are_valid_dns_labels() -> None:
    long = names.dns_label("m" * 80, "target")
    assert len(long) <= 63 and long[0].isalpha() and long != names.dns_label("m" * 81, "target")
    assert names.dns_label("9lives") == "x-9lives"
