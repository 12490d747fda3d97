"""Desired Kubernetes objects for a ModelDeployment, as plain dicts (pure functions, no I/O).

Everything engine-bound in a serving Deployment (node pinning, device, engine key) is taken from
the EngineBuild whose engine it serves, never from the live spec: so a spec change that needs a
new engine reaches pods only once that engine's build verified.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Mapping

from kubetrt.operators import crds
from kubetrt.operators.names import (
    ANN_ENGINE_BUILD,
    ANN_ENGINE_KEY,
    ANN_SPEC_HASH,
    API_VERSION,
    APP_NAME,
    ENV_BUILDER_IMAGE,
    ENV_CLUSTER_DOMAIN,
    ENV_IMAGE_PULL_POLICY,
    ENV_JOB_TTL_SECONDS,
    ENV_SERVING_IMAGE,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    GPU_TAINT_EFFECT,
    GPU_TAINT_KEY,
    KIND_ENGINE_BUILD,
    LABEL_APP_COMPONENT,
    LABEL_APP_INSTANCE,
    LABEL_APP_MANAGED_BY,
    LABEL_APP_NAME,
    LABEL_APP_PART_OF,
    LABEL_BUILD,
    LABEL_MD,
    LABEL_TARGET,
    MANAGED_BY,
    SERVING_GRPC_PORT,
    SERVING_PORT,
    TERMINATION_LOG,
    dns_label,
    label_value,
    stable_hash,
)
from kubetrt.runtime.target import CPU_PRODUCT, BatchProfile, Target

CACHE_DIR = "/var/cache/kubetrt"  # emptyDir where serving pods assemble package + engine
PRESTOP_SLEEP_SECONDS = 5  # a serving pod's preStop sleep (Kubernetes 1.30+ sleep action)

Obj = dict[str, Any]


@dataclass(frozen=True)
class OperatorConfig:
    """Operator settings (env of the operator pod; the Helm chart fills them from values)."""

    serving_image: str = "ghcr.io/kubetrt/serving:0.1.0"
    builder_image: str = "ghcr.io/kubetrt/builder:0.1.0"
    pull_policy: str = "IfNotPresent"
    job_ttl_seconds: int = 86400
    cluster_domain: str = "cluster.local"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorConfig":
        env = os.environ if env is None else env
        d = cls()
        return cls(
            serving_image=env.get(ENV_SERVING_IMAGE, d.serving_image),
            builder_image=env.get(ENV_BUILDER_IMAGE, d.builder_image),
            pull_policy=env.get(ENV_IMAGE_PULL_POLICY, d.pull_policy),
            job_ttl_seconds=int(env.get(ENV_JOB_TTL_SECONDS, d.job_ttl_seconds)),
            cluster_domain=env.get(ENV_CLUSTER_DOMAIN, d.cluster_domain),
        )


# ----------------------------------------------------------------------------- naming & hashing
def deployment_name(md_name: str, target_name: str) -> str:
    return dns_label(md_name, target_name)


def service_name(md_name: str) -> str:
    return dns_label(md_name)


def labels(md_name: str, component: str, target: str | None = None) -> dict[str, str]:
    out = {
        LABEL_APP_NAME: APP_NAME,
        LABEL_APP_INSTANCE: label_value(md_name),
        LABEL_APP_COMPONENT: component,
        LABEL_APP_PART_OF: APP_NAME,
        LABEL_APP_MANAGED_BY: MANAGED_BY,
        LABEL_MD: label_value(md_name),
    }
    if target is not None:
        out[LABEL_TARGET] = target
    return out


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    """Controller reference: the garbage collector deletes children with their owner."""
    meta = owner["metadata"]
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"],
            "uid": meta.get("uid", ""), "controller": True, "blockOwnerDeletion": True}


def with_spec_hash(obj: Obj) -> Obj:
    """Annotate an object with the hash of its desired content: equal hash means nothing to apply."""
    out = copy.deepcopy(obj)
    out["metadata"].setdefault("annotations", {}).pop(ANN_SPEC_HASH, None)
    out["metadata"]["annotations"][ANN_SPEC_HASH] = stable_hash(out, 16)
    return out


# ----------------------------------------------------------------------------- spec handling
def normalized_spec(md: Mapping[str, Any]) -> dict[str, Any]:
    """The ModelDeployment spec with the CRD's defaults applied."""
    schema = crds.model_deployment_spec_schema()
    return crds.apply_defaults(schema, copy.deepcopy(dict(md.get("spec") or {})))


