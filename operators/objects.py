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
from kubetrt.operators.rollout import revision_of
from kubetrt.operators.names import (
    ANN_ENGINE_BUILD,
    ANN_ENGINE_KEY,
    ANN_SPEC_HASH,
    API_VERSION,
    APP_NAME,
    BUILD_CONTAINER,
    BUILD_REFUSED_EXIT_CODE,
    ENV_BUILDER_IMAGE,
    ENV_BUILDER_IMAGE_GPU,
    ENV_CLUSTER_DOMAIN,
    ENV_IMAGE_PULL_POLICY,
    ENV_JOB_TTL_SECONDS,
    ENV_POD_DISRUPTION_BUDGETS,
    ENV_PROMETHEUS_URL,
    HTTP_ROUTE_API,
    SCALED_OBJECT_API,
    SERVICE_MONITOR_API as SERVICE_MONITOR,
    ENV_SERVING_IMAGE,
    ENV_SERVING_IMAGE_GPU,
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
    LABEL_REVISION,
    LABEL_ROLE,
    LABEL_TARGET,
    LABEL_TRACK,
    ANN_MODEL_VERSION,
    MANAGED_BY,
    TRACK_CANARY,
    TRACK_STABLE,
    canary_name,
    SERVING_CONTAINER,
    SERVING_GRPC_PORT,
    SERVING_PORT,
    SHARED_MEMORY_PATH,
    SHARED_MEMORY_VOLUME,
    TERMINATION_LOG,
    TRACE_PATH,
    dns_label,
    label_value,
    prometheus_label,
    stable_hash,
    track_service_name,
)
from kubetrt.runtime.target import CPU_PRODUCT, BatchProfile, Target

CACHE_DIR = "/var/cache/kubetrt"  # emptyDir where serving pods assemble package + engine
PRESTOP_SLEEP_SECONDS = 5  # a serving pod's preStop sleep (Kubernetes 1.30+ sleep action)

Obj = dict[str, Any]


@dataclass(frozen=True)
class OperatorConfig:
    """Operator settings (env of the operator pod; the Helm chart fills them from values).

    Images come per kind of target: a GPU target needs CUDA, CuPy and TensorRT in its image, which
    a CPU target's image should not carry.
    """

    serving_image: str = "ghcr.io/kubetrt/serving:0.1.0"
    builder_image: str = "ghcr.io/kubetrt/builder:0.1.0"
    serving_image_gpu: str = "ghcr.io/kubetrt/serving-gpu:0.1.0"
    builder_image_gpu: str = "ghcr.io/kubetrt/builder-gpu:0.1.0"
    pull_policy: str = "IfNotPresent"
    job_ttl_seconds: int = 86400
    cluster_domain: str = "cluster.local"
    pod_disruption_budgets: bool = True
    prometheus_url: str = ""  # where KEDA's prometheus trigger reads the serving metrics; "" for none

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "OperatorConfig":
        """Settings from env; an unset or empty variable keeps the default."""
        env = os.environ if env is None else env
        d = cls()

        def get(name: str, default: str) -> str:
            return env.get(name) or default
        return cls(
            serving_image=get(ENV_SERVING_IMAGE, d.serving_image),
            builder_image=get(ENV_BUILDER_IMAGE, d.builder_image),
            serving_image_gpu=get(ENV_SERVING_IMAGE_GPU, d.serving_image_gpu),
            builder_image_gpu=get(ENV_BUILDER_IMAGE_GPU, d.builder_image_gpu),
            pull_policy=get(ENV_IMAGE_PULL_POLICY, d.pull_policy),
            job_ttl_seconds=int(get(ENV_JOB_TTL_SECONDS, str(d.job_ttl_seconds))),
            cluster_domain=get(ENV_CLUSTER_DOMAIN, d.cluster_domain),
            pod_disruption_budgets=_flag(ENV_POD_DISRUPTION_BUDGETS, get(ENV_POD_DISRUPTION_BUDGETS, "true")),
            prometheus_url=_url(ENV_PROMETHEUS_URL, get(ENV_PROMETHEUS_URL, "")),
        )

    def default_image(self, part: str, gpu: bool) -> str:
        """The operator's default ``serving`` or ``builder`` image for a CPU or a GPU target."""
        images = {("serving", False): self.serving_image, ("builder", False): self.builder_image,
                  ("serving", True): self.serving_image_gpu, ("builder", True): self.builder_image_gpu}
        return images[(part, gpu)]


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"{name}={raw!r}: expected true or false")
    return value == "true"


