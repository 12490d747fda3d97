"""A Kubernetes API server emulator for the operator's integration tests.

kmock's KubernetesEmulator (PyPI, by kopf's author) stores objects and streams watch events; the
subclass below adds the API server behaviours the operator relies on and kmock leaves out:
metadata (uid, resourceVersion, generation, creationTimestamp), PUT (replace) with optimistic
concurrency, status-subresource isolation, and the garbage collector's cascading deletion by
ownerReferences (the garbage collector lives in kube-controller-manager, which nothing here runs).
"""
from __future__ import annotations

import copy
import datetime
import itertools
import uuid
from typing import Any

import asyncio

import aiohttp.web
import kmock

from kubetrt.operators import names
from kubetrt.operators.objects import OperatorConfig

STATUS_RESOURCES = {"modeldeployments", "enginebuilds", "deployments", "jobs", "horizontalpodautoscalers",
                    "services", "pods"}


class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock plus uid/resourceVersion/generation, PUT, status isolation and owner-reference GC."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._rv = itertools.count(1000)

    def _next_rv(self) -> str:
        return str(next(self._rv))

    @staticmethod
    def _key(request: Any) -> tuple[Any, Any, Any]:
        return (request.resource, request.namespace, request.name)

    async def _handle(self, request: Any) -> aiohttp.web.StreamResponse:
        if request.resource is None:
            return await super()._handle(request)
        method = str(request.method.value).upper()
        plural = request.resource.plural
        if method == "PUT" and request.name:
            return await self._replace(request)
        if request.action == kmock.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = self._next_rv()
            meta["generation"] = 1
            meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.timezone.utc)
                            .strftime("%Y-%m-%dT%H:%M:%SZ"))
            if request.namespace:
                meta.setdefault("namespace", request.namespace)
        elif request.action == kmock.action.UPDATE and isinstance(request.data, list):
            # JSON patch: a failed "test" op is 422 Unprocessable (kopf then retries on the next event).
            key = self._key(request)
            current = self._objects[key].raw if key in self._objects and not self._objects[key].deleted else {}
            for op in request.data:
                if op.get("op") == "test" and _pointer(current, op["path"]) != op.get("value"):
                    return _status(422, "Invalid", f"test failed for {op['path']}")
            request.data[:] = [op for op in request.data if op.get("op") != "test"]
            request.data.append({"op": "add", "path": "/metadata/resourceVersion", "value": self._next_rv()})
        elif request.action == kmock.action.UPDATE and isinstance(request.data, dict):
            data = request.data
            if request.subresource == "status":
                for key in list(data):
                    if key != "status":
                        del data[key]
            elif plural in STATUS_RESOURCES:
                data.pop("status", None)
            key = self._key(request)
            current = self._objects[key].raw if key in self._objects and not self._objects[key].deleted else None
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = self._next_rv()
            if current is not None and "spec" in data and request.subresource != "status":
                merged = copy.deepcopy(current.get("spec"))
                if merged != _merge(copy.deepcopy(current.get("spec")), data["spec"]):
                    meta["generation"] = int(current.get("metadata", {}).get("generation", 1)) + 1
        response = await super()._handle(request)
        if request.action in (kmock.action.DELETE, kmock.action.UPDATE):  # UPDATE: finalizer removal
            await self._collect_garbage()
        return response

    async def _replace(self, request: Any) -> aiohttp.web.StreamResponse:
        key = self._key(request)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return _status(404, "NotFound", "object not found")
            current = self._objects[key].raw
            new = copy.deepcopy(request.data)
            meta = new.setdefault("metadata", {})
            cur_meta = current.get("metadata", {})
            if meta.get("resourceVersion") and meta["resourceVersion"] != cur_meta.get("resourceVersion"):
                return _status(409, "Conflict", "the object has been modified")
            for field in ("uid", "creationTimestamp", "namespace"):
                if field in cur_meta:
                    meta[field] = cur_meta[field]
            meta["generation"] = int(cur_meta.get("generation", 1)) + (new.get("spec") != current.get("spec"))
            meta["resourceVersion"] = self._next_rv()
            if "status" in current:
                new["status"] = current["status"]
            self._objects[key].create(new)
            raw = self._objects[key].raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(raw)

    async def _collect_garbage(self) -> None:
        """Delete objects whose owners are gone (repeatedly, so that deletion cascades)."""
        async with self._lock:
            while True:
                alive = {obj.raw.get("metadata", {}).get("uid") for obj in self._objects.values() if not obj.deleted}
                orphans = [(key, obj) for key, obj in self._objects.items() if not obj.deleted
                           and obj.raw.get("metadata", {}).get("ownerReferences")
                           and not any(ref.get("uid") in alive for ref in obj.raw["metadata"]["ownerReferences"])]
                if not orphans:
                    return
                for (resource, _, _), obj in orphans:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})


def _pointer(obj: Any, path: str) -> Any:
    for part in path.strip("/").split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(obj, list):
            obj = obj[int(part)] if part.isdigit() and int(part) < len(obj) else None
        elif isinstance(obj, dict):
            obj = obj.get(part)
        else:
            return None
    return obj


def _merge(base: Any, patch: Any) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        for k, v in patch.items():
            if v is None:
                base.pop(k, None)
            else:
                base[k] = _merge(base.get(k), v)
        return base
    return copy.deepcopy(patch)


def _status(code: int, reason: str, message: str) -> aiohttp.web.StreamResponse:
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


NS = "models"
CONFIG = OperatorConfig(serving_image="registry.example/kubetrt/serving:test",
                        builder_image="registry.example/kubetrt/builder:test",
                        serving_image_gpu="registry.example/kubetrt/serving-gpu:test",
                        builder_image_gpu="registry.example/kubetrt/builder-gpu:test")


CALIBRATION_URI = "s3://datasets/resnet50/calibration.npz"


def md_body(name: str = "resnet", **spec_overrides: Any) -> dict[str, Any]:
    """A ModelDeployment with two GPU targets (t4 builds int8, so it names its calibration data) and a
    CPU target."""
    spec: dict[str, Any] = {
        "model": {"name": "resnet50", "version": "3", "source": {"uri": "s3://models/resnet50/pkg"}},
        "store": {"uri": "s3://engines/resnet50", "credentialsSecret": "s3-creds"},
        "optimization": {"calibration": {"uri": CALIBRATION_URI}},
        "targets": [
            {"name": "h100", "gpuProduct": "NVIDIA-H100-80GB-HBM3", "replicas": 2},
            {"name": "t4", "gpuProduct": "Tesla-T4", "precision": "int8"},
            {"name": "cpu", "cpu": True, "replicas": 1},
        ],
    }
    spec.update(copy.deepcopy(spec_overrides))
    return {"apiVersion": names.API_VERSION, "kind": names.KIND_MODEL_DEPLOYMENT,
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1,
                         "resourceVersion": "1"},
            "spec": spec}


async def eventually(predicate: Any, timeout: float = 10.0, interval: float = 0.05, describe: Any = None) -> Any:
    """Await until ``predicate()`` is truthy (returns it) or fail with the last value seen."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            last = predicate()
        except (KeyError, ValueError, TypeError):
            last = None
        if last:
            return last
        await asyncio.sleep(interval)
    detail = describe() if describe else last
    raise AssertionError(f"condition not met within {timeout}s; last value: {detail!r}")
