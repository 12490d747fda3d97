"""Resource quantities and the Downward API's resourceFieldRef, as the API server and kubelet
compute them: shared by the test kubelet (tests/e2e) and the podman pod runner (tests/containers)."""
from __future__ import annotations

import math
import os
import re
from typing import Any, Mapping

_SUFFIX = {"m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "1Gi", "2", 1.5) as a number; ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"invalid resource quantity {value!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def node_allocatable() -> dict[str, float]:
    """This machine as the node: what an unset limit stands for."""
    return {"cpu": float(os.cpu_count() or 1),
            "memory": float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))}


def resource_field(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """The kubelet's value of a resourceFieldRef: an unset limit is the node's allocatable amount,
    an unset request falls back to the limit (API defaulting); divided by the divisor, rounded up."""
    kind, _, name = str(ref["resource"]).partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory"):
        raise ValueError(f"unsupported resourceFieldRef resource {ref['resource']!r}")
    resources = container.get("resources") or {}
    have = (resources.get(kind) or {}).get(name)
    if have is None and kind == "requests":
        have = (resources.get("limits") or {}).get(name)
    amount = quantity(have) if have is not None else (node_allocatable()[name] if kind == "limits" else 0.0)
    divisor = quantity(ref.get("divisor") or "1")
    if name == "cpu":
        return str(int(math.ceil(round(amount * 1000) / round(divisor * 1000))))
    return str(int(math.ceil(amount / divisor)))


def container_env(container: Mapping[str, Any], pod_name: str, namespace: str, base: Mapping[str, str] | None = None,
                  secrets: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, str]:
    """A container's environment as the kubelet builds it: `base` (the image's), envFrom, then env
    in order with $(VAR) expansion, resourceFieldRef, fieldRef and secretKeyRef resolved."""
    env = dict(base or {})
    secrets = secrets or {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        if "secretRef" in source:
            name = source["secretRef"]["name"]
            if name not in secrets:
                if source["secretRef"].get("optional"):
                    continue
                raise ValueError(f"CreateContainerConfigError: secret {name!r} not found")
            env.update({prefix + k: v for k, v in secrets[name].items()})
        else:
            raise ValueError(f"unsupported envFrom source {source!r}")
    for var in container.get("env") or []:
        if "valueFrom" not in var:
            env[var["name"]] = expand(str(var.get("value", "")), env)
            continue
        source = var["valueFrom"]
        if "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            if ref.get("containerName", container["name"]) != container["name"]:
                raise ValueError(f"env {var['name']}: resourceFieldRef of another container is not supported")
            env[var["name"]] = resource_field(container, ref)
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            values = {"metadata.name": pod_name, "metadata.namespace": namespace, "status.podIP": "127.0.0.1",
                      "status.hostIP": "127.0.0.1", "spec.nodeName": os.uname().nodename}
            if path not in values:
                raise ValueError(f"env {var['name']}: unsupported fieldRef {path!r}")
            env[var["name"]] = values[path]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            try:
                env[var["name"]] = secrets[ref["name"]][ref["key"]]
            except KeyError:
                raise ValueError(f"CreateContainerConfigError: secret key {ref['name']}/{ref['key']} not found") from None
        else:
            raise ValueError(f"env {var['name']}: unsupported valueFrom {source!r}")
    return env


def expand(value: str, env: Mapping[str, str]) -> str:
    """$(VAR) references to earlier variables, $$(VAR) escapes (as in the kubelet)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)