def _url(name: str, raw: str) -> str:
    value = raw.strip()
    if value and not value.startswith(("http://", "https://")) or value in ("http://", "https://"):
        raise ValueError(f"{name}={raw!r}: expected an http:// or https:// URL, e.g. "
                         "http://prometheus-operated.monitoring.svc:9090, or nothing")
    return value.rstrip("/")


def target_image(spec: Mapping[str, Any], target: Mapping[str, Any], part: str, config: OperatorConfig) -> str:
    """The ``serving`` or ``builder`` image of one target: the target's own, else spec.image's (every
    target), else the operator's default for the target's kind (CPU or GPU)."""
    return str((target.get("image") or {}).get(part) or (spec.get("image") or {}).get(part)
               or config.default_image(part, not target.get("cpu")))


# ----------------------------------------------------------------------------- pod settings
# Scheduling and pull settings a cluster admin sets per ModelDeployment (spec) and per target; the
# target's value replaces the spec's, except nodeSelector and resources, merged key by key.
POD_SETTINGS = ("imagePullSecrets", "nodeSelector", "tolerations", "priorityClassName", "runtimeClassName")


def _merged_resources(base: Mapping[str, Any] | None, over: Mapping[str, Any] | None) -> Obj:
    out: Obj = {}
    for part in ("requests", "limits"):
        merged = {**((base or {}).get(part) or {}), **((over or {}).get(part) or {})}
        if merged:
            out[part] = merged
    return out


def pod_settings(spec: Mapping[str, Any], target: Mapping[str, Any]) -> Obj:
    """The target's pod settings over the spec's: ``resources`` for serving pods, ``buildResources``
    for build Jobs, and POD_SETTINGS for both. Empty settings are left out."""
    out: Obj = {}
    for key in POD_SETTINGS:
        value = target.get(key) if key in target else spec.get(key)
        if key == "nodeSelector":
            value = {**(spec.get(key) or {}), **(target.get(key) or {})}
        if value:
            out[key] = copy.deepcopy(value)
    for key in ("resources", "buildResources"):
        merged = _merged_resources(spec.get(key), target.get(key))
        if merged:
            out[key] = merged
    return out


def _apply_pod_settings(pod_spec: Obj, settings: Mapping[str, Any]) -> None:
    """Add the user's settings to a pod spec that already holds the operator's GPU pinning, which
    stays: its node labels win over the user's, its tolerations are kept beside the user's."""
    if settings.get("nodeSelector"):
        pod_spec["nodeSelector"] = {**settings["nodeSelector"], **pod_spec.get("nodeSelector", {})}
    tolerations = list(pod_spec.get("tolerations") or [])
    for t in settings.get("tolerations") or []:
        if t not in tolerations:
            tolerations.append(copy.deepcopy(t))
    pod_spec["tolerations"] = tolerations
    for key in ("imagePullSecrets", "priorityClassName", "runtimeClassName"):
        if settings.get(key):
            pod_spec[key] = copy.deepcopy(settings[key])


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
    t.setdefault("precision", spec["optimization"].get("precision") or crds.default_precision(is_cpu))
    t.setdefault("replicas", 1)
    if not is_cpu:
        t.setdefault("gpus", 1)
    return t


