"""CRD definitions: the single source of truth for the kubetrt.io API (and the generator of its YAML).

Everything else derives from the dicts built here: the YAML in ``manifests/`` and in
``helm/kubetrt/crds/`` (written by ``python -m kubetrt.operators.crds --write``, checked by
``--check`` and by tests/operators), the defaults the operator applies to objects it reads
(``apply_defaults``: the API server applies the same defaults, test emulators do not), and the
JSON schemas that tests validate example custom resources against.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any, Mapping

import yaml

from kubetrt.operators.names import (API_VERSION, APP_NAME, DNS_LABEL_MAX, DNS_LABEL_PATTERN, GPU_PRODUCT_LABEL,
                                     GPU_RESOURCE, GROUP, KIND_ENGINE_BUILD, KIND_MODEL_DEPLOYMENT,
                                     LABEL_APP_COMPONENT, LABEL_APP_NAME, LABEL_APP_PART_OF, LABEL_REVISION, LABEL_VALUE_MAX,
                                     LABEL_VALUE_PATTERN, OPERATOR_NAME, OPERATOR_NAMESPACE, PLURAL_ENGINE_BUILDS,
                                     PLURAL_MODEL_DEPLOYMENTS, SERVING_CONTAINER, SERVING_GRPC_PORT, SERVING_PORT,
                                     SHARED_MEMORY_PATH, TARGET_NAME_MAX, TRACE_PATH, VERSION)
from kubetrt.runtime.target import BACKENDS, PRECISIONS, BatchProfile

GPU_BACKENDS = [b for b in BACKENDS if b != "host"]
# A target's precision when neither it nor spec.optimization sets one: what `kubetrt build --target`
# gives a spec without one (runtime/target.py), per kind.
DEFAULT_PRECISION_GPU = "fp16"
DEFAULT_PRECISION_CPU = "fp32"
CALIBRATION_METHODS = ["minmax", "percentile", "entropy"]
DEFAULT_CALIBRATION_METHOD = "minmax"  # `kubetrt lower --calibration-method`'s default
# The batcher forms batches up to the engine's own largest batch by default.
DEFAULT_BATCHING_MAX_BATCH_SIZE = BatchProfile().max
# What a serving pod queues and how long a request may take: `kubetrt serve`'s own defaults.
DEFAULT_MAX_QUEUE_SIZE = 1024
DEFAULT_REQUEST_TIMEOUT_S = 30.0
DEFAULT_TRACE_RATE = 1000  # one traced call in this many: `kubetrt serve --trace-rate`'s default
DEFAULT_HOLDOUT_FRACTION = 0.2
# One wording for the API server's CEL rule and the operator's own check (objects.validate_spec).
INT8_NEEDS_CALIBRATION = ("int8 targets need spec.optimization.calibration.uri: the calibration data the model "
                          "package was quantized with (`kubetrt lower --calibration DATA`), as its manifest "
                          "records it, e.g. s3://, gs://, file:// or pvc://<claim>/<path>")
PERCENTILE_NEEDS_METHOD = "spec.optimization.calibration.percentile is only used with method percentile"
AUTOSCALING_METRICS = ("cpu", "concurrency", "queue")
METRIC_INFLIGHT = "kubetrt_inflight_requests"  # serving/metrics.py's gauges, as the HPA's Pods metrics
METRIC_QUEUE = "kubetrt_queue_depth"
CANARY_ANALYSIS_NEEDS_CANARY = ("spec.rollout.canaryAnalysis needs spec.rollout.canaryTrafficPercent below 100 "
                                "(the canary it judges)")
HOLDOUT_FRACTION_RANGE = "spec.optimization.calibration.holdoutFraction must be greater than 0 and less than 1"
PERCENTILE_RANGE = "spec.optimization.calibration.percentile must be greater than 0 and at most 100"
MAX_P99_POSITIVE = "spec.rollout.canaryAnalysis.maxP99Milliseconds must be greater than 0"
REQUEST_TIMEOUT_POSITIVE = "spec.batching.requestTimeoutSeconds must be greater than 0"
# A real API server words a failed oneOf as "must validate one and only one schema (oneOf)", which
# names neither field: these rules say what a target must hold, in the API server's own error.
TARGET_KIND = (f"a target sets exactly one of gpuProduct (the GPU's {GPU_PRODUCT_LABEL} label, "
               "e.g. NVIDIA-H100-80GB-HBM3) or cpu: true")
TARGET_BACKEND = "CPU targets use backend host; GPU targets use backend cuda or tensorrt"
BATCH_PROFILE_ORDER = "batchProfile must satisfy min <= opt <= max"
FALLBACK_NEEDS_PRIMARY = ("at least one target must not be a fallback: fallback targets serve only while no "
                          "primary target can")
SIDECAR_NAME_TAKEN = f"spec.sidecars: the name {SERVING_CONTAINER} is the serving container's"
SIDECAR_OWN_VOLUMES = (f"spec.sidecars: a sidecar mounts no volumes of its own; with spec.sharedMemory every "
                       f"sidecar gets the pod's {SHARED_MEMORY_PATH}")
DEFAULT_SHARED_MEMORY_SIZE = "1Gi"
BUILD_PHASES = ["Pending", "Running", "Succeeded", "Failed"]
CONDITION_TYPES = ["Ready", "Progressing", "Degraded", "EnginesReady", "RolledBack"]

# Where a model package or an engine store may live (what the engine store reads and writes);
# pvc://<claim>/<path> is mounted into pods.
STORE_URI_PATTERN = r"^(s3|file|pvc)://.+"
# Gateway API references: a Gateway's name and listener (DNS-1123 subdomains), its namespace, host names.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL_RFC1123 = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
GATEWAY_HOSTNAME = r"^(\*\.)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Calibration data as `kubetrt lower --calibration` recorded it: compared, never read, so also gs://.
CALIBRATION_URI_PATTERN = r"^(s3|gs|file|pvc)://.+"
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

REPO_ROOT = Path(__file__).resolve().parent.parent
MANIFEST_CRD_FILE = REPO_ROOT / "manifests" / "00-crds.yaml"
CHART_CRD_DIR = REPO_ROOT / "helm" / "kubetrt" / "crds"
# Status objects whose fields the operator may extend without a schema change.
PRESERVE_UNKNOWN_FIELDS: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}
HEADER = "# GENERATED by `python -m kubetrt.operators.crds --write` from operators/crds.py. Do not edit.\n"


def default_precision(cpu: bool) -> str:
    """A target's precision when neither the target nor spec.optimization sets one."""
    return DEFAULT_PRECISION_CPU if cpu else DEFAULT_PRECISION_GPU


