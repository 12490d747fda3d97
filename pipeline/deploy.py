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
                                     PLURAL_MODEL_DEPLOYMENTS, TARGET_NAME_MAX, VERSION, dns_label)


def store_uri_for_cluster(uri: str) -> str:
    """CRD URIs need a scheme: a local store path becomes file://<absolute path>."""
    return uri if "://" in uri else "file://" + str(Path(uri).resolve())


def target_name(record: Mapping[str, Any], taken: set[str]) -> str:
    base = "cpu" if record["gpu_product"] == "cpu" else dns_label(record["gpu_product"], max_len=TARGET_NAME_MAX)
    name = base
    if name in taken:
        name = dns_label(base[:24], record["precision"], max_len=TARGET_NAME_MAX)
    i = 2
    while name in taken:
        name = dns_label(base[:26], str(i), max_len=TARGET_NAME_MAX)
        i += 1
    taken.add(name)
    return name


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
) -> dict[str, Any]:
    """The ModelDeployment for these verified engines (EngineRecord objects or their JSON dicts).

    `store_uri` defaults to the root the engines were published to (their URI minus digest/key).
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
    for r in records:
        name = target_name(r, taken)
        t: dict[str, Any] = {"name": name, "backend": r["backend"], "precision": r["precision"], "replicas": replicas}
        if r["gpu_product"] == "cpu":
            t["cpu"] = True
        else:
            t["gpuProduct"] = r["gpu_product"]
            t["gpus"] = 1
        targets.append(t)
        engines_ann[name] = r["key"]
    first = _profile(records[0]["spec"])
    name = dns_label(model_name)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND_MODEL_DEPLOYMENT,
        "metadata": {
            "name": name,
            **({"namespace": namespace} if namespace else {}),
            "labels": {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "kubetrt-pipeline"},
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
            "optimization": {
                "precision": records[0]["precision"],
                "maxBatchSize": first[2],
                "batchProfile": {"min": first[0], "opt": first[1], "max": first[2]},
            },
            "targets": targets,
        },
    }


def _profile(spec: str) -> tuple[int, int, int]:
    from kubetrt.runtime.target import parse_target

    p = parse_target(spec).profile
    return p.min, p.opt, p.max


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