def _number_in(value: Any, low: float, high: float, include_high: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return low < value < high or (include_high and value == high)


def int8_targets(spec: Mapping[str, Any]) -> list[str]:
    """Names of the targets that build int8 (their own precision, else spec.optimization.precision;
    the per-kind defaults are never int8)."""
    default = (spec.get("optimization") or {}).get("precision")
    return [str(t.get("name")) for t in spec.get("targets", []) if t.get("precision", default) == "int8"]


def _names_twice(items: list[Mapping[str, Any]]) -> str:
    """The names more than one item carries, sorted and joined ('' where each is unique)."""
    names = [str(i.get("name")) for i in items]
    return ", ".join(sorted({n for n in names if names.count(n) > 1}))


def validate_spec(spec: Mapping[str, Any]) -> list[str]:
    """Checks the CRD's JSON schema cannot express, and its CEL rules again (API servers without CEL
    and test emulators do not evaluate them); the schema rejects the rest before the operator sees it."""
    errors = []
    dupes = _names_twice(spec.get("targets", []))
    if dupes:
        errors.append(f"duplicate target names: {dupes}")
    for t in spec.get("targets", []):
        if bool(t.get("gpuProduct")) == bool(t.get("cpu")):
            errors.append(f"target {t.get('name')}: set exactly one of gpuProduct or cpu")
        elif t.get("cpu") and t.get("backend", "host") != "host":
            errors.append(f"target {t.get('name')}: CPU targets use backend host")
    if spec.get("targets") and all(t.get("fallback") for t in spec["targets"]):
        errors.append(crds.FALLBACK_NEEDS_PRIMARY)
    given = spec.get("sidecars") or []
    if any(c.get("name") == SERVING_CONTAINER for c in given):
        errors.append(crds.SIDECAR_NAME_TAKEN)
    dupes = _names_twice(given)
    if dupes:
        errors.append(f"spec.sidecars: duplicate names: {dupes}")
    if any("volumeMounts" in c for c in given):
        errors.append(crds.SIDECAR_OWN_VOLUMES)
    prof = spec.get("optimization", {}).get("batchProfile", {})
    if prof and not prof.get("min", 1) <= prof.get("opt", 1) <= prof.get("max", 1):
        errors.append("optimization.batchProfile must satisfy min <= opt <= max")
    if not _number_in(spec.get("batching", {}).get("requestTimeoutSeconds", 1), 0, 86400, include_high=True):
        errors.append(crds.REQUEST_TIMEOUT_POSITIVE)
    auto = spec.get("autoscaling", {})
    if auto.get("enabled") and auto.get("minReplicas", 1) > auto.get("maxReplicas", 1):
        errors.append("autoscaling.minReplicas must not exceed maxReplicas")
    rollout_spec = spec.get("rollout") or {}
    if "canaryAnalysis" in rollout_spec and not rollout_spec.get("canaryTrafficPercent", 100) < 100:
        errors.append(crds.CANARY_ANALYSIS_NEEDS_CANARY)
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
    host at the same path; s3:// passes through for the container to fetch.
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


def _with_gpu_limit(resources: Mapping[str, Any] | None, gpu_limit: Mapping[str, str]) -> Obj:
    """The user's resources with the operator's GPU limit (a GPU request must equal the limit)."""
    out = copy.deepcopy(dict(resources or {}))
    if gpu_limit:
        out.setdefault("limits", {}).update(gpu_limit)
        if GPU_RESOURCE in (out.get("requests") or {}):
            out["requests"].update(gpu_limit)
    return out


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
    settings = pod_settings(spec, target)
    build_pod = {k: v for k, v in settings.items() if k in POD_SETTINGS}
    if settings.get("buildResources"):
        build_pod["resources"] = settings["buildResources"]
    if build_pod:
        # Part of the build's identity: a build pod that cannot be scheduled or pulled is retried
        # with the settings that fix it (a verified engine in the store is reused, not rebuilt).
        identity["pod"] = build_pod
    eb_spec: Obj = {
        "modelDeployment": {"name": md_name},
        "model": eb_model,
        "target": eb_target,
        "store": store,
        "image": target_image(spec, target, "builder", config),
        "pullPolicy": (spec.get("image") or {}).get("pullPolicy") or config.pull_policy,
        "backoffLimit": 2,
        "activeDeadlineSeconds": 3600,
    }
    if build_pod:
        eb_spec["pod"] = build_pod
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
        "name": BUILD_CONTAINER,
        "image": spec["image"],
        "imagePullPolicy": spec.get("pullPolicy", config.pull_policy),
        "command": ["kubetrt", "build", "--package", package, "--target", engine_target(target).spec(),
                    "--store", store, "--termination-log", TERMINATION_LOG, *_calibration_args(spec["model"])],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "envFrom": _secret_env(spec["store"].get("credentialsSecret")),
        "resources": _with_gpu_limit((spec.get("pod") or {}).get("resources"), pin["gpu_limit"]),
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
    _apply_pod_settings(pod_spec, spec.get("pod") or {})
    if spec.get("serviceAccountName"):
        pod_spec["serviceAccountName"] = spec["serviceAccountName"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": eb["metadata"]["namespace"], "labels": dict(pod_labels),
                     "ownerReferences": [owner_reference(eb)]},
        "spec": {
            "backoffLimit": spec.get("backoffLimit", 2),
            # a refused engine fails the Job now: its retries would build and refuse the same engine
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": BUILD_CONTAINER, "operator": "In", "values": [BUILD_REFUSED_EXIT_CODE]}}]},
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
           "--max-queue-delay-us", str(batching["maxQueueDelayMicroseconds"]),
           "--max-queue-size", str(batching["maxQueueSize"]), "--request-timeout-s", str(batching["requestTimeoutSeconds"])]
    if batching.get("preferredBatchSizes"):
        cmd += ["--preferred-batch-sizes", ",".join(str(b) for b in batching["preferredBatchSizes"])]
    if spec.get("sharedMemory") is not None:
        cmd.append("--shared-memory")
    if spec.get("tracing") is not None:
        cmd += ["--trace-file", TRACE_PATH, "--trace-rate", str(spec["tracing"]["rate"])]
    return cmd


def _shared_memory_mount() -> Obj:
    """The pod's in-memory /dev/shm as each of its containers mounts it (a fresh dict per container)."""
    return {"name": SHARED_MEMORY_VOLUME, "mountPath": SHARED_MEMORY_PATH}


def sidecars(spec: Mapping[str, Any]) -> list[Obj]:
    """The user's sidecar containers as a serving pod runs them: the pod's /dev/shm mounted where the
    spec turns shared memory on, and the restricted level's container settings wherever a sidecar
    says nothing of them."""
    out = []
    for given in spec.get("sidecars") or []:
        c = copy.deepcopy(dict(given))
        security = c.setdefault("securityContext", {})
        security.setdefault("allowPrivilegeEscalation", False)
        security.setdefault("capabilities", {"drop": ["ALL"]})
        if spec.get("sharedMemory") is not None:
            c["volumeMounts"] = [_shared_memory_mount()]
        out.append(c)
    return out


ROLLING_UPDATE_KEYS = ("maxSurge", "maxUnavailable")


def serving_deployment(md: Mapping[str, Any], spec: Mapping[str, Any], target: Mapping[str, Any],
                       engine: Mapping[str, Any], config: OperatorConfig, track: str = TRACK_STABLE,
                       replicas: int | None = None) -> Obj:
    """Serving Deployment for one target; engine-bound settings come from the verified ``engine``.

    ``track`` stable is the target's Deployment `<md>-<target>`, canary the one beside it that
    runs a new revision during a canary phase (its own selector, so the two never share pods).
    ``replicas`` overrides the target's count (a canary split); None under autoscaling leaves the
    count to the HPA."""
    md_name = md["metadata"]["name"]
    eb_spec = engine["spec"]
    eb_target = eb_spec["target"]
    engine_key = engine["status"]["engineKey"]
    pin = _pinning(eb_target)
    pkg, vols1, mounts1 = mount_uri(eb_spec["model"]["packageURI"], "/mnt/package", "package", True)
    store, vols2, mounts2 = mount_uri(eb_spec["store"]["uri"], "/mnt/store", "store", True)
    settings = pod_settings(spec, target)
    resources = _with_gpu_limit(settings.get("resources"), pin["gpu_limit"])
    resources.setdefault("requests", {}).setdefault("cpu", "500m")
    resources["requests"].setdefault("memory", "1Gi")
    env = [{"name": "HOME", "value": "/tmp"}, *_thread_env(SERVING_CONTAINER, resources)]
    revision = revision_of(eb_spec["model"])
    pod_labels = {**labels(md_name, "serving", target["name"]), LABEL_ROLE: role(target),
                  LABEL_REVISION: revision, LABEL_TRACK: track}
    probe = {"port": "http", "scheme": "HTTP"}
    container: Obj = {
        "name": SERVING_CONTAINER,
        # The kind of the engine served (a target changed from CPU to GPU serves its CPU engine until
        # the GPU one verified), the overrides of the live target.
        "image": target_image(spec, {**target, "cpu": eb_target.get("cpu")}, "serving", config),
        "imagePullPolicy": (spec.get("image") or {}).get("pullPolicy") or config.pull_policy,
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
        "containers": [container, *sidecars(spec)],
        "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}},
                    *vols1, *vols2],
    }
    if spec.get("sharedMemory") is not None:
        container["volumeMounts"].append(_shared_memory_mount())
        pod_spec["volumes"].append({"name": SHARED_MEMORY_VOLUME, "emptyDir": {
            "medium": "Memory", "sizeLimit": spec["sharedMemory"]["sizeLimit"]}})
    _apply_pod_settings(pod_spec, settings)
    if spec.get("serviceAccountName"):
        pod_spec["serviceAccountName"] = spec["serviceAccountName"]
        pod_spec["automountServiceAccountToken"] = True
    # The stable selector is the one earlier releases created (selectors are immutable); the
    # stable Deployment never adopts canary pods: their ReplicaSet is owned by the canary.
    selector = {LABEL_MD: pod_labels[LABEL_MD], LABEL_TARGET: target["name"]}
    if track == TRACK_CANARY:
        selector[LABEL_TRACK] = TRACK_CANARY
    rolling = {k: v for k, v in spec["rollout"].items() if k in ROLLING_UPDATE_KEYS}
    dep_spec: Obj = {
        "selector": {"matchLabels": selector},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": rolling},
        "template": {
            "metadata": {
                "labels": pod_labels,
                "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(SERVING_PORT),
                                "prometheus.io/path": "/metrics", ANN_ENGINE_KEY: engine_key,
                                ANN_MODEL_VERSION: str(eb_spec["model"]["version"])},
            },
            "spec": pod_spec,
        },
    }
    if replicas is not None:
        dep_spec["replicas"] = int(replicas)
    elif not spec["autoscaling"]["enabled"]:
        dep_spec["replicas"] = int(target.get("replicas", 1))
    name = deployment_name(md_name, target["name"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": canary_name(name) if track == TRACK_CANARY else name,
            "namespace": md["metadata"]["namespace"],
            "labels": dict(pod_labels),
            "annotations": {ANN_ENGINE_KEY: engine_key, ANN_ENGINE_BUILD: engine["metadata"]["name"]},
            "ownerReferences": [owner_reference(md)],
        },
        "spec": dep_spec,
    }