# ----------------------------------------------------------------------------- schema helpers
def _str(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _int(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "format": "int32", "description": description, **extra}


def _obj(description: str, properties: Mapping[str, Any], required: list[str] | None = None,
         **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "description": description, "properties": dict(properties)}
    if required:
        out["required"] = required
    out.update(extra)
    return out


def _int_or_string(description: str, default: Any | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"x-kubernetes-int-or-string": True, "description": description,
                           "anyOf": [{"type": "integer"}, {"type": "string"}]}
    if default is not None:
        out["default"] = default
    return out


def _quantity_map(description: str) -> dict[str, Any]:
    quantity = {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN,
                "x-kubernetes-int-or-string": True}
    return {"type": "object", "description": description, "additionalProperties": quantity}


def _resources(what: str = "the serving container") -> dict[str, Any]:
    return _obj(f"Compute resources of {what} (requests/limits; a target's are merged over spec's key by "
                f"key). {GPU_RESOURCE} is set by the operator.", {
        "requests": _quantity_map("Minimum resources, e.g. cpu: 500m, memory: 2Gi."),
        "limits": _quantity_map("Maximum resources."),
    })


def _pod_settings(scope: str) -> dict[str, Any]:
    """What a cluster admin sets on build Jobs' and serving pods (as KServe's and the NIM Operator's
    pod specs offer): per ModelDeployment, and per target over it."""
    toleration = _obj("A toleration, as in a PodSpec.", {
        "key": _str("Taint key (empty with operator Exists: every taint)."),
        "operator": _str("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": _str("Taint value (operator Equal)."),
        "effect": _str("Taint effect (empty: every effect).", enum=["NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": {"type": "integer", "format": "int64",
                              "description": "How long a NoExecute taint is tolerated."},
    })
    return {
        "imagePullSecrets": {"type": "array", "maxItems": 16,
                             "description": f"Secrets to pull the images with, for build Jobs and serving pods{scope}.",
                             "items": _obj("A Secret of type kubernetes.io/dockerconfigjson in the namespace.", {
                                 "name": _str("Secret name.", minLength=1, maxLength=253)}, required=["name"])},
        "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"},
                         "description": f"Node labels build Jobs and serving pods must match{scope}; a target's are "
                                        f"merged over spec's. GPU targets keep the operator's {GPU_PRODUCT_LABEL}."},
        "tolerations": {"type": "array", "items": toleration, "maxItems": 32,
                        "description": f"Tolerations of build Jobs and serving pods{scope}, beside the "
                                       f"{GPU_RESOURCE}:NoSchedule toleration the operator gives GPU targets."},
        "priorityClassName": _str(f"PriorityClass of build Jobs and serving pods{scope}.", maxLength=253),
        "runtimeClassName": _str(f"RuntimeClass of build Jobs and serving pods{scope} (e.g. nvidia).", maxLength=253),
        "resources": _resources("the serving container"),
        "buildResources": _resources("the build Job's container"),
    }


def _images(scope: str) -> dict[str, Any]:
    return {
        "serving": _str(f"Serving image{scope}.", minLength=1),
        "builder": _str(f"Engine builder image{scope}.", minLength=1),
    }


def _uri(description: str, pattern: str = STORE_URI_PATTERN) -> dict[str, Any]:
    return _str(description, pattern=pattern, minLength=6)


def _cel(rule: str, message: str) -> dict[str, Any]:
    """An x-kubernetes-validations entry (CEL, evaluated by the API server after defaulting)."""
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


def _calibration() -> dict[str, Any]:
    # Exclusive bounds are CEL rules: OpenAPI v3.0 spells them exclusiveMinimum: true, which JSON Schema
    # draft 6+ validators (the tests') read as the number 1.
    return _obj("How the package's INT8 model was calibrated (`kubetrt lower --calibration`; the pipeline "
                "copies it from the package manifest). Required when a target builds int8: the build "
                "refuses a package calibrated with other data.", {
        "uri": _uri("The calibration data the package was quantized with, as `kubetrt lower --calibration` "
                    "recorded it in the package manifest (the pipeline copies it): s3://, gs://, file:// or "
                    "pvc://<claim>/<path>. The build compares it with that record and refuses a package "
                    "calibrated with other data; nothing reads the data.", CALIBRATION_URI_PATTERN),
        "method": _str("Calibration method the activation ranges were taken with (as `kubetrt lower "
                       "--calibration-method`).", enum=CALIBRATION_METHODS, default=DEFAULT_CALIBRATION_METHOD),
        "percentile": {"type": "number", "minimum": 0, "maximum": 100,
                       "description": "Percentile of |activation| kept (method percentile only), e.g. 99.999.",
                       **_cel("self > 0.0", PERCENTILE_RANGE)},
        "holdoutFraction": {"type": "number", "minimum": 0, "maximum": 1, "default": DEFAULT_HOLDOUT_FRACTION,
                            "description": "Fraction of the data held out of calibration to check accuracy on.",
                            **_cel("self > 0.0 && self < 1.0", HOLDOUT_FRACTION_RANGE)},
    }, required=["uri"], **_cel("!has(self.percentile) || (has(self.method) && self.method == 'percentile')",
                                PERCENTILE_NEEDS_METHOD))


def _int8_needs_calibration_rule() -> str:
    """CEL over ModelDeployment.spec: a target building int8 (its own precision, else the default) needs
    spec.optimization.calibration."""
    default = (f"(has(self.optimization) && has(self.optimization.precision) ? self.optimization.precision "
               f": (has(t.cpu) ? '{DEFAULT_PRECISION_CPU}' : '{DEFAULT_PRECISION_GPU}'))")
    return (f"!self.targets.exists(t, (has(t.precision) ? t.precision : {default}) == 'int8') || "
            "(has(self.optimization) && has(self.optimization.calibration))")


def _batch_profile() -> dict[str, Any]:
    default = BatchProfile()  # the profile a target spec without one gets
    return _obj("Optimization profile of the dynamic batch dimension (TensorRT min/opt/max).", {
        "min": _int("Smallest batch the engine accepts.", minimum=1, default=default.min),
        "opt": _int("Batch size the engine is tuned for.", minimum=1, default=default.opt),
        "max": _int("Largest batch the engine accepts.", minimum=1, default=default.max),
    }, default={}, **_cel(
        # The API server checks the rule against the default ({}) too, where min, opt and max are absent.
        "!has(self.min) || !has(self.opt) || !has(self.max) || (self.min <= self.opt && self.opt <= self.max)",
        BATCH_PROFILE_ORDER))


def _target_fields() -> dict[str, Any]:
    """The fields that say where and how one engine is built and served (shared by both kinds)."""
    return {
        "name": _str("Target name (DNS label): names the Deployment <deployment>-<name>.",
                     pattern=DNS_LABEL_PATTERN, maxLength=TARGET_NAME_MAX),
        "gpuProduct": _str(f"GPU product as labelled by GPU Feature Discovery ({GPU_PRODUCT_LABEL}), "
                           "e.g. NVIDIA-H100-80GB-HBM3 or Tesla-T4. Pods and build Jobs are pinned to it.",
                           minLength=1, maxLength=LABEL_VALUE_MAX, pattern=LABEL_VALUE_PATTERN),
        "cpu": {"type": "boolean", "enum": [True],
                "description": "Set to true for a CPU-only target (backend host). Mutually exclusive with gpuProduct."},
        "gpus": _int(f"GPUs per pod ({GPU_RESOURCE} limit) for GPU targets.", minimum=1, maximum=16, default=1),
        "backend": _str("Device runtime. Default: tensorrt for GPU targets, host for CPU targets.",
                        enum=list(BACKENDS)),
        "precision": _str(f"Engine precision. Default: spec.optimization.precision, else {DEFAULT_PRECISION_GPU} "
                          f"for GPU targets and {DEFAULT_PRECISION_CPU} for CPU targets.", enum=list(PRECISIONS)),
    }


def _target_rules() -> dict[str, Any]:
    """Exactly one of gpuProduct / cpu; CPU targets run the host backend, GPU targets a GPU backend."""
    return {"x-kubernetes-validations": [
        {"rule": "has(self.gpuProduct) != has(self.cpu)", "message": TARGET_KIND},
        {"rule": "!has(self.backend) || (has(self.cpu) ? self.backend == 'host' : self.backend != 'host')",
         "message": TARGET_BACKEND},
    ]}


def _condition() -> dict[str, Any]:
    return _obj("A standard Kubernetes condition.", {
        "type": _str("Condition type.", enum=CONDITION_TYPES),
        "status": _str("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _str("CamelCase machine-readable reason."),
        "message": _str("Human-readable detail."),
        "lastTransitionTime": _str("When status last changed.", format="date-time"),
        "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
    }, required=["type", "status"])


# ----------------------------------------------------------------------------- ModelDeployment
def model_deployment_spec_schema() -> dict[str, Any]:
    """OpenAPI v3 schema of ModelDeployment.spec."""
    target = _obj("One serving target: a GPU product (or CPU) with its engine settings and replicas.", {
        **_target_fields(),
        "replicas": _int("Serving replicas (ignored while autoscaling is enabled).", minimum=0, default=1),
        "fallback": {"type": "boolean", "default": False, "description": (
            "A fallback target (e.g. CPU behind GPU targets) takes no traffic of the model's Service while a "
            "primary target has a ready pod; while none has, the Service selects the fallback targets' pods "
            "instead. The Service <name>-fallback always selects them.")},
        "image": _obj("This target's images, over spec.image and the operator's defaults.", _images(" of this target")),
        **_pod_settings(" of this target (replaces spec's)"),
    }, required=["name"], **_target_rules())
    return _obj("Desired state: which model package to serve, how to optimize it, on which targets.", {
        "model": _obj("The model to serve.", {
            "name": _str("Model name as served on /v2/models/<name>.", pattern=DNS_LABEL_PATTERN,
                         maxLength=DNS_LABEL_MAX),
            "version": _str("Model version.", default="1", minLength=1, maxLength=63),
            "digest": _str("Optional sha256 of the package manifest; pins the package and is part of engine identity.",
                           pattern=r"^sha256:[a-f0-9]{64}$"),
            "signature": _str("SavedModel signature the package was lowered from.", default="serving_default",
                              minLength=1),
            "source": _obj("Where the lowered model package lives.", {
                "uri": _uri("s3://bucket/prefix, file:///path or pvc://<claim>/<path>."),
            }, required=["uri"]),
        }, required=["name", "source"]),
        "store": _obj("The engine store builds publish to and serving pods load from.", {
            "uri": _uri("s3://, file:// or pvc://<claim>/<path>."),
            "credentialsSecret": _str("Secret whose keys are exposed as env to builds and pods (e.g. AWS_*).",
                                      pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", maxLength=253),
        }, required=["uri"]),
        "image": _obj("Images of every target. Unset, each target gets the operator's default for its kind: "
                      "the CPU serving and builder images (KUBETRT_SERVING_IMAGE, KUBETRT_BUILDER_IMAGE) for cpu "
                      "targets, the GPU ones with CUDA, CuPy and TensorRT (KUBETRT_SERVING_IMAGE_GPU, "
                      "KUBETRT_BUILDER_IMAGE_GPU) for gpuProduct targets. targets[].image overrides these.", {
            **_images(" of every target"),
            "pullPolicy": _str("Image pull policy.", enum=["Always", "IfNotPresent", "Never"]),
        }),
        **_pod_settings(""),
        "serviceAccountName": _str("ServiceAccount for serving pods and build Jobs (e.g. for IRSA/Workload Identity).",
                                   pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", maxLength=253),
        "optimization": _obj("Engine build settings shared by all targets.", {
            "precision": _str(f"Precision of the targets that do not set one; unset, GPU targets build "
                              f"{DEFAULT_PRECISION_GPU} and CPU targets {DEFAULT_PRECISION_CPU}.",
                              enum=list(PRECISIONS)),
            "maxBatchSize": _int("Largest batch an engine is built for.", minimum=1, maximum=4096, default=32),
            "batchProfile": _batch_profile(),
            "calibration": _calibration(),
        }, default={}),
        "targets": {
            "type": "array", "minItems": 1, "maxItems": 16,
            "description": "Serving targets, one per GPU product (and optionally one CPU target).",
            "items": target,
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
        },
        "batching": _obj("Dynamic batching in the serving pods.", {
            "maxBatchSize": _int("Largest batch the batcher forms (`kubetrt serve --max-batch-size`).", minimum=1,
                                 maximum=4096, default=DEFAULT_BATCHING_MAX_BATCH_SIZE),
            "maxQueueDelayMicroseconds": _int(
                "How long a batch formed after a busy run may wait for more requests to fill it; a request "
                "that finds the engine idle never waits (0: batches form only from what queued meanwhile).",
                minimum=0, maximum=10_000_000, default=0),
            "preferredBatchSizes": {"type": "array", "description": "Batch sizes the batcher prefers to form.",
                                    "items": {"type": "integer", "format": "int32", "minimum": 1}, "maxItems": 16},
            "maxQueueSize": _int(
                f"Requests a serving pod queues per model while its engine is busy (`kubetrt serve --max-queue-size`); "
                f"past it a request is refused at once, 503 with Retry-After over REST and RESOURCE_EXHAUSTED over "
                f"gRPC, instead of waiting into a timeout. {METRIC_QUEUE} shows the queue.",
                minimum=1, maximum=1_000_000, default=DEFAULT_MAX_QUEUE_SIZE),
            "requestTimeoutSeconds": {
                # CEL, not a fractional minimum: the API server compares a whole number with minimum's
                # whole part, so 0 would pass a minimum of 0.001
                "type": "number", "maximum": 86400, "default": DEFAULT_REQUEST_TIMEOUT_S,
                **_cel("self > 0.0", REQUEST_TIMEOUT_POSITIVE),
                "description": "Each request's deadline in a serving pod (`kubetrt serve --request-timeout-s`): a "
                               "request not answered by then gets 504 (DEADLINE_EXCEEDED over gRPC), and one the "
                               "queued work would keep past it is refused at once as the queue's overflow is. A "
                               "client's own deadline (grpc-timeout, the OIP timeout parameter) can only shorten it."},
        }, default={}),
        "sharedMemory": _obj(
            "Triton's system shared memory extension on the serving pods (`kubetrt serve --shared-memory`): a "
            "client in a sidecar (spec.sidecars) registers regions of POSIX shared memory objects and names them "
            "in its requests instead of sending the tensors over the socket. Each serving pod gets a "
            f"{SHARED_MEMORY_PATH} of sizeLimit, an emptyDir in memory that counts against the pod's memory, "
            "mounted in the serving container and every sidecar. Whoever can reach the serving endpoints can "
            f"then have the server read and write the objects in the pod's {SHARED_MEMORY_PATH}.", {
                "sizeLimit": {"anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN,
                              "x-kubernetes-int-or-string": True, "default": DEFAULT_SHARED_MEMORY_SIZE,
                              "description": f"Size of the pods' {SHARED_MEMORY_PATH} (a quantity, e.g. 1Gi)."},
            }),
        "tracing": _obj(
            "Per-request traces on the serving pods, as Triton's trace at level TIMESTAMPS (`kubetrt serve "
            "--trace-file --trace-rate`): one inference call in rate is traced, and written when it ends as a "
            f"JSON line on the serving container's standard output ({TRACE_PATH}; its logs go to standard "
            "error), with the model, version, outcome and the REQUEST_START, QUEUE_START, COMPUTE_START, "
            "COMPUTE_END and REQUEST_END stamps, in nanoseconds on one monotonic clock per pod. `kubectl logs` "
            "shows them. Unset, no call is traced.", {
                "rate": _int("Trace one inference call in this many (1: every call).", minimum=1,
                             maximum=1_000_000_000, default=DEFAULT_TRACE_RATE),
            }),
        "sidecars": {
            "type": "array", "maxItems": 8,
            "description": "Containers that run beside the serving container in every serving pod (a Container "
                           "as in a PodSpec), e.g. a preprocessing client that reaches the model on "
                           f"localhost:{SERVING_PORT} (gRPC {SERVING_GRPC_PORT}) and, with spec.sharedMemory, "
                           f"through {SHARED_MEMORY_PATH}. They run under the pod's security context (non-root); "
                           "the operator sets allowPrivilegeEscalation false and drops every capability where a "
                           "sidecar says nothing, as Pod Security's restricted level asks.",
            "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "required": ["name", "image"],
                      "properties": {"name": _str("Container name, unique in the pod.", maxLength=63,
                                                  pattern=DNS_LABEL_RFC1123),
                                     "image": _str("Container image.", minLength=1),
                                     "volumeMounts": {"type": "array", "description": SIDECAR_OWN_VOLUMES,
                                                      "items": {"type": "object",
                                                                "x-kubernetes-preserve-unknown-fields": True}}}},
            "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
            "x-kubernetes-validations": [
                {"rule": f"self.all(c, c.name != '{SERVING_CONTAINER}')", "message": SIDECAR_NAME_TAKEN},
                {"rule": "self.all(c, !has(c.volumeMounts))", "message": SIDECAR_OWN_VOLUMES},
            ],
        },
        "autoscaling": _obj("HorizontalPodAutoscaler (autoscaling/v2) per target, on CPU utilization or on load.", {
            "enabled": {"type": "boolean", "default": False, "description": "Create an HPA per target."},
            "metric": _str(
                "What the HPA scales on. cpu: the pods' CPU utilization (targetCPUUtilizationPercentage; needs "
                "metrics-server). concurrency: in-flight requests per pod (the serving pods' "
                f"{METRIC_INFLIGHT} gauge); queue: requests waiting in the batcher per pod ({METRIC_QUEUE}); "
                "both per pod, kept at targetAverageValue. Where KEDA's ScaledObject CRD is served and the "
                "operator has a Prometheus address (KUBETRT_PROMETHEUS_URL), a KEDA ScaledObject per target "
                "queries the gauge summed over the target's stable pods; otherwise an HPA reads it as a Pods "
                "metric from the custom metrics API (custom.metrics.k8s.io): install the Prometheus adapter "
                "with a rule exposing the gauge under the same name. status.autoscaling says which and why.",
                enum=list(AUTOSCALING_METRICS), default="cpu"),
            "targetAverageValue": _int("Per-pod average of the concurrency or queue metric the HPA keeps "
                                       "(in-flight or queued requests); not used for cpu.", minimum=1, default=4),
            "minReplicas": _int("Lower bound of replicas per target. 0 (scale to zero) is not supported, with "
                                "or without KEDA: an HPA cannot scale to zero, and the load metrics come from the "
                                "serving pods themselves, so a target at zero pods has no signal to scale up on.",
                                minimum=1, default=1),
            "maxReplicas": _int("Upper bound of replicas per target.", minimum=1, default=4),
            "targetCPUUtilizationPercentage": _int("Target average CPU utilization.", minimum=1, maximum=100,
                                                   default=80),
        }, default={}),
        "rollout": _obj(
            "How changes reach the serving pods. A change of spec.model (version, digest or package URI) is a new "
            "revision: its engines are built and verified first. Without canaryTrafficPercent (or at 100) the "
            "new revision replaces the old by a rolling update that removes an old pod only once a new one is "
            "ready; maxSurge and maxUnavailable are that update's settings (also for every other change).", {
                "maxSurge": _int_or_string("Extra pods during a rollout (count or percentage).", default="25%"),
                "maxUnavailable": _int_or_string("Pods that may be unavailable during a rollout.", default=0),
                "canaryTrafficPercent": _int(
                    "KServe's canaryTrafficPercent: the share of traffic a new revision gets while the last "
                    "revision keeps the rest. A target's canary runs in its own Deployment <md>-<target>-canary "
                    "behind the same Service; with no mesh, the share is carried by replica counts: the canary "
                    "gets ceil(replicas * pct / 100) replicas, at least 1, and the stable revision keeps the "
                    "rest, at least 1 (so 1 replica at 10% runs one of each: half the requests). The stable "
                    "revision gives up its replicas once the canary's are ready. Under autoscaling the HPA keeps "
                    "the stable Deployment's count N and the canary gets ceil(N * pct / (100 - pct)). Setting "
                    "100 (or removing the field) promotes the canary: the stable Deployment rolls to its "
                    "revision, then the canary Deployment is removed. Where the Gateway API's HTTPRoute CRD is "
                    "served, the HTTPRoute <md> also carries the share exactly, by weights (see gateway).",
                    minimum=1, maximum=100),
                "gateway": _obj(
                    "The Gateway the HTTPRoute <md> attaches to (its parentRef), where the Gateway API's HTTPRoute "
                    "CRD is served: the route sends HTTP to the Services <md>-stable and <md>-canary with weights "
                    "100 - canaryTrafficPercent and canaryTrafficPercent (the canary's once all its pods are "
                    "ready), so requests through the Gateway split exactly. Unset, the route is attached to no "
                    "Gateway and carries nothing; the model's Service splits by replica counts either way.", {
                        "name": _str("The Gateway's name.", minLength=1, maxLength=253, pattern=DNS_SUBDOMAIN),
                        "namespace": _str("The Gateway's namespace (default: the ModelDeployment's; another "
                                          "namespace's Gateway must allow routes from this one).",
                                          minLength=1, maxLength=63, pattern=DNS_LABEL_RFC1123),
                        "sectionName": _str("The Gateway listener to attach to (default: every listener that "
                                            "allows the route).", minLength=1, maxLength=253, pattern=DNS_SUBDOMAIN),
                        "hostnames": {"type": "array", "maxItems": 16, "description":
                                      "Host names the route matches (default: every host of the listener).",
                                      "items": {"type": "string", "minLength": 1, "maxLength": 253,
                                                "pattern": GATEWAY_HOSTNAME}},
                    }, required=["name"]),
                "canaryAnalysis": _obj(
                    "Automatic promotion and rollback of a canary (needs canaryTrafficPercent below 100). Once "
                    "every canary pod is ready, the operator reads the canary pods' /metrics (request counts by "
                    "outcome, the request latency histogram) through the API server's pod proxy. The canary "
                    "fails, and is rolled back, when its error rate (server errors: error, unavailable, "
                    "overloaded, timeout; over every request but bad requests and unknown models) or its p99 "
                    "(the upper bound of the histogram bucket holding it) exceeds its bound after minRequests "
                    "requests, when a canary pod is stuck (crash loop, image pull, unschedulable), or when the "
                    "new revision's engine fails its golden check. Rolled back: the stable revision gets every "
                    "replica again, the canary Deployment is removed, the RolledBack condition and a Warning "
                    "Event name the measured cause, and the revision stays rolled back until spec.model changes. "
                    "A canary within bounds for windowSeconds with at least minRequests requests is promoted.", {
                        "windowSeconds": _int("How long the canary must hold, from all its pods ready.",
                                              minimum=1, maximum=86400, default=60),
                        "minRequests": _int("Requests the canary must have served before it is judged.",
                                            minimum=1, default=10),
                        "maxErrorRate": {"type": "number", "minimum": 0, "maximum": 1, "default": 0.01,
                                         "description": "Largest share of server errors (0..1)."},
                        "maxP99Milliseconds": {"type": "number", "minimum": 0,
                                               "description": "Largest p99 request latency in the server, ms.",
                                               **_cel("self > 0.0", MAX_P99_POSITIVE)},
                    }),
            }, default={}, **_cel("!has(self.canaryAnalysis) || (has(self.canaryTrafficPercent) && "
                                  "self.canaryTrafficPercent < 100)", CANARY_ANALYSIS_NEEDS_CANARY)),
    }, required=["model", "store", "targets"], **{"x-kubernetes-validations": [
        {"rule": _int8_needs_calibration_rule(), "message": INT8_NEEDS_CALIBRATION},
        {"rule": "self.targets.exists(t, !has(t.fallback) || !t.fallback)", "message": FALLBACK_NEEDS_PRIMARY},
    ]})


def model_deployment_status_schema() -> dict[str, Any]:
    """OpenAPI v3 schema of ModelDeployment.status (written by the operator only)."""
    return _obj("Observed state, written by the operator.", {
        "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        "conditions": {"type": "array", "items": _condition(),
                       "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        "targets": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                    "items": _obj("Per-target state.", {
                        "name": _str("Target name."),
                        "gpuProduct": _str("GPU product (empty for CPU)."),
                        "engineKey": _str("Key of the verified engine the pods serve."),
                        "engineBuild": _str("Name of the EngineBuild for the current spec."),
                        "buildPhase": _str("Phase of that EngineBuild.", enum=BUILD_PHASES),
                        "replicas": _int("Desired replicas.", minimum=0),
                        "readyReplicas": _int("Ready replicas.", minimum=0),
                        "role": _str("primary or fallback.", enum=["primary", "fallback"]),
                        "message": _str("Why the target is not serving, if it is not: the build's or the "
                                        "serving pods' reason (unschedulable, image pull, readiness)."),
                    }, required=["name"])},
        "endpoint": _str("Base URL of the in-cluster Service (Open Inference Protocol, TF Serving REST)."),
        "url": _str("The model's in-cluster URL (the Service's), as KServe's status.url."),
        "message": _str("One line: what is wrong, else what is in progress, else what serves (printer column)."),
        "modelURL": _str("Open Inference Protocol URL of the model."),
        "readyTargets": _str("Targets serving / targets, e.g. 2/3 (printer column)."),
        "currentRevision": _str("The revision the stable Deployments serve, v<version>-<hash of the model's "
                                "version, digest and package> (printer column; - before any serves)."),
        "canaryRevision": _str("The revision in its canary phase (printer column; - when none)."),
        "canary": _obj("The canary analysis of canaryRevision.", {
            "revision": _str("The revision analyzed."),
            "readySince": _str("When every canary pod was first ready (the window's start).", format="date-time"),
            "verdict": _str("Pass, Fail or Wait.", enum=["Pass", "Fail", "Wait"]),
            "message": _str("What was measured."),
        }),
        "promotedRevision": _str("A revision whose canary passed its analysis: the stable Deployments roll to it."),
        "rolledBack": _obj("The last revision rolled back; it stays rolled back until spec.model changes.", {
            "revision": _str("The revision rolled back."),
            "reason": _str("ErrorRate, Latency, GoldenCheckFailed, or the stuck canary pod's reason."),
            "message": _str("The measured cause."),
        }),
        "traffic": _obj("What carries a canary's share: ReplicaCounts (the Service spreads requests over "
                        "both revisions' ready pods) or HTTPRoute (attached to spec.rollout.gateway: exact "
                        "weights for requests through the Gateway).", {
            "mechanism": _str("HTTPRoute or ReplicaCounts.", enum=["HTTPRoute", "ReplicaCounts"]),
            "httpRoute": _str("The HTTPRoute's name, where the CRD is served."),
            "stableWeight": _int("The stable backend's weight.", minimum=0, maximum=100),
            "canaryWeight": _int("The canary backend's weight.", minimum=0, maximum=100),
            "message": _str("Which object splits which traffic, and why."),
        }),
        "autoscaling": _obj("What scales the targets while spec.autoscaling is enabled, and why.", {
            "mechanism": _str("KEDA (a ScaledObject per target) or HPA.", enum=["KEDA", "HPA"]),
            "message": _str("Why this mechanism, and on which metric."),
        }),
        "revisions": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                      "description": "Each revision that serves or still runs pods.",
                      "items": _obj("One revision.", {
                          "name": _str(f"Revision id (the pods' {LABEL_REVISION} label)."),
                          "role": _str("stable, canary, or previous (old pods of an in-place rolling update).",
                                       enum=["stable", "canary", "previous"]),
                          "modelVersion": _str("spec.model.version of the revision."),
                          "engineKeys": {"type": "array", "items": {"type": "string"},
                                         "description": "Engines its pods serve, one per target."},
                          "readyReplicas": _int("Its ready serving pods, all targets.", minimum=0),
                          "trafficPercent": _int("Its share of the ready serving pods, which the Service "
                                                 "spreads requests over.", minimum=0, maximum=100),
                      }, required=["name"])},
    }, **PRESERVE_UNKNOWN_FIELDS)


