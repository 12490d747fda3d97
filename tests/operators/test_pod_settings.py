"""Per target: the image of its kind, the cluster admin's pod settings on build Jobs and serving
pods, and the role (primary or fallback) the model's Service selects."""
from __future__ import annotations

from typing import Any

import pytest

from kubetrt.operators import crds, names, objects, reconcile
from kubetrt.operators.objects import OperatorConfig
from kubetrt.operators.reconcile import Observed

from operator_testlib import CONFIG, md_body
from test_operator_reconcile import converge, verify

GPU_TOLERATION = {"key": names.GPU_TAINT_KEY, "operator": "Exists", "effect": names.GPU_TAINT_EFFECT}
DEDICATED = {"key": "dedicated", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}


def built(md: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """{target: build Job pod spec} and {target: serving pod spec} once every build verified."""
    plan, obs = converge(md, Observed())
    jobs = {eb["spec"]["target"]["name"]: objects.build_job(eb, CONFIG)["spec"]["template"]["spec"]
            for eb in plan.create}
    for t in md["spec"]["targets"]:
        verify(obs, t["name"])
    plan, obs = converge(md, obs)
    serving = {d["metadata"]["labels"][names.LABEL_TARGET]: d["spec"]["template"]["spec"]
               for d in plan.apply if d["kind"] == "Deployment"}
    return jobs, serving


def test_each_target_gets_the_images_of_its_kind() -> None:
    jobs, serving = built(md_body())
    for target, gpu in (("h100", True), ("t4", True), ("cpu", False)):
        assert jobs[target]["containers"][0]["image"] == CONFIG.default_image("builder", gpu), target
        assert serving[target]["containers"][0]["image"] == CONFIG.default_image("serving", gpu), target
    assert CONFIG.serving_image_gpu != CONFIG.serving_image and CONFIG.builder_image_gpu != CONFIG.builder_image


def test_a_targets_image_overrides_spec_image_which_overrides_the_defaults() -> None:
    md = md_body(image={"builder": "corp/builder:1"})
    md["spec"]["targets"][0]["image"] = {"serving": "corp/serving-h100:2", "builder": "corp/builder-h100:2"}
    jobs, serving = built(md)
    assert jobs["h100"]["containers"][0]["image"] == "corp/builder-h100:2"
    assert serving["h100"]["containers"][0]["image"] == "corp/serving-h100:2"
    assert jobs["t4"]["containers"][0]["image"] == jobs["cpu"]["containers"][0]["image"] == "corp/builder:1"
    assert serving["t4"]["containers"][0]["image"] == CONFIG.serving_image_gpu
    assert serving["cpu"]["containers"][0]["image"] == CONFIG.serving_image


def test_operator_reads_the_gpu_images_from_its_env() -> None:
    config = OperatorConfig.from_env({names.ENV_SERVING_IMAGE_GPU: "r/s-gpu:1", names.ENV_BUILDER_IMAGE_GPU: "r/b-gpu:1",
                                      names.ENV_SERVING_IMAGE: "r/s:1", names.ENV_BUILDER_IMAGE: ""})
    assert (config.serving_image_gpu, config.builder_image_gpu, config.serving_image) == ("r/s-gpu:1", "r/b-gpu:1", "r/s:1")
    assert config.builder_image == OperatorConfig().builder_image, "an empty variable keeps the default"


def admin_md() -> dict[str, Any]:
    md = md_body(imagePullSecrets=[{"name": "corp-registry"}], nodeSelector={"pool": "inference", "zone": "a"},
                 tolerations=[DEDICATED], priorityClassName="inference-high", runtimeClassName="nvidia",
                 resources={"requests": {"cpu": "2", "memory": "4Gi"}},
                 buildResources={"requests": {"cpu": "4"}, "limits": {"memory": "16Gi"}})
    h100 = md["spec"]["targets"][0]
    h100.update(nodeSelector={"zone": "b", names.GPU_PRODUCT_LABEL: "something-else"},
                imagePullSecrets=[{"name": "h100-registry"}], resources={"requests": {"memory": "32Gi"}})
    cpu = md["spec"]["targets"][2]
    cpu.update(runtimeClassName="runc", tolerations=[])
    return md


def test_pod_settings_reach_build_jobs_and_serving_pods_with_the_gpu_pinning_kept() -> None:
    jobs, serving = built(admin_md())
    for kind, pods in (("build", jobs), ("serving", serving)):
        h100, t4, cpu = pods["h100"], pods["t4"], pods["cpu"]
        # spec's settings everywhere, a target's own over them
        assert h100["imagePullSecrets"] == [{"name": "h100-registry"}], kind
        assert t4["imagePullSecrets"] == cpu["imagePullSecrets"] == [{"name": "corp-registry"}], kind
        assert t4["priorityClassName"] == h100["priorityClassName"] == cpu["priorityClassName"] == "inference-high"
        assert (h100["runtimeClassName"], cpu["runtimeClassName"]) == ("nvidia", "runc"), kind
        # nodeSelector merged key by key; the operator's GPU product label wins over the user's
        assert h100["nodeSelector"] == {"pool": "inference", "zone": "b", "kubernetes.io/os": "linux",
                                        names.GPU_PRODUCT_LABEL: "NVIDIA-H100-80GB-HBM3"}, kind
        assert cpu["nodeSelector"] == {"pool": "inference", "zone": "a", "kubernetes.io/os": "linux"}, kind
        # the user's tolerations beside the GPU one; a target's [] clears spec's
        assert h100["tolerations"] == [GPU_TOLERATION, DEDICATED], kind
        assert cpu["tolerations"] == [], kind
    assert jobs["h100"]["containers"][0]["resources"] == {"requests": {"cpu": "4"},
                                                          "limits": {"memory": "16Gi", names.GPU_RESOURCE: "1"}}
    assert jobs["cpu"]["containers"][0]["resources"] == {"requests": {"cpu": "4"}, "limits": {"memory": "16Gi"}}
    res = serving["h100"]["containers"][0]["resources"]
    assert res == {"requests": {"cpu": "2", "memory": "32Gi"}, "limits": {names.GPU_RESOURCE: "1"}}
    assert serving["cpu"]["containers"][0]["resources"]["requests"] == {"cpu": "2", "memory": "4Gi"}


def test_build_pod_settings_are_part_of_the_builds_identity() -> None:
    """A stuck build (no node, no pull secret) is retried with the settings that fix it."""
    def build_names(md: dict[str, Any]) -> set[str]:
        return {eb["metadata"]["name"] for eb in reconcile.plan_model_deployment(md, Observed(), CONFIG, "t").create}
    plain = build_names(md_body())
    assert build_names(md_body(image={"builder": "other:1"})) == plain, "an image alone does not rebuild"
    assert not build_names(md_body(tolerations=[DEDICATED])) & plain


def test_the_crd_schema_accepts_the_settings_and_refuses_a_bad_toleration() -> None:
    from jsonschema import Draft202012Validator

    schema = crds.object_schema(crds.model_deployment_crd())
    validator = Draft202012Validator(schema)
    assert validator.is_valid(admin_md())
    bad = admin_md()
    bad["spec"]["tolerations"] = [{"key": "x", "operator": "Maybe"}]
    errors = [e.message for e in validator.iter_errors(bad)]
    assert any("Maybe" in m for m in errors), errors


# ----------------------------------------------------------------------------- fallback targets
def fallback_md() -> dict[str, Any]:
    md = md_body()
    md["spec"]["targets"][2]["fallback"] = True
    return md


def ready(observed: Observed, target: str, replicas: int) -> None:
    observed.deployments[f"resnet-{target}"]["status"] = {"readyReplicas": replicas}


def selectors(plan: reconcile.Plan, observed: Observed) -> dict[str, dict[str, str]]:
    services = {**observed.services, **{o["metadata"]["name"]: o for o in plan.apply if o["kind"] == "Service"}}
    return {name: svc["spec"]["selector"][names.LABEL_ROLE] for name, svc in services.items()}


def test_fallback_target_serves_the_main_service_only_while_no_primary_target_can() -> None:
    md = fallback_md()
    plan, obs = converge(md, Observed())
    for t in ("h100", "t4", "cpu"):
        verify(obs, t)
    plan, obs = converge(md, obs)
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"][names.LABEL_ROLE]
            for d in obs.deployments.values()}
    assert pods == {"resnet-h100": "primary", "resnet-t4": "primary", "resnet-cpu": "fallback"}
    ready(obs, "cpu", 1)  # only the fallback is ready: the Service selects it
    plan, obs = converge(md, obs)
    assert selectors(plan, obs) == {"resnet": "fallback", "resnet-fallback": "fallback"}
    ready(obs, "h100", 1)  # a primary target is ready: the fallback leaves the main Service
    plan, obs = converge(md, obs)
    assert selectors(plan, obs) == {"resnet": "primary", "resnet-fallback": "fallback"}
    status = {t["name"]: t["role"] for t in plan.status["targets"]}
    assert status == {"h100": "primary", "t4": "primary", "cpu": "fallback"}


