"""Device runtimes behind one interface; the host runtime is always there, GPU ones are optional.

Each runtime knows its node identity (what an engine key is checked against), how to build an
engine for a resolved target, and how to prepare an executable from a graph (and engine).
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import DeviceUnavailableError
from ..graph import Graph
from ..package import Manifest, PackageError, atomic_write_text, sha256_file
from ..target import Target, TargetError

ENGINE_JSON = "engine.json"
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


def resolve_target(target: Target) -> Target:
    """Fill in what only this node knows; refuse a GPU target this node's GPU cannot serve."""
    ident = node_identity(target.backend)
    if target.is_gpu and ident.gpu_product != target.gpu_product:
        raise TargetError(
            f"this node has {ident.gpu_product}, the target wants {target.gpu_product}: "
            "engines must be built on the GPU model they serve on"
        )
    return target.resolve(ident.compute_capability, ident.backend_version)


def build_engine(package_dir: str | os.PathLike[str], target: Target, out_dir: str | os.PathLike[str], manifest: Manifest | None = None) -> dict[str, Any]:
    """Compile and tune `target` on this node; write engine.json (+ backend files) into out_dir.

    The caller owns atomicity (it builds into a staged dir and publishes by rename).
    """
    from ..model import load_graph  # local: avoids an import cycle
    from ..package import load_golden, open_package

    manifest = manifest or open_package(package_dir)
    resolved = resolve_target(target)
    dev = get_device(target.backend)
    graph = load_graph(package_dir, manifest)
    golden = load_golden(package_dir, manifest)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = dev.tune(graph, resolved, golden)
    extra_files = options.pop("_files", {})
    for rel, data in extra_files.items():
        (out / rel).write_bytes(data)
    meta = {
        "key": resolved.key(),
        "target": resolved.to_json(),
        "backend": resolved.backend,
        "model": {"name": manifest.name, "version": manifest.version, "onnx": manifest.files["model.onnx"]},
        "options": options,
        "files": {rel: sha256_file(out / rel) for rel in sorted(extra_files)},
    }
    atomic_write_text(out / ENGINE_JSON, json.dumps(meta, indent=2) + "\n")
    return meta


def read_engine(engine_dir: str | os.PathLike[str], manifest: Manifest) -> dict[str, Any]:
    """Read and check an engine: digests of its files, the model it was built from, this node."""
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_JSON
    if not path.is_file():
        raise PackageError(f"{engine_dir}: not an engine folder (no {ENGINE_JSON})")
    try:
        meta = json.loads(path.read_text())
        target = Target.from_json(meta["target"])
    except (ValueError, KeyError, TypeError) as e:
        raise PackageError(f"{path}: corrupt engine metadata ({e})") from e
    for rel, digest in meta.get("files", {}).items():
        p = engine_dir / rel
        if not p.is_file() or sha256_file(p) != digest:
            raise PackageError(f"{p}: engine file missing or its digest does not match {digest}; the engine is corrupt or was modified")
    if meta.get("model", {}).get("onnx") != manifest.files.get("model.onnx"):
        raise PackageError(f"{engine_dir}: engine was built from a different model.onnx than this package's")
    check_engine_fits_node(meta["key"], target)
    return meta


def check_engine_fits_node(key: str, target: Target) -> None:
    """TargetError unless this node resolves the engine's target to the engine's own key."""
    here = resolve_target(Target(target.backend, target.gpu_product, target.precision, target.profile))
    if here.key() != key:
        raise TargetError(f"engine {key} does not match this node: it was built for another node type, and this "
                          f"node resolves the same target to {here.key()}; rebuild it on this node type")