def resolve_target(spec: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Any]:
    """A target with every engine setting decided (backend and precision defaults depend on kind)."""
    t = dict(target)
    is_cpu = bool(t.get("cpu"))
    t.setdefault("backend", "host" if is_cpu else "tensorrt")
    t.setdefault("precision", spec["optimization"]["precision"])
    t.setdefault("replicas", 1)
    if not is_cpu:
        t.setdefault("gpus", 1)
    return t


def _number_in(value: Any, low: float, high: float, include_high: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return low < value < high or (include_high and value == high)


def int8_targets(spec: Mapping[str, Any]) -> list[str]:
    """Names of the targets that build int8 (their own precision, else spec.optimization.precision)."""
    default = (spec.get("optimization") or {}).get("precision", crds.DEFAULT_PRECISION)
    return [str(t.get("name")) for t in spec.get("targets", []) if t.get("precision", default) == "int8"]


def validate_spec(spec: Mapping[str, Any]) -> list[str]:
    """Checks the CRD's JSON schema cannot express, and its CEL rules again (API servers without CEL
    and test emulators do not evaluate them); the schema rejects the rest before the operator sees it."""
    errors = []
    names = [t.get("name") for t in spec.get("targets", [])]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        errors.append(f"duplicate target names: {', '.join(map(str, dupes))}")
    for t in spec.get("targets", []):
        if bool(t.get("gpuProduct")) == bool(t.get("cpu")):
            errors.append(f"target {t.get('name')}: set exactly one of gpuProduct or cpu")
        elif t.get("cpu") and t.get("backend", "host") != "host":
            errors.append(f"target {t.get('name')}: CPU targets use backend host")
    prof = spec.get("optimization", {}).get("batchProfile", {})
    if prof and not prof.get("min", 1) <= prof.get("opt", 1) <= prof.get("max", 1):
        errors.append("optimization.batchProfile must satisfy min <= opt <= max")
    auto = spec.get("autoscaling", {})
    if auto.get("enabled") and auto.get("minReplicas", 1) > auto.get("maxReplicas", 1):
        errors.append("autoscaling.minReplicas must not exceed maxReplicas")
    calibration = spec.get("optimization", {}).get("calibration")
    if calibration is None:
        int8 = int8_targets(spec)
        if int8:
            errors.append(f"{crds.INT8_NEEDS_CALIBRATION} (int8 targets: {', '.join(int8)})")
    else:
        if "percentile" in calibration:
            if calibration.get("method") != "percentile":
                errors.append(crds.PERCENTILE_NEEDS_METHOD)
            if not _number_in(calibration["percentile"], 0, 100, include_high=True):
                errors.append(crds.PERCENTILE_RANGE)
        if not _number_in(calibration.get("holdoutFraction", crds.DEFAULT_HOLDOUT_FRACTION), 0, 1):
            errors.append(crds.HOLDOUT_FRACTION_RANGE)
    return errors


def engine_target(target: Mapping[str, Any]) -> Target:
    """The Target an EngineBuild's spec.target asks for (a resolved target with its batch profile).

    The build Job passes its spec string (`Target.spec`) to `kubetrt build --target`; a field the
    runtime cannot build raises TargetError.
    """
    profile = target.get("batchProfile") or {}
    return Target(
        backend=target["backend"],
        gpu_product=target.get("gpuProduct") or CPU_PRODUCT,
        precision=target["precision"],
        profile=BatchProfile(**{k: int(profile[k]) for k in ("min", "opt", "max") if k in profile}),
    )


def mount_uri(uri: str, mount_path: str, volume: str, read_only: bool) -> tuple[str, list[Obj], list[Obj]]:
    """The path a container reads `uri` at, with the volume and mount that put it there.

    pvc://<claim>/<path> mounts the claim at `mount_path`; file:///<path> (a node-local directory,
    as on a single-node cluster or a shared mount every node has) mounts that directory from the
    host at the same path; s3:// and gs:// pass through for the container to fetch.
    """
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://"):].partition("/")
        path = f"{mount_path}/{sub}".rstrip("/") if sub else mount_path
        return (path,
                [{"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}],
                [{"name": volume, "mountPath": mount_path, "readOnly": read_only}])
    if uri.startswith("file://"):
        path = "/" + uri[len("file://"):].lstrip("/")
        return (path,
                [{"name": volume, "hostPath": {"path": path, "type": "Directory"}}],
                [{"name": volume, "mountPath": path, "readOnly": read_only}])
    return uri, [], []


def _pod_security() -> Obj:
    return {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> Obj:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "privileged": False,
            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def _pinning(target: Mapping[str, Any]) -> Obj:
    """Node selector, tolerations and GPU limit that pin a pod to the target's GPU product."""
    linux = {"kubernetes.io/os": "linux"}
    if target.get("cpu"):
        return {"nodeSelector": linux, "tolerations": [], "gpu_limit": {}}
    return {
        "nodeSelector": {**linux, GPU_PRODUCT_LABEL: target["gpuProduct"]},
        "tolerations": [{"key": GPU_TAINT_KEY, "operator": "Exists", "effect": GPU_TAINT_EFFECT}],
        "gpu_limit": {GPU_RESOURCE: str(target.get("gpus", 1))},
    }


def _secret_env(secret: str | None) -> list[Obj]:
    return [{"secretRef": {"name": secret}}] if secret else []


# ----------------------------------------------------------------------------- EngineBuild + Job
def _calibration_args(model: Mapping[str, Any]) -> list[str]:
    """`--calibration URI`, passed verbatim: the build compares it with the URI the package records
    (it reads no calibration data, so nothing is mounted)."""
    return ["--calibration", model["calibrationURI"]] if model.get("calibrationURI") else []


def engine_build(md: Mapping[str, Any], spec: Mapping[str, Any], target: Mapping[str, Any],
                 config: OperatorConfig) -> Obj:
    """The EngineBuild for one target of the current spec; its name is a hash of engine identity."""
    md_name = md["metadata"]["name"]
    model = spec["model"]
    opt = spec["optimization"]
    eb_target = {k: target[k] for k in ("name", "gpuProduct", "cpu", "gpus", "backend", "precision") if k in target}
    eb_target["maxBatchSize"] = opt["maxBatchSize"]
    eb_target["batchProfile"] = dict(opt["batchProfile"])
    eb_model = {"name": model["name"], "version": model["version"], "packageURI": model["source"]["uri"],
                "signature": model["signature"]}
    if model.get("digest"):
        eb_model["digest"] = model["digest"]
    if target["precision"] == "int8" and opt.get("calibration"):
        # Part of engine identity for int8 only: other calibration data is another int8 model.
        eb_model["calibrationURI"] = opt["calibration"]["uri"]
    store = dict(spec["store"])
    identity = {"model": eb_model, "target": {k: v for k, v in eb_target.items() if k != "name"},
                "store": store["uri"]}
    image = spec.get("image", {})
    eb_spec: Obj = {
        "modelDeployment": {"name": md_name},
        "model": eb_model,
        "target": eb_target,
        "store": store,
        "image": image.get("builder") or config.builder_image,
        "pullPolicy": image.get("pullPolicy") or config.pull_policy,
        "backoffLimit": 2,
        "activeDeadlineSeconds": 3600,
    }
    if spec.get("serviceAccountName"):
        eb_spec["serviceAccountName"] = spec["serviceAccountName"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND_ENGINE_BUILD,
        "metadata": {
            "name": dns_label(md_name, target["name"], stable_hash(identity, 10)),
            "namespace": md["metadata"]["namespace"],
            "labels": labels(md_name, "engine-build", target["name"]),
            "ownerReferences": [owner_reference(md)],
        },
        "spec": eb_spec,
    }


def build_job(eb: Mapping[str, Any], config: OperatorConfig) -> Obj:
    """The Job that builds, verifies and publishes one engine on a node with the target's GPU.

    The build writes its result as JSON to /dev/termination-log (see operators/README.md);
    on failure FallbackToLogsOnError makes the log tail the message the operator reports.
    """
    spec = eb["spec"]
    target = spec["target"]
    name = eb["metadata"]["name"]
    md_name = spec["modelDeployment"]["name"]
    pin = _pinning(target)
    package, vols1, mounts1 = mount_uri(spec["model"]["packageURI"], "/mnt/package", "package", True)
    store, vols2, mounts2 = mount_uri(spec["store"]["uri"], "/mnt/store", "store", False)
    pod_labels = {**labels(md_name, "engine-build", target["name"]), LABEL_BUILD: name}
    container: Obj = {
        "name": "build",
        "image": spec["image"],
        "imagePullPolicy": spec.get("pullPolicy", config.pull_policy),
        "command": ["kubetrt", "build", "--package", package, "--target", engine_target(target).spec(),
                    "--store", store, "--termination-log", TERMINATION_LOG, *_calibration_args(spec["model"])],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "envFrom": _secret_env(spec["store"].get("credentialsSecret")),
        "resources": {"limits": dict(pin["gpu_limit"])} if pin["gpu_limit"] else {},
        "securityContext": _container_security(),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts1, *mounts2],
    }
    pod_spec: Obj = {
        "restartPolicy": "Never",
        "nodeSelector": pin["nodeSelector"],
        "tolerations": pin["tolerations"],
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, *vols1, *vols2],
    }
    if spec.get("serviceAccountName"):
        pod_spec["serviceAccountName"] = spec["serviceAccountName"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": eb["metadata"]["namespace"], "labels": dict(pod_labels),
                     "ownerReferences": [owner_reference(eb)]},
        "spec": {
            "backoffLimit": spec.get("backoffLimit", 2),
            "activeDeadlineSeconds": spec.get("activeDeadlineSeconds", 3600),
            "ttlSecondsAfterFinished": config.job_ttl_seconds,
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


# ----------------------------------------------------------------------------- serving objects
def _thread_env(container: str, resources: Mapping[str, Any]) -> list[Obj]:
    """Thread counts from the container's own CPU allowance (limit if set, else request; the
    Downward API rounds up): in a pod, os.cpu_count() is the node's core count, and OpenMP or the
    runtime's pools sized to it would oversubscribe the CFS quota the pod really gets."""
    source = "limits.cpu" if "cpu" in (resources.get("limits") or {}) else "requests.cpu"
    ref = {"resourceFieldRef": {"containerName": container, "resource": source, "divisor": "1"}}
    return [{"name": name, "valueFrom": copy.deepcopy(ref)} for name in ("OMP_NUM_THREADS", "KUBETRT_THREADS", "KUBETRT_JIT_THREADS")]


def serve_command(package: str, store: str, engine_key: str, backend: str, model: Mapping[str, Any],
                  spec: Mapping[str, Any]) -> list[str]:
    """`kubetrt serve` with every serving setting as a flag (the server reads each one). `model`
    is the serving EngineBuild's: the name and version its package and engine were built for."""
    batching = spec["batching"]
    cmd = ["kubetrt", "serve", package, "--store", store, "--engine-key", engine_key, "--cache-dir", CACHE_DIR,
           "--model-name", model["name"], "--model-version", str(model["version"]),
           "--device", backend, "--host", "0.0.0.0", "--port", str(SERVING_PORT), "--grpc-port", str(SERVING_GRPC_PORT),
           "--max-batch-size", str(batching["maxBatchSize"]),
           "--max-queue-delay-us", str(batching["maxQueueDelayMicroseconds"])]
    if batching.get("preferredBatchSizes"):
        cmd += ["--preferred-batch-sizes", ",".join(str(b) for b in batching["preferredBatchSizes"])]
    return cmd


def serving_deployment(md: Mapping[str, Any], spec: Mapping[str, Any], target: Mapping[str, Any],
                       engine: Mapping[str, Any], config: OperatorConfig) -> Obj:
    """Serving Deployment for one target; engine-bound settings come from the verified ``engine``."""
    md_name = md["metadata"]["name"]
    eb_spec = engine["spec"]
    eb_target = eb_spec["target"]
    engine_key = engine["status"]["engineKey"]
    pin = _pinning(eb_target)
    pkg, vols1, mounts1 = mount_uri(eb_spec["model"]["packageURI"], "/mnt/package", "package", True)
    store, vols2, mounts2 = mount_uri(eb_spec["store"]["uri"], "/mnt/store", "store", True)
    image = spec.get("image", {})
    resources = copy.deepcopy(target.get("resources") or {})
    resources.setdefault("requests", {}).setdefault("cpu", "500m")
    resources["requests"].setdefault("memory", "1Gi")
    if pin["gpu_limit"]:
        resources.setdefault("limits", {}).update(pin["gpu_limit"])
    env = [{"name": "HOME", "value": "/tmp"}, *_thread_env("serving", resources)]
    pod_labels = labels(md_name, "serving", target["name"])
    probe = {"port": "http", "scheme": "HTTP"}
    container: Obj = {
        "name": "serving",
        "image": image.get("serving") or config.serving_image,
        "imagePullPolicy": image.get("pullPolicy") or config.pull_policy,
        "command": serve_command(pkg, store, engine_key, eb_target["backend"], eb_spec["model"], spec),
        "ports": [{"name": "http", "containerPort": SERVING_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": SERVING_GRPC_PORT, "protocol": "TCP"}],
        "env": env,
        "envFrom": _secret_env(spec["store"].get("credentialsSecret")),
        "resources": resources,
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", **probe}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", **probe}, "periodSeconds": 10,
                          "failureThreshold": 3},
        # Loading/deserializing an engine can take minutes: liveness starts after this succeeds.
        "startupProbe": {"httpGet": {"path": "/v2/health/live", **probe}, "periodSeconds": 5,
                         "failureThreshold": 120},
        # Endpoints drop a terminating pod while it still runs: it keeps answering for this long
        # before SIGTERM, so requests already routed to it are not refused during a rollout.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "cache", "mountPath": CACHE_DIR},
                         *mounts1, *mounts2],
    }
    pod_spec: Obj = {
        "nodeSelector": pin["nodeSelector"],
        "tolerations": pin["tolerations"],
        "securityContext": _pod_security(),
        "automountServiceAccountToken": False,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}},
                    *vols1, *vols2],
    }
    if spec.get("serviceAccountName"):
        pod_spec["serviceAccountName"] = spec["serviceAccountName"]
        pod_spec["automountServiceAccountToken"] = True
    dep_spec: Obj = {
        "selector": {"matchLabels": {LABEL_MD: pod_labels[LABEL_MD], LABEL_TARGET: target["name"]}},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": dict(spec["rollout"])},
        "template": {
            "metadata": {
                "labels": pod_labels,
                "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(SERVING_PORT),
                                "prometheus.io/path": "/metrics", ANN_ENGINE_KEY: engine_key},
            },
            "spec": pod_spec,
        },
    }
    if not spec["autoscaling"]["enabled"]:
        dep_spec["replicas"] = int(target.get("replicas", 1))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(md_name, target["name"]),
            "namespace": md["metadata"]["namespace"],
            "labels": dict(pod_labels),
            "annotations": {ANN_ENGINE_KEY: engine_key, ANN_ENGINE_BUILD: engine["metadata"]["name"]},
            "ownerReferences": [owner_reference(md)],
        },
        "spec": dep_spec,
    }


