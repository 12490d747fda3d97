"""Engine artifacts: what an engine is on disk, how it is built, and how it is checked before use.

An engine folder holds `engine.json` (key, resolved target, the model.onnx it was built from,
backend options, a digest of every backend file) and the backend's own files. It is valid only
on a node that resolves the same target to the same key, so every read checks that first.
A package lists its engines in its manifest with `manifest_entry`.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .coverage import KERNEL_DEVICES, ONNXRUNTIME, onnxruntime_installed, place, place_segments
from .devices import get_device, resolve_target
from .devices.tensorrt import SEGMENTS_KEY
from .graph import Graph
from .onnx_import import load_package_graph
from .package import Manifest, PackageError, atomic_write_text, load_golden, model_file, sha256_file
from .target import Target, TargetError

ENGINE_JSON = "engine.json"


def manifest_entry(target: Target, **extra: Any) -> dict[str, Any]:
    """The entry that lists an engine in a package's manifest (its key and path are added there)."""
    return {"backend": target.backend, "target": target.to_json(), "spec": target.spec(), **extra}


def build_engine(package_dir: str | os.PathLike[str], manifest: Manifest, target: Target,
                 out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Tune `target` (resolved on this node) for the package; write engine.json and the backend's
    files into `out_dir`. The caller owns atomicity: it builds into a staged dir and publishes by
    rename."""
    if not target.resolved:
        raise TargetError(f"target {target.spec()} must be resolved on this node before an engine is built")
    dev = get_device(target.backend)
    graph = load_package_graph(package_dir, manifest, target.precision)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = dev.tune(graph, target, load_golden(package_dir, manifest))  # tuning works on copies
    coverage = build_coverage(graph, target.backend, options)
    extra_files = options.pop("_files", {})
    for rel, data in extra_files.items():
        (out / rel).write_bytes(data)
    meta = {
        "key": target.key(),
        "target": target.to_json(),
        "backend": target.backend,
        "model": {"name": manifest.name, "version": manifest.version, "file": model_file(manifest, target.precision),
                  "onnx": manifest.files[model_file(manifest, target.precision)]},
        "options": options,
        "files": {rel: sha256_file(out / rel) for rel in sorted(extra_files)},
        "coverage": coverage,
    }
    atomic_write_text(out / ENGINE_JSON, json.dumps(meta, indent=2) + "\n")
    return meta


def build_coverage(graph: Graph, backend: str, options: dict[str, Any]) -> dict[str, Any]:
    """Where the built engine runs each node: the backend, or a fallback runtime (TF-TRT style)."""
    allow = (ONNXRUNTIME,) if onnxruntime_installed() else ()
    if backend in KERNEL_DEVICES:
        return place(graph, backend, allow).to_json()
    backend_nodes = {name for seg in options.get(SEGMENTS_KEY, []) if seg["supported"] for name in seg["nodes"]}
    return place_segments(graph, backend, backend_nodes, allow=allow).to_json()


def read_engine(engine_dir: str | os.PathLike[str], manifest: Manifest) -> dict[str, Any]:
    """Read and check an engine: digests of its files, the model it was built from, this node."""
    engine_dir = Path(engine_dir)
    path = engine_dir / ENGINE_JSON
    if not path.is_file():
        raise PackageError(f"{engine_dir}: not an engine folder (no {ENGINE_JSON})")
    try:
        meta = json.loads(path.read_text())
        target = Target.from_json(meta["target"])
        key = str(meta["key"])
    except (ValueError, KeyError, TypeError) as e:
        raise PackageError(f"{path}: corrupt engine metadata ({e})") from e
    for rel, digest in meta.get("files", {}).items():
        p = engine_dir / rel
        if not p.is_file() or sha256_file(p) != digest:
            raise PackageError(f"{p}: engine file missing or its digest does not match {digest}; "
                               "the engine is corrupt or was modified")
    source = model_file(manifest, target.precision)
    if meta.get("model", {}).get("onnx") != manifest.files.get(source):
        raise PackageError(f"{engine_dir}: engine was built from a different {source} than this package's")
    check_engine_fits_node(key, target)
    return dict(meta)


def check_engine_fits_node(key: str, target: Target) -> None:
    """TargetError unless this node resolves the engine's target to the engine's own key."""
    here = resolve_target(Target(target.backend, target.gpu_product, target.precision, target.profile))
    if here.key() != key:
        raise TargetError(f"engine {key} does not match this node: it was built for another node type, and this "
                          f"node resolves the same target to {here.key()}; rebuild it on this node type")
