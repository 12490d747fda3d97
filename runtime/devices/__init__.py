"""Device runtimes behind one interface; the host runtime is always there, GPU ones are optional.

Each runtime knows its node identity (what an engine key is checked against), how to tune a
resolved target into engine options, and how to prepare an executable from a graph (and engine).
Engine folders themselves are runtime/engine.py's.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import DeviceUnavailableError
from ..graph import Graph
from ..target import CPU_PRODUCT, Target, TargetError

# auto picks the first available, most specialised first
PREFERENCE = ("tensorrt", "cuda", "host")
_MODULES = {"host": "host", "cuda": "cuda", "tensorrt": "tensorrt"}


@dataclass(frozen=True)
class NodeIdentity:
    gpu_product: str  # nvidia.com/gpu.product value, or "cpu"
    compute_capability: str | None
    backend_version: str


class Executable(Protocol):
    def run(self, feeds: list[np.ndarray]) -> list[np.ndarray]: ...


class DeviceRuntime(Protocol):
    name: str

    def check_available(self) -> None: ...
    def identity(self) -> NodeIdentity: ...
    def prepare(self, graph: Graph, options: dict[str, Any]) -> Executable: ...
    def tune(self, graph: Graph, target: Target, golden: dict[int, Any]) -> dict[str, Any]: ...


def get_device(name: str) -> DeviceRuntime:
    if name not in _MODULES:
        raise ValueError(f"device {name!r}: expected one of auto, {', '.join(_MODULES)}")
    module = importlib.import_module(f".{_MODULES[name]}", __name__)
    return module.RUNTIME


def available_devices() -> dict[str, str | None]:
    """{device: None if usable here, else the reason it is not}."""
    out: dict[str, str | None] = {}
    for name in PREFERENCE:
        try:
            get_device(name).check_available()
            out[name] = None
        except (DeviceUnavailableError, ImportError) as e:
            out[name] = str(e)
    return out


def resolve_device(name: str) -> str:
    if name != "auto":
        return name
    return next(d for d, reason in available_devices().items() if reason is None)


def node_identity(backend: str) -> NodeIdentity:
    dev = get_device(backend)
    dev.check_available()
    return dev.identity()


def gpu_product() -> str:
    """This node's GPU product as GPU Feature Discovery labels it, or "cpu" when no GPU runtime works."""
    for backend in ("cuda", "tensorrt"):
        try:
            return node_identity(backend).gpu_product
        except (DeviceUnavailableError, ImportError):
            continue
    return CPU_PRODUCT


def resolve_target(target: Target, identity: NodeIdentity | None = None) -> Target:
    """Fill in what only this node knows (compute capability, backend version); refuse a target
    for another GPU product. An engine is valid only on the GPU product it was built on, so a
    mismatch is an error, never a silent build for the wrong GPU. `identity` defaults to this node's."""
    if identity is None:
        identity = _identity_for(target)
    if identity.gpu_product != target.gpu_product:
        have = "no GPU (cpu only)" if identity.gpu_product == CPU_PRODUCT else f"GPU {identity.gpu_product}"
        raise TargetError(f"target {target.spec()} cannot be built or run here: this node has {have}, the target "
                          f"wants {target.gpu_product}: engines must be built on the GPU model they serve on")
    return target.resolve(identity.compute_capability, identity.backend_version)


def _identity_for(target: Target) -> NodeIdentity:
    """The backend's view of this node; when the backend cannot run here, the GPU product alone if
    that already rules the target out (the clearer reason), else the backend's own error."""
    try:
        return node_identity(target.backend)
    except (DeviceUnavailableError, ImportError):
        product = gpu_product()
        if target.is_gpu and product != target.gpu_product:
            return NodeIdentity(product, None, "")
        raise