def test_without_a_fallback_target_there_is_no_fallback_service() -> None:
    plan, obs = converge(md_body(), Observed())
    assert sorted(obs.services) == ["resnet"]
    plan, obs = converge(fallback_md(), obs)
    assert sorted(obs.services) == ["resnet", "resnet-fallback"]
    plan, obs = converge(md_body(), obs)
    assert ("v1", "Service", "resnet-fallback") in plan.delete


def test_only_fallback_targets_is_an_invalid_spec() -> None:
    md = md_body()
    for t in md["spec"]["targets"]:
        t["fallback"] = True
    assert crds.FALLBACK_NEEDS_PRIMARY in objects.validate_spec(objects.normalized_spec(md))


@pytest.mark.parametrize("target,precision", [({"name": "c", "cpu": True}, "fp32"),
                                              ({"name": "g", "gpuProduct": "Tesla-T4"}, "fp16")])
def test_a_targets_default_precision_is_its_kinds(target: dict[str, Any], precision: str) -> None:
    spec = objects.normalized_spec(md_body(targets=[target]))
    assert objects.resolve_target(spec, target)["precision"] == precision
    spec = objects.normalized_spec(md_body(targets=[target], optimization={"precision": "int8",
                                                                         "calibration": {"uri": "s3://c/d"}}))
    assert objects.resolve_target(spec, target)["precision"] == "int8"
