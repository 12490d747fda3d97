"""Deploy: the ModelDeployment custom resource that names the verified engines.

Without a cluster the resource is emitted as YAML (an output artifact of the pipeline, or a file
from the CLI); `apply_model_deployment` hands it to the Kubernetes API when one is reachable.
The spec follows operators/crds.py. Engine keys are not spec fields there (the operator builds
or finds engines itself and reports the key in status), so the verified keys travel as
annotations: the operator's EngineBuilds then find them in the store and reuse them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from kubetrt.operators.names import (ANN_MODEL_DIGEST, ANN_VERIFIED_ENGINES, API_VERSION, GROUP, KIND_MODEL_DEPLOYMENT,
                                     LABEL_APP_MANAGED_BY, LABEL_APP_NAME, PIPELINE_MANAGED_BY,
                                     PLURAL_MODEL_DEPLOYMENTS, TARGET_NAME_MAX, VERSION, dns_label)
from kubetrt.runtime.target import CPU_PRODUCT, Target, parse_target


def store_uri_for_cluster(uri: str) -> str:
    """CRD URIs need a scheme: a local store path becomes file://<absolute path>."""
    return uri if "://" in uri else "file://" + str(Path(uri).resolve())


def target_name(target: Target, taken: set[str]) -> str:
    """A target name not in `taken` (added to it): the GPU product (or cpu), then its precision."""
    base = dns_label(target.gpu_product, max_len=TARGET_NAME_MAX)
    name = base
    if name in taken:
        name = dns_label(base[:24], target.precision, max_len=TARGET_NAME_MAX)
    i = 2
    while name in taken:
        name = dns_label(base[:26], str(i), max_len=TARGET_NAME_MAX)
        i += 1
    taken.add(name)
    return name


def crd_target(target: Target) -> dict[str, Any]:
    """The ModelDeployment target fields that place `target` (backend, precision, gpuProduct or cpu):
    the inverse of the operator's `objects.engine_target`, but for the batch profile, which a
    ModelDeployment sets once for all its targets."""
    out: dict[str, Any] = {"backend": target.backend, "precision": target.precision}
    if target.gpu_product == CPU_PRODUCT:
        out["cpu"] = True
    else:
        out.update(gpuProduct=target.gpu_product, gpus=1)
    return out


def calibration_spec(quantization: Mapping[str, Any]) -> dict[str, Any] | None:
    """spec.optimization.calibration from a package manifest's quantization record (None when the
    package was not calibrated): the data's URI, method, percentile and held-out fraction."""
    record = quantization.get("calibration") or {}
    source = record.get("source")
    if not source:
        return None
    out: dict[str, Any] = {"uri": store_uri_for_cluster(str(source))}
    if quantization.get("method"):
        out["method"] = str(quantization["method"])
    if quantization.get("method") == "percentile" and quantization.get("percentile") is not None:
        out["percentile"] = float(quantization["percentile"])
    if record.get("holdout") is not None:
        out["holdoutFraction"] = float(record["holdout"])
    return out


def model_deployment(
    model_name: str,
    version: str,
    package_uri: str,
    engines: Iterable[Any],
    *,
    store_uri: str | None = None,
    namespace: str | None = None,
    signature: str = "serving_default",
    replicas: int = 1,
    quantization: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The ModelDeployment for these verified engines (EngineRecord objects or their JSON dicts).

    `store_uri` defaults to the root the engines were published to (their URI minus digest/key).
    `quantization` is the package manifest's record: int8 engines need it, since the CRD requires
    the calibration block for int8 targets.
    """
    records = [e.to_json() if hasattr(e, "to_json") else dict(e) for e in engines]
    if not records:
        raise ValueError("no verified engines to deploy; expected at least one engine record")
    digests = {r["model_digest"] for r in records}
    if len(digests) != 1:
        raise ValueError(f"engines come from different models ({sorted(digests)}); expected one model digest")
    if store_uri is None:
        store_uri = records[0]["uri"].rsplit("/", 2)[0]
    taken: set[str] = set()
    targets: list[dict[str, Any]] = []
    engines_ann: dict[str, str] = {}
    parsed = [parse_target(r["spec"]) for r in records]
    for r, target in zip(records, parsed):
        name = target_name(target, taken)
        targets.append({"name": name, **crd_target(target), "replicas": replicas})
        engines_ann[name] = r["key"]
    first = parsed[0].profile
    optimization: dict[str, Any] = {
        "precision": parsed[0].precision,
        "maxBatchSize": first.max,
        "batchProfile": {"min": first.min, "opt": first.opt, "max": first.max},
    }
    calibration = calibration_spec(quantization or {})
    if calibration is not None:
        optimization["calibration"] = calibration
    elif any(t.precision == "int8" for t in parsed):
        raise ValueError("int8 engines to deploy, but no calibration record: pass the package manifest's "
                         "quantization (a package lowered with --calibration DATA records it)")
    name = dns_label(model_name)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND_MODEL_DEPLOYMENT,
        "metadata": {
            "name": name,
            **({"namespace": namespace} if namespace else {}),
            "labels": {LABEL_APP_NAME: name, LABEL_APP_MANAGED_BY: PIPELINE_MANAGED_BY},
            "annotations": {
                ANN_VERIFIED_ENGINES: json.dumps(engines_ann, sort_keys=True),
                ANN_MODEL_DIGEST: digests.pop(),
            },
        },
        "spec": {
            "model": {
                "name": name,
                "version": str(version),
                "signature": signature,
                "source": {"uri": store_uri_for_cluster(package_uri)},
            },
            "store": {"uri": store_uri_for_cluster(store_uri)},
            "optimization": optimization,
            "targets": targets,
        },
    }


def to_yaml(resource: Mapping[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(dict(resource), sort_keys=False)


def apply_model_deployment(resource: Mapping[str, Any], namespace: str = "default") -> dict[str, Any]:
    """Create or replace the resource in the cluster of the current kubeconfig / in-cluster config."""
    try:
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
    except ImportError as e:  # pragma: no cover - the operator extra provides it
        raise RuntimeError(f"applying a ModelDeployment needs the kubernetes package ({e})") from e
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.CustomObjectsApi()
    ns = resource["metadata"].get("namespace", namespace)
    name = resource["metadata"]["name"]
    args = (GROUP, VERSION, ns, PLURAL_MODEL_DEPLOYMENTS)
    try:
        current = api.get_namespaced_custom_object(*args, name)
        body = dict(resource, metadata=dict(resource["metadata"], resourceVersion=current["metadata"]["resourceVersion"]))
        return api.replace_namespaced_custom_object(*args, name, body)
    except ApiException as e:
        if e.status != 404:
            raise RuntimeError(f"ModelDeployment {ns}/{name}: Kubernetes API error {e.status} ({e.reason})") from e
    return api.create_namespaced_custom_object(*args, dict(resource))
