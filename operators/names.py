"""Kubernetes names kubetrt spells in more than one place: the kubetrt.io API, its label and
annotation keys, GPU Feature Discovery labels, and the one rule that turns free text into a
DNS label.

The pipeline and the serving pods import this module too, so it imports the standard library only
(never kopf, kubernetes or yaml).
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any

# ----------------------------------------------------------------------------- the kubetrt.io API
GROUP = "kubetrt.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

KIND_MODEL_DEPLOYMENT = "ModelDeployment"
KIND_ENGINE_BUILD = "EngineBuild"
PLURAL_MODEL_DEPLOYMENTS = "modeldeployments"
PLURAL_ENGINE_BUILDS = "enginebuilds"

# ----------------------------------------------------------------------------- labels and annotations
LABEL_MD = f"{GROUP}/model-deployment"
LABEL_TARGET = f"{GROUP}/target"
LABEL_BUILD = f"{GROUP}/engine-build"
# primary or fallback: the main Service selects fallback targets' pods only while no primary serves.
LABEL_ROLE = f"{GROUP}/role"
# Revisions: each spec.model (version, digest, package) is one revision; its pods carry its id.
# stable or canary: which of a target's two serving Deployments a pod belongs to.
LABEL_REVISION = f"{GROUP}/revision"
LABEL_TRACK = f"{GROUP}/track"
TRACK_STABLE = "stable"
TRACK_CANARY = "canary"
ANN_MODEL_VERSION = f"{GROUP}/model-version"
ANN_ENGINE_KEY = f"{GROUP}/engine-key"
ANN_ENGINE_BUILD = f"{GROUP}/engine-build"
ANN_SPEC_HASH = f"{GROUP}/spec-hash"
# Set by the pipeline on the ModelDeployment it emits: engines it verified, and the model they came from.
ANN_VERIFIED_ENGINES = f"{GROUP}/verified-engines"
ANN_MODEL_DIGEST = f"{GROUP}/model-digest"
FINALIZER = f"{GROUP}/operator"

# Kubernetes' recommended labels, and the values kubetrt gives them.
LABEL_APP_NAME = "app.kubernetes.io/name"
LABEL_APP_INSTANCE = "app.kubernetes.io/instance"
LABEL_APP_VERSION = "app.kubernetes.io/version"
LABEL_APP_COMPONENT = "app.kubernetes.io/component"
LABEL_APP_PART_OF = "app.kubernetes.io/part-of"
LABEL_APP_MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "kubetrt"
MANAGED_BY = "kubetrt-operator"  # managed-by value of everything the operator creates
PIPELINE_MANAGED_BY = "kubetrt-pipeline"  # managed-by value of the ModelDeployment the pipeline emits

# The plain manifests' install: the chart derives both from its release instead.
OPERATOR_NAME = "kubetrt-operator"
OPERATOR_NAMESPACE = "kubetrt-system"

# ----------------------------------------------------------------------------- operator settings (env)
# Written by the operator Deployment (operators/install.py), read by OperatorConfig.from_env.
# The CPU images serve and build host targets; the _GPU ones (CUDA, CuPy, TensorRT) GPU targets.
ENV_SERVING_IMAGE = "KUBETRT_SERVING_IMAGE"
ENV_BUILDER_IMAGE = "KUBETRT_BUILDER_IMAGE"
ENV_SERVING_IMAGE_GPU = "KUBETRT_SERVING_IMAGE_GPU"
ENV_BUILDER_IMAGE_GPU = "KUBETRT_BUILDER_IMAGE_GPU"
ENV_IMAGE_PULL_POLICY = "KUBETRT_IMAGE_PULL_POLICY"
ENV_JOB_TTL_SECONDS = "KUBETRT_JOB_TTL_SECONDS"
ENV_CLUSTER_DOMAIN = "KUBETRT_CLUSTER_DOMAIN"
ENV_POD_NAME = "POD_NAME"  # kopf peering priority of each operator replica
ENV_POD_DISRUPTION_BUDGETS = "KUBETRT_POD_DISRUPTION_BUDGETS"  # "true"/"false": a PDB per serving target
# The Prometheus that scrapes the serving pods (http://prometheus-operated.monitoring:9090): KEDA's
# prometheus trigger queries it; unset, load autoscaling stays an HPA on the custom metrics API.
ENV_PROMETHEUS_URL = "KUBETRT_PROMETHEUS_URL"

# ----------------------------------------------------------------------------- other projects' APIs
# (apiVersion, kind, plural) of the CRDs the operator uses where they are served (API discovery).
SERVICE_MONITOR_API = ("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors")
HTTP_ROUTE_API = ("gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes")
SCALED_OBJECT_API = ("keda.sh/v1alpha1", "ScaledObject", "scaledobjects")

# ----------------------------------------------------------------------------- GPUs
# The NVIDIA device plugin's resource; GPU nodes are commonly tainted with the same key.
GPU_RESOURCE = "nvidia.com/gpu"
GPU_TAINT_KEY = GPU_RESOURCE
GPU_TAINT_EFFECT = "NoSchedule"
# GPU Feature Discovery node labels: engines are bound to the product (and its compute capability).
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_COMPUTE_MAJOR_LABEL = "nvidia.com/gpu.compute.major"
GPU_COMPUTE_MINOR_LABEL = "nvidia.com/gpu.compute.minor"
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"

# The HTTP port serving pods listen on and their Service exposes, and the OIP gRPC port beside it.
SERVING_PORT = 8080
SERVING_GRPC_PORT = 8081
# Where a build Job's container writes its JSON result (terminationMessagePath, `kubetrt build`'s default).
TERMINATION_LOG = "/dev/termination-log"
# `kubetrt build`'s exit code when it refuses the build (verification failed, the package calibrated
# with other data): the build Job's podFailurePolicy fails the Job at once, since a retry is refused too
BUILD_REFUSED_EXIT_CODE = 3
BUILD_CONTAINER = "build"
SERVING_CONTAINER = "serving"
# Triton's system shared memory in a serving pod: POSIX shared memory objects live in /dev/shm, so the
# serving container and its sidecars mount one in-memory emptyDir there.
SHARED_MEMORY_VOLUME = "shm"
SHARED_MEMORY_PATH = "/dev/shm"
# Where a serving pod writes its traced calls (spec.tracing): the serving container's standard output,
# a JSON line each, beside its logs on standard error; `kubectl logs` and a cluster's log collector
# read them with no volume to mount on a read-only root filesystem.
TRACE_PATH = "/dev/stdout"

# ----------------------------------------------------------------------------- label values, DNS labels
# Label values: a GPU product as GPU Feature Discovery labels it, a ModelDeployment's name in a label.
LABEL_VALUE_MAX = 63
LABEL_VALUE_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"  # a non-empty label value
# DNS-1035 labels: what Service names (and kubetrt's other derived names) must be.
DNS_LABEL_MAX = 63
DNS_LABEL_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Target names become suffixes of Deployment names (<model-deployment>-<target>), hence shorter.
TARGET_NAME_MAX = 30
_HASH_LEN = 8
_MIN_LEN = 1 + 1 + _HASH_LEN  # a letter, a dash, the hash: the shortest label that can keep a hash
_INVALID = re.compile(r"[^a-z0-9-]+")


def stable_hash(value: Any, length: int = 10) -> str:
    """Short content hash of a JSON-able value (canonical JSON, so key order does not matter)."""
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def canary_name(deployment: str) -> str:
    """The canary Deployment beside a target's stable Deployment ``deployment``."""
    return dns_label(deployment, TRACK_CANARY)