ROLE_PRIMARY = "primary"
ROLE_FALLBACK = "fallback"


def role(target: Mapping[str, Any]) -> str:
    """A target's role: fallback targets serve the main Service only while no primary target can."""
    return ROLE_FALLBACK if target.get("fallback") else ROLE_PRIMARY


def fallback_service_name(md_name: str) -> str:
    return dns_label(md_name, ROLE_FALLBACK)


def service(md: Mapping[str, Any], serve_role: str = ROLE_PRIMARY, name: str | None = None) -> Obj:
    """A Service for the model selecting the serving pods of the targets of one role: the main
    Service (``name`` None) the primary targets', or the fallback targets' while no primary target
    has a ready pod; `<name>-fallback` always the fallback targets'. No mesh needed: the operator
    switches the selector."""
    md_name = md["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name or service_name(md_name), "namespace": md["metadata"]["namespace"],
                     # <name>-fallback carries its role: the ServiceMonitor scrapes the model's Service only.
                     "labels": {**labels(md_name, "serving"), **({LABEL_ROLE: ROLE_FALLBACK} if name else {})},
                     "ownerReferences": [owner_reference(md)]},
        "spec": {
            "type": "ClusterIP",
            "selector": {LABEL_MD: label_value(md_name), LABEL_APP_COMPONENT: "serving", LABEL_ROLE: serve_role},
            "ports": [{"name": "http", "port": SERVING_PORT, "targetPort": "http", "protocol": "TCP", "appProtocol": "http"},
                      {"name": "grpc", "port": SERVING_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                       "appProtocol": "grpc"}],
        },
    }