# ----------------------------------------------------------------------------- EngineBuild
def engine_build_spec_schema() -> dict[str, Any]:
    """OpenAPI v3 schema of EngineBuild.spec (immutable: a new spec is a new EngineBuild)."""
    return _obj("One engine for one target, built and verified by a Job on a matching node.", {
        "modelDeployment": _obj("The ModelDeployment this build serves.", {
            "name": _str("ModelDeployment name (same namespace).", minLength=1),
        }, required=["name"]),
        "model": _obj("The model package to build from.", {
            "name": _str("Model name.", minLength=1),
            "version": _str("Model version.", default="1"),
            "packageURI": _uri("Location of the lowered model package."),
            "digest": _str("Optional sha256 of the package manifest.", pattern=r"^sha256:[a-f0-9]{64}$"),
            "signature": _str("Signature.", default="serving_default"),
            "calibrationURI": _uri("For int8 targets: the calibration data the package must have been quantized "
                                   "with (passed to the build as --calibration).", CALIBRATION_URI_PATTERN),
        }, required=["name", "packageURI"]),
        "target": _obj("Where and how the engine is built.", {
            **_target_fields(),
            "maxBatchSize": _int("Largest batch.", minimum=1, default=32),
            "batchProfile": _batch_profile(),
        }, required=["name", "backend", "precision"], **_target_rules()),
        "store": _obj("Engine store to publish to.", {
            "uri": _uri("Store URI."),
            "credentialsSecret": _str("Secret exposed as env.", maxLength=253),
        }, required=["uri"]),
        "image": _str("Builder image.", minLength=1),
        "pullPolicy": _str("Image pull policy.", enum=["Always", "IfNotPresent", "Never"]),
        "serviceAccountName": _str("ServiceAccount of the build Job.", maxLength=253),
        "pod": _obj("The build pod's settings, from the ModelDeployment and its target.", {
            **{k: v for k, v in _pod_settings(" of the build").items() if k not in ("resources", "buildResources")},
            "resources": _resources("the build container")}),
        "backoffLimit": _int("Job retries before the build is Failed.", minimum=0, maximum=10, default=2),
        "activeDeadlineSeconds": {"type": "integer", "format": "int64", "minimum": 60, "default": 3600,
                                  "description": "Wall-clock limit of the build Job."},
    }, required=["modelDeployment", "model", "target", "store", "image"],
        **{"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "EngineBuild spec is immutable"}]})


def engine_build_status_schema() -> dict[str, Any]:
    return _obj("Observed state of the build, written by the operator from its Job.", {
        "phase": _str("Build phase.", enum=BUILD_PHASES),
        "engineKey": _str("Target key of the built engine (from the Job's termination message)."),
        "verified": {"type": "boolean", "description": "The engine matched the golden outputs."},
        "report": _obj("Verification report summary.", {
            "summary": _str("One-line summary."),
        }, **PRESERVE_UNKNOWN_FIELDS),
        "reason": _str("CamelCase reason of the phase."),
        "message": _str("Human-readable detail (for failures: the Job's last log lines)."),
        "jobName": _str("Name of the build Job."),
        "startTime": _str("When the Job started.", format="date-time"),
        "completionTime": _str("When the build finished.", format="date-time"),
        "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
    }, **PRESERVE_UNKNOWN_FIELDS)


# ----------------------------------------------------------------------------- CRD objects
def _crd(plural: str, kind: str, singular: str, short: list[str], spec: dict[str, Any], status: dict[str, Any],
         columns: list[dict[str, Any]], categories: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": {LABEL_APP_NAME: APP_NAME, LABEL_APP_PART_OF: APP_NAME}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": singular, "kind": kind, "listKind": f"{kind}List",
                      "shortNames": short, "categories": categories},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": f"{kind} ({GROUP}).",
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": status,
                    },
                    "required": ["spec"],
                }},
            }],
        },
    }