def track_service_name(md_name: str, track: str) -> str:
    """The Service selecting one track's (stable or canary) serving pods: an HTTPRoute's backend."""
    return dns_label(md_name, track)


def prometheus_label(label: str) -> str:
    """A Kubernetes label key as the Prometheus label a ServiceMonitor's podTargetLabels makes of it
    (every character outside [a-zA-Z0-9_] becomes _): kubetrt.io/revision -> kubetrt_io_revision."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def revision_id(version: str, identity: Any) -> str:
    """A revision's id, a label value: the model version (readable) and a hash of the model's
    whole identity (version, digest, package), so two packages under one version differ."""
    return dns_label("v" + version, stable_hash(identity, _HASH_LEN), max_len=LABEL_VALUE_MAX)


def label_value(name: str) -> str:
    """An object name as a label value: names may be longer than label values, so it is cut; the
    same name always gives the same value, so selectors built from it keep matching."""
    return name[:LABEL_VALUE_MAX]


def dns_label(*parts: str, max_len: int = DNS_LABEL_MAX) -> str:
    """Join ``parts`` into a DNS label, the form Service and Deployment names need.

    Lower-cases, replaces each run of other characters by a dash, prefixes ``x-`` where the
    result would not start with a letter. A result longer than ``max_len`` keeps a hash of the
    whole input as its suffix, so distinct long inputs stay distinct. The same input always
    gives the same label, and valid Kubernetes names give what earlier releases gave, so objects
    named by it keep their names. Raises ValueError when no letter or digit is left.
    """
    if not _MIN_LEN <= max_len <= DNS_LABEL_MAX:
        raise ValueError(f"max_len={max_len}: expected {_MIN_LEN}..{DNS_LABEL_MAX}")
    raw = "-".join(p.strip("-").lower() for p in parts if p)
    clean = _INVALID.sub("-", raw).strip("-")
    if not clean:
        raise ValueError(f"{parts!r}: cannot derive a DNS label (expected letters or digits)")
    if not "a" <= clean[0] <= "z":
        clean = "x-" + clean
    if len(clean) > max_len:
        suffix = stable_hash(raw, _HASH_LEN)  # as the operator has always computed it: names stay stable
        clean = clean[: max_len - _HASH_LEN - 1].rstrip("-") + "-" + suffix
    return clean