def _target_metadata(md: Mapping[str, Any], target: Mapping[str, Any]) -> Obj:
    """Metadata of an object that goes with one target's stable Deployment (its autoscaler, its
    disruption budget): the Deployment's name, the target's serving labels, owned by the ModelDeployment."""
    md_name = md["metadata"]["name"]
    return {"name": deployment_name(md_name, target["name"]), "namespace": md["metadata"]["namespace"],
            "labels": labels(md_name, "serving", target["name"]), "ownerReferences": [owner_reference(md)]}


def autoscaler(md: Mapping[str, Any], spec: Mapping[str, Any], target: Mapping[str, Any]) -> Obj:
    """autoscaling/v2 HPA for one target's stable Deployment, on spec.autoscaling.metric."""
    md_name = md["metadata"]["name"]
    auto = spec["autoscaling"]
    dep = deployment_name(md_name, target["name"])
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _target_metadata(md, target),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep},
            "minReplicas": auto["minReplicas"],
            "maxReplicas": max(auto["maxReplicas"], auto["minReplicas"]),
            "metrics": [autoscaling_metric(auto)],
        },
    }


def autoscaling_metric(auto: Mapping[str, Any]) -> Obj:
    """The HPA metric of ``spec.autoscaling``: CPU utilization, or a Pods metric (in-flight or queued
    requests per pod, served by the custom metrics API) averaged to targetAverageValue."""
    metric = auto.get("metric", "cpu")
    if metric == "cpu":
        return {"type": "Resource", "resource": {"name": "cpu", "target": {
            "type": "Utilization", "averageUtilization": auto["targetCPUUtilizationPercentage"]}}}
    return {"type": "Pods", "pods": {"metric": {"name": load_gauge(metric)},
                                     "target": {"type": "AverageValue", "averageValue": str(auto["targetAverageValue"])}}}