def _cond_column(name: str, cond: str, priority: int = 0) -> dict[str, Any]:
    col: dict[str, Any] = {"name": name, "type": "string",
                           "jsonPath": f'.status.conditions[?(@.type=="{cond}")].status'}
    if priority:
        col["priority"] = priority
    return col


def model_deployment_crd() -> dict[str, Any]:
    return _crd(PLURAL_MODEL_DEPLOYMENTS, KIND_MODEL_DEPLOYMENT, KIND_MODEL_DEPLOYMENT.lower(), ["md", "mdep"],
                model_deployment_spec_schema(), model_deployment_status_schema(), [
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
                    _cond_column("Ready", "Ready"),
                    _cond_column("Degraded", "Degraded"),
                    {"name": "Targets", "type": "string", "jsonPath": ".status.readyTargets"},
                    {"name": "Revision", "type": "string", "jsonPath": ".status.currentRevision"},
                    {"name": "Canary", "type": "string", "jsonPath": ".status.canaryRevision"},
                    _cond_column("Engines", "EnginesReady", priority=1),
                    {"name": "URL", "type": "string", "jsonPath": ".status.url"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    {"name": "Message", "type": "string", "jsonPath": ".status.message"},
                ], ["kubetrt", "all"])


def engine_build_crd() -> dict[str, Any]:
    return _crd(PLURAL_ENGINE_BUILDS, KIND_ENGINE_BUILD, KIND_ENGINE_BUILD.lower(), ["eb", "ebuild"],
                engine_build_spec_schema(), engine_build_status_schema(), [
                    {"name": "Target", "type": "string", "jsonPath": ".spec.target.name"},
                    {"name": "GPU", "type": "string", "jsonPath": ".spec.target.gpuProduct"},
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Verified", "type": "boolean", "jsonPath": ".status.verified"},
                    {"name": "Engine", "type": "string", "jsonPath": ".status.engineKey", "priority": 1},
                    {"name": "Reason", "type": "string", "jsonPath": ".status.reason"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
                ], ["kubetrt"])


def kopf_peering_crds() -> list[dict[str, Any]]:
    """kopf's peering CRDs (kopf.dev/v1): keep-alives that let only one operator replica act."""
    def peering(scope: str, kind: str, plural: str, singular: str) -> dict[str, Any]:
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.kopf.dev"},
            "spec": {
                "scope": scope, "group": "kopf.dev",
                "names": {"plural": plural, "singular": singular, "kind": kind},
                "versions": [{
                    "name": "v1", "served": True, "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                        "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                    }}},
                }],
            },
        }
    return [peering("Cluster", "ClusterKopfPeering", "clusterkopfpeerings", "clusterkopfpeering"),
            peering("Namespaced", "KopfPeering", "kopfpeerings", "kopfpeering")]


