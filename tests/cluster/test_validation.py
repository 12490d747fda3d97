"""The API server itself rejects bad ModelDeployments and EngineBuilds: one case per validation rule
the CRDs declare (CEL rules and schema constraints), each with the message a user reads in
`kubectl apply`'s error."""
from __future__ import annotations

import copy
import json
from typing import Any, Callable

import pytest
import yaml

from kube_cluster import Release, kubectl
from kubetrt.operators import crds, names, objects

pytestmark = pytest.mark.cluster

GOOD: dict[str, Any] = {
    "apiVersion": "kubetrt.io/v1alpha1",
    "kind": "ModelDeployment",
    "metadata": {"name": "validation-probe", "namespace": "default"},
    "spec": {
        "model": {"name": "resnet", "version": "1", "source": {"uri": "s3://models/resnet/package"}},
        "store": {"uri": "s3://models/engines"},
        "targets": [{"name": "h100", "gpuProduct": "NVIDIA-H100-80GB-HBM3", "precision": "fp16"},
                    {"name": "cpu", "cpu": True}],
    },
}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return change


def _both(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        for c in changes:
            c(obj)
    return change


# (case id, change to GOOD, what the API server's message must say)
CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("int8-without-calibration", _set("spec.targets.0.precision", "int8"), crds.INT8_NEEDS_CALIBRATION),
    ("int8-by-default-without-calibration", _set("spec.optimization", {"precision": "int8"}),
     crds.INT8_NEEDS_CALIBRATION),
    ("cpu-and-gpu-product", _set("spec.targets.1.gpuProduct", "NVIDIA-A100-SXM4-80GB"), crds.TARGET_KIND),
    ("neither-cpu-nor-gpu-product", _set("spec.targets.1", {"name": "cpu"}), crds.TARGET_KIND),
    ("cpu-target-with-gpu-backend", _set("spec.targets.1.backend", "tensorrt"), crds.TARGET_BACKEND),
    ("invalid-dns-name", _set("metadata.name", "Bad_Name"), "a lowercase RFC 1123 subdomain"),
    ("invalid-model-name", _set("spec.model.name", "Bad_Model"), "spec.model.name in body should match"),
    ("invalid-target-name", _set("spec.targets.0.name", "H100!"), "spec.targets[0].name in body should match"),
    ("negative-batch-size", _set("spec.optimization", {"maxBatchSize": -1}),
     "spec.optimization.maxBatchSize in body should be greater than or equal to 1"),
    ("negative-serving-batch-size", _set("spec.batching", {"maxBatchSize": -4}),
     "spec.batching.maxBatchSize in body should be greater than or equal to 1"),
    ("batch-profile-order", _set("spec.optimization", {"batchProfile": {"min": 8, "opt": 4, "max": 16}}),
     crds.BATCH_PROFILE_ORDER),
    ("negative-replicas", _set("spec.targets.0.replicas", -1), "spec.targets[0].replicas in body should be greater"),
    ("unknown-precision", _set("spec.targets.0.precision", "int4"), 'Unsupported value: "int4"'),
    ("uri-without-scheme", _set("spec.model.source.uri", "/models/resnet"), "spec.model.source.uri in body should match"),
    ("no-targets", _set("spec.targets", []), "spec.targets in body should have at least 1 items"),
    ("trace-rate-zero", _set("spec.tracing", {"rate": 0}), "spec.tracing.rate in body should be greater than or equal to 1"),
    ("percentile-without-method",
     _both(_set("spec.targets.0.precision", "int8"),
           _set("spec.optimization", {"calibration": {"uri": "s3://cal/data", "method": "minmax", "percentile": 99.9}})),
     crds.PERCENTILE_NEEDS_METHOD),
    ("percentile-zero",
     _set("spec.optimization", {"calibration": {"uri": "s3://cal/data", "method": "percentile", "percentile": 0}}),
     crds.PERCENTILE_RANGE),
    ("holdout-fraction-one", _set("spec.optimization", {"calibration": {"uri": "s3://cal/data", "holdoutFraction": 1.0}}),
     crds.HOLDOUT_FRACTION_RANGE),
    ("missing-store", lambda obj: obj["spec"].pop("store"), 'spec.store: Required value'),
    ("only-fallback-targets", lambda obj: [t.update(fallback=True) for t in obj["spec"]["targets"]],
     crds.FALLBACK_NEEDS_PRIMARY),
    ("bad-toleration-operator", _set("spec.tolerations", [{"key": "dedicated", "operator": "Maybe"}]),
     'Unsupported value: "Maybe"'),
    ("canary-percent-zero", _set("spec.rollout", {"canaryTrafficPercent": 0}),
     "spec.rollout.canaryTrafficPercent in body should be greater than or equal to 1"),
    ("canary-percent-over-100", _set("spec.rollout", {"canaryTrafficPercent": 101}),
     "spec.rollout.canaryTrafficPercent in body should be less than or equal to 100"),
    ("canary-analysis-without-canary", _set("spec.rollout", {"canaryAnalysis": {"windowSeconds": 60}}),
     crds.CANARY_ANALYSIS_NEEDS_CANARY),
    ("canary-analysis-at-100", _set("spec.rollout", {"canaryTrafficPercent": 100, "canaryAnalysis": {}}),
     crds.CANARY_ANALYSIS_NEEDS_CANARY),
    ("canary-error-rate-over-1", _set("spec.rollout", {"canaryTrafficPercent": 10,
                                                       "canaryAnalysis": {"maxErrorRate": 1.5}}),
     "spec.rollout.canaryAnalysis.maxErrorRate in body should be less than or equal to 1"),
    ("canary-window-zero", _set("spec.rollout", {"canaryTrafficPercent": 10, "canaryAnalysis": {"windowSeconds": 0}}),
     "spec.rollout.canaryAnalysis.windowSeconds in body should be greater than or equal to 1"),
    ("unknown-autoscaling-metric", _set("spec.autoscaling", {"enabled": True, "metric": "gpu"}),
     'Unsupported value: "gpu"'),
    ("scale-to-zero", _set("spec.autoscaling", {"enabled": True, "metric": "concurrency", "minReplicas": 0}),
     "spec.autoscaling.minReplicas in body should be greater than or equal to 1"),
    ("gateway-without-name", _set("spec.rollout", {"gateway": {"namespace": "infra"}}),
     "spec.rollout.gateway.name: Required value"),
    ("gateway-bad-listener", _set("spec.rollout", {"gateway": {"name": "public", "sectionName": "HTTPS!"}}),
     "spec.rollout.gateway.sectionName in body should match"),
    ("gateway-bad-hostname", _set("spec.rollout", {"gateway": {"name": "public", "hostnames": ["not a host"]}}),
     "spec.rollout.gateway.hostnames[0] in body should match"),
    ("canary-p99-zero", _set("spec.rollout", {"canaryTrafficPercent": 10,
                                              "canaryAnalysis": {"maxP99Milliseconds": 0}}),
     crds.MAX_P99_POSITIVE),
    ("queue-size-zero", _set("spec.batching", {"maxQueueSize": 0}),
     "spec.batching.maxQueueSize in body should be greater than or equal to 1"),
    ("request-timeout-zero", _set("spec.batching", {"requestTimeoutSeconds": 0}),
     crds.REQUEST_TIMEOUT_POSITIVE),
    ("sidecar-named-serving", _set("spec.sidecars", [{"name": "serving", "image": "corp/pre:1"}]),
     crds.SIDECAR_NAME_TAKEN),
    ("sidecar-with-volumes", _set("spec.sidecars", [{"name": "pre", "image": "corp/pre:1",
                                                      "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}]),
     crds.SIDECAR_OWN_VOLUMES),
    ("sidecars-one-name-twice", _set("spec.sidecars", [{"name": "pre", "image": "corp/pre:1"},
                                                        {"name": "pre", "image": "corp/pre:2"}]),
     'spec.sidecars[1]: Duplicate value: {"name":"pre"}'),
    ("sidecar-without-image", _set("spec.sidecars", [{"name": "pre"}]), "spec.sidecars[0].image: Required value"),
    ("shared-memory-size-not-a-quantity", _set("spec.sharedMemory", {"sizeLimit": "lots"}),
     "spec.sharedMemory.sizeLimit in body should match"),
]


def _create(obj: dict[str, Any]) -> tuple[int, str]:
    proc = kubectl("create", "-f", "-", stdin=yaml.safe_dump(obj), check=False)
    if proc.returncode == 0:
        kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "-n", "default", "--wait=false", check=False)
    return proc.returncode, proc.stderr


def test_good_object_is_accepted(release: Release) -> None:
    code, err = _create(copy.deepcopy(GOOD))
    assert code == 0, err


@pytest.mark.parametrize("case,change,message", CASES, ids=[c[0] for c in CASES])
def test_api_server_rejects(release: Release, case: str, change: Callable[[dict[str, Any]], None],
                            message: str) -> None:
    obj = copy.deepcopy(GOOD)
    change(obj)
    code, err = _create(obj)
    print(f"{case}: {err.strip()}", flush=True)
    assert code != 0, f"{case}: the API server accepted {json.dumps(obj['spec'])}"
    assert message in err, f"{case}: expected {message!r} in:\n{err}"


def test_a_gateway_reference_is_accepted(release: Release) -> None:
    obj = copy.deepcopy(GOOD)
    obj["spec"]["rollout"] = {"canaryTrafficPercent": 10, "gateway": {
        "name": "public", "namespace": "infra", "sectionName": "https", "hostnames": ["resnet.example.com", "*.ml.example.com"]}}
    code, err = _create(obj)
    assert code == 0, err


def test_sidecars_and_shared_memory_are_accepted_and_defaulted(release: Release) -> None:
    obj = copy.deepcopy(GOOD)
    obj["metadata"]["name"] = "sidecar-probe"
    sidecar = {"name": "pre", "image": "corp/pre:1", "args": ["--fast"], "env": [{"name": "MODE", "value": "shm"}]}
    obj["spec"].update(sharedMemory={}, sidecars=[sidecar])
    kubectl("create", "-f", "-", stdin=yaml.safe_dump(obj))
    try:
        stored = json.loads(kubectl("get", "modeldeployment", "sidecar-probe", "-n", "default", "-o", "json").stdout)
        assert stored["spec"]["sharedMemory"] == {"sizeLimit": crds.DEFAULT_SHARED_MEMORY_SIZE}
        assert stored["spec"]["sidecars"] == [sidecar], "a sidecar's Container fields are kept, not pruned"
    finally:
        kubectl("delete", "modeldeployment", "sidecar-probe", "-n", "default", "--wait=false", check=False)


def test_the_api_server_accepts_the_serving_pods_generated_with_sidecars_and_shared_memory(release: Release) -> None:
    """The Deployment the operator writes for such a spec, each of its targets, as a server-side dry
    run: the API server checks the whole pod template (the sidecars' Container fields, the
    in-memory emptyDir, every mount naming a volume of the pod)."""
    md = copy.deepcopy(GOOD)
    md["metadata"]["uid"] = "00000000-0000-0000-0000-0000000051de"
    md["spec"].update(sharedMemory={"sizeLimit": "256Mi"}, sidecars=[
        {"name": "pre", "image": "corp/pre:1", "args": ["--fast"], "ports": [{"containerPort": 9000}],
         "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}}}])
    spec = objects.normalized_spec(md)
    assert objects.validate_spec(spec) == []
    for target in spec["targets"]:
        target = objects.resolve_target(spec, target)
        engine = objects.engine_build(md, spec, target, objects.OperatorConfig())
        engine["status"] = {"engineKey": f"{target['name']}-0123456789abcdef"}
        dep = objects.serving_deployment(md, spec, target, engine, objects.OperatorConfig())
        pod = dep["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == [names.SERVING_CONTAINER, "pre"]
        proc = kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=yaml.safe_dump(dep), check=False)
        assert proc.returncode == 0, f"target {target['name']}: {proc.stderr}"
        accepted = json.loads(proc.stdout)["spec"]["template"]["spec"]
        shm = {v["name"]: v for v in accepted["volumes"]}[names.SHARED_MEMORY_VOLUME]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "256Mi"}
        assert [m["mountPath"] for m in accepted["containers"][1]["volumeMounts"]] == [names.SHARED_MEMORY_PATH]


def test_engine_build_spec_is_immutable(release: Release) -> None:
    eb = {"apiVersion": "kubetrt.io/v1alpha1", "kind": "EngineBuild",
          "metadata": {"name": "immutable-probe", "namespace": "default"},
          "spec": {"modelDeployment": {"name": "x"}, "model": {"name": "x", "packageURI": "s3://m/p"},
                   "target": {"name": "cpu", "cpu": True, "backend": "host", "precision": "fp32"},
                   "store": {"uri": "s3://m/e"}, "image": "builder"}}
    kubectl("create", "-f", "-", stdin=yaml.safe_dump(eb))
    try:
        proc = kubectl("patch", "enginebuild", "immutable-probe", "--type=merge", "-p",
                       json.dumps({"spec": {"image": "other"}}), check=False)
        assert proc.returncode != 0 and "EngineBuild spec is immutable" in proc.stderr, proc.stderr
    finally:
        kubectl("delete", "enginebuild", "immutable-probe", check=False)


def test_every_cel_rule_has_a_case() -> None:
    """A new x-kubernetes-validations rule needs its case here."""
    messages: list[str] = []

    def walk(schema: Any) -> None:
        if isinstance(schema, dict):
            messages.extend(v["message"] for v in schema.get("x-kubernetes-validations", []))
            for value in schema.values():
                walk(value)
        elif isinstance(schema, list):
            for value in schema:
                walk(value)
    for crd in crds.all_crds():
        walk(crd["spec"]["versions"][0]["schema"])
    covered = {m for _, _, m in CASES} | {"EngineBuild spec is immutable"}
    assert sorted(set(messages) - covered) == []