def pod_disruption_budget(md: Mapping[str, Any], target: Mapping[str, Any]) -> Obj:
    """policy/v1 PodDisruptionBudget for one target's serving pods (both revisions'): maxUnavailable 1,
    so a voluntary disruption (a node drain) takes one pod at a time and never blocks for good,
    even for a single-replica target (which minAvailable 1 would)."""
    md_name = md["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _target_metadata(md, target),
        # Serving pods only: the build Job's pods carry the model and target labels too, and a budget
        # over a Job's pods fails (a Job has no scale subresource).
        "spec": {"maxUnavailable": 1,
                 "selector": {"matchLabels": {LABEL_MD: label_value(md_name), LABEL_TARGET: target["name"],
                                              LABEL_APP_COMPONENT: "serving"}}},
    }


SERVICE_MONITOR_API = SERVICE_MONITOR[:2]
# Pod labels a ServiceMonitor copies onto every series it scrapes (as kubetrt_io_revision, ...): the
# dashboard and KEDA's queries select a model's, a target's and a track's pods by them.
POD_TARGET_LABELS = (LABEL_MD, LABEL_REVISION, LABEL_TARGET, LABEL_TRACK)


def service_monitor(md: Mapping[str, Any]) -> Obj:
    """The Prometheus Operator's ServiceMonitor for the model's Service: /metrics of the pods that take
    its traffic, every revision's (a fallback target's pods while they serve it; the Service
    <name>-fallback is left out, so no pod is scraped twice)."""
    md_name = md["metadata"]["name"]
    api_version, kind = SERVICE_MONITOR_API
    selector = {k: v for k, v in labels(md_name, "serving").items()}
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": service_name(md_name), "namespace": md["metadata"]["namespace"],
                     "labels": labels(md_name, "serving"), "ownerReferences": [owner_reference(md)]},
        "spec": {
            # Not <name>-fallback (labelled with its role), nor the per-track Services of an HTTPRoute
            # (labelled with their track): each selects pods the model's Service selects too.
            "selector": {"matchLabels": selector,
                         "matchExpressions": [{"key": LABEL_ROLE, "operator": "DoesNotExist"},
                                              {"key": LABEL_TRACK, "operator": "DoesNotExist"}]},
            "endpoints": [{"port": "http", "path": "/metrics"}],
            "podTargetLabels": list(POD_TARGET_LABELS),
        },
    }