def all_crds() -> list[dict[str, Any]]:
    return [model_deployment_crd(), engine_build_crd(), *kopf_peering_crds()]


# ----------------------------------------------------------------------------- schema utilities
def object_schema(crd: Mapping[str, Any]) -> dict[str, Any]:
    """The openAPIV3Schema of a CRD's single version (what the API server validates against)."""
    return copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Return ``value`` with the schema's defaults filled in, as the API server's defaulting does.

    Objects read through the API already carry these; the operator applies them again so that
    objects from emulators or from older CRD versions behave the same.
    """
    if isinstance(value, dict) and schema.get("type") == "object":
        out = dict(value)
        for key, sub in schema.get("properties", {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        return out
    if isinstance(value, list) and schema.get("type") == "array" and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def render_yaml(objs: list[dict[str, Any]]) -> str:
    return HEADER + "".join("---\n" + yaml.safe_dump(o, sort_keys=False, width=120) for o in objs)


def rbac_objects(namespace: str = OPERATOR_NAMESPACE, name: str = OPERATOR_NAME) -> list[dict[str, Any]]:
    """ClusterRole + ClusterRoleBinding of the plain manifests (the chart templates the same rules)."""
    from kubetrt.operators import rbac

    labels = {LABEL_APP_NAME: APP_NAME, LABEL_APP_COMPONENT: "operator", LABEL_APP_PART_OF: APP_NAME}
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": name, "labels": labels}, "rules": rbac.cluster_role_rules()},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": name, "labels": labels},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


def generated_files() -> dict[Path, str]:
    """Every file generated from this module, with its exact content."""
    from kubetrt.operators import rbac

    crds = all_crds()
    files: dict[Path, str] = {MANIFEST_CRD_FILE: render_yaml(crds)}
    for crd in crds:
        files[CHART_CRD_DIR / f"{crd['metadata']['name']}.yaml"] = render_yaml([crd])
    files[REPO_ROOT / "manifests" / "03-rbac.yaml"] = render_yaml(rbac_objects())
    files[REPO_ROOT / "helm" / "kubetrt" / "files" / "rbac-rules.yaml"] = (
        HEADER + yaml.safe_dump(rbac.cluster_role_rules(), sort_keys=False, width=120))
    return files


def generator_cli(prog: str, description: str | None, files: Mapping[Path, str], root: Path,
                  argv: list[str] | None = None) -> int:
    """``--write`` / ``--check`` over generated files: the one CLI of every generator in this package."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the generated files")
    mode.add_argument("--check", action="store_true", help="exit 1 if a generated file is missing or stale")
    args = parser.parse_args(argv)
    stale = []
    for path, content in files.items():
        current = path.read_text() if path.exists() else None
        if current != content:
            stale.append(path)
            if args.write:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
    for path in stale:
        print(f"{'wrote' if args.write else 'stale'}: {path.relative_to(root)}")
    return 1 if (stale and args.check) else 0


def main(argv: list[str] | None = None) -> int:
    return generator_cli("python -m kubetrt.operators.crds", __doc__, generated_files(), REPO_ROOT, argv)


if __name__ == "__main__":
    sys.exit(main())