def service(md: Mapping[str, Any]) -> Obj:
    """One Service for the model, selecting the serving pods of every target."""
    md_name = md["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(md_name), "namespace": md["metadata"]["namespace"],
                     "labels": labels(md_name, "serving"), "ownerReferences": [owner_reference(md)]},
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_MD: label_value(md_name), LABEL_APP_COMPONENT: "serving"},
            "ports": [{"name": "http", "port": SERVING_PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"},
                      {"name": "grpc", "port": SERVING_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                       "appProtocol": "grpc"}],
        },
    }


def autoscaler(md: Mapping[str, Any], spec: Mapping[str, Any], target: Mapping[str, Any]) -> Obj:
    """autoscaling/v2 HPA on CPU utilization for one target's Deployment."""
    md_name = md["metadata"]["name"]
    auto = spec["autoscaling"]
    dep = deployment_name(md_name, target["name"])
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": dep, "namespace": md["metadata"]["namespace"],
                     "labels": labels(md_name, "serving", target["name"]),
                     "ownerReferences": [owner_reference(md)]},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep},
            "minReplicas": auto["minReplicas"],
            "maxReplicas": max(auto["maxReplicas"], auto["minReplicas"]),
            "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {
                "type": "Utilization", "averageUtilization": auto["targetCPUUtilizationPercentage"]}}}],
        },
    }