# ----------------------------------------------------------------------------- Gateway API
def track_service(md: Mapping[str, Any], track: str, serve_role: str = ROLE_PRIMARY) -> Obj:
    """`<md>-stable` or `<md>-canary`: the model's Service narrowed to one track's pods (of the role
    the model's Service selects), an HTTPRoute backend. Labelled with its track, so the ServiceMonitor
    leaves it out (its pods are scraped through the model's Service)."""
    if track not in (TRACK_STABLE, TRACK_CANARY):
        raise ValueError(f"track={track!r}: expected {TRACK_STABLE} or {TRACK_CANARY}")
    out = service(md, serve_role)
    out["metadata"]["name"] = track_service_name(md["metadata"]["name"], track)
    out["metadata"]["labels"][LABEL_TRACK] = track
    out["spec"]["selector"][LABEL_TRACK] = track
    return out


GATEWAY_GROUP = HTTP_ROUTE_API[0].split("/")[0]


def http_route(md: Mapping[str, Any], spec: Mapping[str, Any], canary_weight: int) -> Obj:
    """The Gateway API HTTPRoute `<md>`: HTTP (port http) to the stable track's Service with weight
    100 - ``canary_weight`` and the canary track's with ``canary_weight`` (left out at 0), so a
    Gateway splits requests exactly, whatever the replica counts. parentRefs come from
    ``spec.rollout.gateway``; without it the route is attached to no Gateway and carries nothing."""
    if not 0 <= canary_weight < 100:
        raise ValueError(f"canary weight {canary_weight}: expected 0..99 (the stable track keeps the rest)")
    md_name = md["metadata"]["name"]
    gateway = (spec.get("rollout") or {}).get("gateway") or {}
    backends = [{"name": track_service_name(md_name, TRACK_STABLE), "port": SERVING_PORT,
                 "weight": 100 - canary_weight}]
    if canary_weight:
        backends.append({"name": track_service_name(md_name, TRACK_CANARY), "port": SERVING_PORT,
                         "weight": canary_weight})
    route_spec: Obj = {"rules": [{"backendRefs": backends}]}
    if gateway:
        parent = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": gateway["name"]}
        parent.update({k: gateway[k] for k in ("namespace", "sectionName") if gateway.get(k)})
        route_spec["parentRefs"] = [parent]
        if gateway.get("hostnames"):
            route_spec["hostnames"] = list(gateway["hostnames"])
    api_version, kind, _ = HTTP_ROUTE_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": service_name(md_name), "namespace": md["metadata"]["namespace"],
                     "labels": labels(md_name, "serving"), "ownerReferences": [owner_reference(md)]},
        "spec": route_spec,
    }


