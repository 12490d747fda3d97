"""The servable source: package URI + engine store URI + engine key -> one local, checked package.

What a serving pod runs is named by exactly these three things. `kubetrt serve`, `kubetrt fetch`,
the demo and the operator's Deployment all resolve them here, so there is one place that checks
digests, refuses an engine built for another node type, and writes only under a cache directory
(serving pods have a read-only root filesystem; the operator mounts an emptyDir there).

The result is assembled in a hidden temp directory and renamed into place, so a pod restarted
mid-fetch never finds half a package; a later start on the same cache reuses a complete one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from kubetrt.telemetry import progress
from kubetrt.telemetry.logs import log
from kubetrt.pipeline.errors import PipelineError
from kubetrt.pipeline.sources import parse_uri
from kubetrt.pipeline.store import assemble_package, fetch_package_uri, model_digest, open_store
from kubetrt.runtime.engine import check_engine_fits_node, manifest_entry
from kubetrt.runtime.errors import DeviceUnavailableError
from kubetrt.runtime.package import ENGINES, Manifest, PackageError, open_package, read_manifest
from kubetrt.runtime.target import Target, TargetError

logger = logging.getLogger("kubetrt.pipeline")

SERVABLES = "servables"


class ServableError(PipelineError):
    """The package, the store or the engine named for serving is missing, corrupt or not for this node."""


@dataclass(frozen=True)
class ServableSource:
    """What to serve: a model package, and optionally the verified engine for this node type."""

    package_uri: str
    store_uri: str | None = None
    engine_key: str | None = None
    s3_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.store_uri and not self.engine_key:
            raise ServableError(f"engine store {self.store_uri} given without an engine key; expected --engine-key KEY too")


@dataclass(frozen=True)
class Servable:
    """A local package whose digests (package files and engine files) were checked on resolving."""

    package_dir: Path
    manifest: Manifest
    engine_key: str | None

    @property
    def engine(self) -> dict[str, Any]:
        """The engine's manifest entry (backend, target, verification summary); {} without one."""
        return self.manifest.engine_entry(self.engine_key) or {}


def resolve_servable(source: ServableSource, cache_dir: str | Path | None = None) -> Servable:
    """Bring `source` to a local package under `cache_dir` (local packages without a store stay in
    place). Without `cache_dir`, kubetrt-cache in the temp dir: looked up only when something is
    fetched, since a pod with a read-only root may have no temp dir at all."""
    loc = parse_uri(source.package_uri)
    if not source.store_uri and loc.scheme == "file":
        return _local_package(Path(loc.path), source.engine_key)
    cache_dir = cache_dir if cache_dir is not None else _default_cache()
    dest = _cache_slot(cache_dir, source)
    key = source.engine_key if source.store_uri else None
    cached = _complete(dest, key)
    if cached is not None:
        log(logger, logging.INFO, "servable reused from cache", path=str(dest), engine=key)
        return Servable(dest, cached, key)
    what = f"package {source.package_uri}" + (f" and engine {key}" if key else "")
    with progress.step(f"fetching {what}"), _staging(cache_dir) as tmp:
        pkg = _fetch_package(source, tmp / "package")
        if key:
            _add_engine(source, key, pkg, tmp)
            pkg = tmp / "servable"
        _publish(pkg, dest)
    log(logger, logging.INFO, "servable fetched", path=str(dest), engine=key)
    return Servable(dest, read_manifest(dest), key)


def _add_engine(source: ServableSource, key: str, package: Path, tmp: Path) -> None:
    """package + the verified engine `key` from the store -> tmp/servable (engine files listed)."""
    manifest = read_manifest(package)
    digest = model_digest(manifest)
    store = open_store(str(source.store_uri), s3_endpoint=source.s3_endpoint)
    report = store.read_report(digest, key)
    if report is None:
        have = store.list_engines(digest)
        raise ServableError(
            f"engine store {source.store_uri} has no verified engine {key} for model {manifest.name} "
            f"(digest {digest[:12]}); it has {have or 'none'}"
        )
    if not report.get("passed"):
        raise ServableError(f"engine {key} in {source.store_uri} did not pass verification: {report.get('summary')}")
    target = _check_fits_node(key, report)
    store.fetch_engine(digest, key, tmp / "engine")
    entry = manifest_entry(target, summary=report.get("summary", ""), tolerance=report.get("tolerance"))
    assemble_package(package, {key: (tmp / "engine", entry)}, tmp / "servable")


def _default_cache() -> Path:
    try:
        return Path(tempfile.gettempdir()) / "kubetrt-cache"
    except FileNotFoundError as e:
        raise ServableError(f"no writable temp directory for fetched packages ({e}); give --cache-dir DIR") from e


def _check_fits_node(key: str, report: dict[str, Any]) -> Target:
    """The engine's Target, if this node can run it; refused before any engine file is copied."""
    try:
        target = Target.from_json(report["target"])
    except (KeyError, TypeError, ValueError) as e:
        raise ServableError(f"engine {key}: its verification report names no usable target ({e})") from e
    try:
        check_engine_fits_node(key, target)
    except (DeviceUnavailableError, ImportError, TargetError) as e:
        raise ServableError(f"engine {key} cannot run on this node: {e}") from e
    return target


def _local_package(path: Path, engine_key: str | None) -> Servable:
    manifest = _open(path)
    if engine_key and not (path / ENGINES / engine_key).is_dir():
        have = sorted(e.get("key", "?") for e in manifest.engines)
        raise ServableError(f"{path}: the package holds no engine {engine_key} (it has {have or 'none'}); "
                            "give --store URI to fetch it from an engine store")
    return Servable(path, manifest, engine_key)


def _open(path: Path) -> Manifest:
    try:
        return open_package(path)
    except PackageError as e:
        raise ServableError(str(e)) from e


def _fetch_package(source: ServableSource, dest: Path) -> Path:
    """The digest-checked package: a local one where it is (assembling copies it), a remote one
    fetched into `dest`."""
    loc = parse_uri(source.package_uri)
    if loc.scheme == "file":
        _open(Path(loc.path))
        return Path(loc.path)
    try:
        return fetch_package_uri(source.package_uri, dest, s3_endpoint=source.s3_endpoint)
    except PackageError as e:
        raise ServableError(str(e)) from e


def _cache_slot(cache_dir: str | Path, source: ServableSource) -> Path:
    ident = json.dumps([source.package_uri, source.store_uri, source.engine_key]).encode()
    return Path(cache_dir) / SERVABLES / hashlib.sha256(ident).hexdigest()[:20]


def _complete(dest: Path, key: str | None) -> Manifest | None:
    """The manifest of a slot from an earlier start, if it is whole, still matches its digests and
    holds the engine; else None."""
    if not (dest / "manifest.json").is_file():
        return None
    try:
        manifest = open_package(dest)
    except PackageError as e:
        log(logger, logging.WARNING, "cached servable is corrupt; fetching again", path=str(dest), reason=str(e))
        return None
    return manifest if key is None or manifest.engine_entry(key) is not None else None


@contextlib.contextmanager
def _staging(cache_dir: str | Path) -> Iterator[Path]:
    """A temp dir inside the cache (same filesystem, so the final rename is atomic)."""
    root = Path(cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    except OSError as e:
        raise ServableError(f"cache directory {root} is not writable ({e.strerror}); "
                            "give --cache-dir a writable path (an emptyDir in a pod)") from e
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _publish(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        shutil.rmtree(dest)
    src.rename(dest)