# ----------------------------------------------------------------------------- KEDA
KEDA = "KEDA"
HPA = "HPA"


@dataclass(frozen=True)
class AutoscalingChoice:
    """Which object scales a ModelDeployment's targets (``mechanism``: KEDA or HPA) and why."""

    mechanism: str
    reason: str


def autoscaling_choice(auto: Mapping[str, Any], keda_served: bool, prometheus_url: str) -> AutoscalingChoice:
    """KEDA's ScaledObject for a load metric where its CRD is served and the operator knows the
    Prometheus to query; else the HPA (on CPU, or on a Pods metric the Prometheus adapter serves)."""
    metric = auto.get("metric", "cpu")
    if metric == "cpu":
        return AutoscalingChoice(HPA, "metric cpu: an HPA on CPU utilization (metrics-server)")
    gauge = load_gauge(metric)
    if keda_served and prometheus_url:
        return AutoscalingChoice(KEDA, f"KEDA's ScaledObject CRD is served and {ENV_PROMETHEUS_URL} is set: a "
                                       f"prometheus trigger on sum({gauge}) of the stable pods at {prometheus_url}")
    why = (f"KEDA's ScaledObject CRD is served but {ENV_PROMETHEUS_URL} is not set" if keda_served
           else "KEDA's ScaledObject CRD is not served")
    return AutoscalingChoice(HPA, f"{why}: an HPA on the Pods metric {gauge} from the custom metrics API "
                                  "(the Prometheus adapter)")


def load_gauge(metric: str) -> str:
    """The serving gauge of a load metric (concurrency: in-flight requests, queue: queued requests)."""
    gauges = {"concurrency": crds.METRIC_INFLIGHT, "queue": crds.METRIC_QUEUE}
    if metric not in gauges:
        raise ValueError(f"spec.autoscaling.metric={metric!r}: expected one of {', '.join(crds.AUTOSCALING_METRICS)}")
    return gauges[metric]


def keda_query(md: Mapping[str, Any], target: Mapping[str, Any], metric: str) -> str:
    """PromQL for one target's load: the gauge summed over its stable pods, selected by the labels the
    operator's ServiceMonitor copies from the pods (KEDA divides it by targetAverageValue)."""
    meta = md["metadata"]
    matchers = {"namespace": meta["namespace"], prometheus_label(LABEL_MD): label_value(meta["name"]),
                prometheus_label(LABEL_TARGET): target["name"], prometheus_label(LABEL_TRACK): TRACK_STABLE}
    inner = ",".join(f'{k}="{v}"' for k, v in matchers.items())
    return f"sum({load_gauge(metric)}{{{inner}}})"


def scaled_object(md: Mapping[str, Any], spec: Mapping[str, Any], target: Mapping[str, Any],
                  prometheus_url: str) -> Obj:
    """KEDA ScaledObject for one target's stable Deployment (KEDA makes and owns its HPA,
    keda-hpa-<name>): a prometheus trigger on the target's in-flight or queued requests."""
    if not prometheus_url:
        raise ValueError(f"a ScaledObject needs the Prometheus address ({ENV_PROMETHEUS_URL})")
    md_name = md["metadata"]["name"]
    auto = spec["autoscaling"]
    dep = deployment_name(md_name, target["name"])
    api_version, kind, _ = SCALED_OBJECT_API
    return {
        "apiVersion": api_version,
        "kind": kind,
        "metadata": _target_metadata(md, target),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep},
            "minReplicaCount": auto["minReplicas"],
            "maxReplicaCount": max(auto["maxReplicas"], auto["minReplicas"]),
            "triggers": [{"type": "prometheus", "metadata": {
                "serverAddress": prometheus_url, "query": keda_query(md, target, auto["metric"]),
                "threshold": str(auto["targetAverageValue"])}}],
        },
    }
