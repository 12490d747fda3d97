"""The engine store: content-addressed, atomically published, digest-checked engines.

Layout under a root (a local directory, a PVC mount path, or an s3:// prefix):

    <model digest>/package/            the model package the engines were built from
    <model digest>/<target key>/       engine files + report.json (verification report)

The model digest covers what an engine and its verification depend on (what the model was
lowered from and how, its inputs and outputs, and for a calibrated package how it was calibrated
and on which data), so the same model lowered twice maps to the same place.

Publishing never exposes a partial engine. Locally the engine is written into a hidden sibling
temp directory and renamed into place (readers skip dot-directories). On S3 the files go up
first and a `_COMPLETE` marker is written last; readers ignore prefixes without it. Publishing is
idempotent: an engine already in the store is kept, not rebuilt or rewritten. The report lists
a SHA-256 for every engine file and fetching checks them, so a tampered file is refused.
"""
from __future__ import annotations

import abc
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrt.pipeline.errors import PipelineError
from kubetrt.pipeline.sources import Uri, parse_uri, s3_client, s3_download_prefix, s3_error, s3_upload_dir
from kubetrt.runtime.package import (
    ENGINES,
    HELDOUT,
    MODEL_INT8_ONNX,
    Manifest,
    PackageError,
    open_package,
    read_manifest,
    sha256_file,
    staged_dir,
    write_manifest,
)

REPORT = "report.json"
COMPLETE = "_COMPLETE"
PACKAGE_DIR = "package"


class StoreError(PipelineError):
    """The store is unreachable, refuses a write, or holds a corrupt or tampered engine."""


@dataclass(frozen=True)
class Published:
    """Outcome of a publish: where the engine lives and whether this call wrote it."""

    uri: str
    key: str
    reused: bool


def model_digest(manifest: Manifest) -> str:
    """Content address of a model: what it was lowered from and how, not the lowered bytes.

    TensorFlow's CPU kernels are not bit-reproducible across runs (thread splits change float
    rounding), so golden.npz differs in its last bits when the same SavedModel is lowered twice;
    keying on it would rebuild engines for an unchanged model. The SavedModel digest, signature,
    lowering settings and tool versions are stable. Packages without a source digest fall back to
    their file digests. A calibrated package adds its int8 identity (see `_int8_identity`); packages
    without model.int8.onnx or heldout.npz keep the digest they always had.
    """
    source = manifest.source.get("digest")
    tools = ("tensorflow", "tf2onnx", "onnx", "kubetrt")
    payload = {
        "inputs": [t.to_json() for t in manifest.inputs],
        "outputs": [t.to_json() for t in manifest.outputs],
        "source": source,
        "signature": manifest.signature,
        "lowering": {"opset": manifest.onnx.get("opset"), "seed": manifest.golden.get("seed"),
                     "batch_sizes": manifest.golden.get("batch_sizes"),
                     "tools": {k: manifest.provenance.get(k) for k in tools}},
    }
    if not source:
        payload = {**payload, "files": {k: v for k, v in sorted(manifest.files.items()) if not k.startswith(ENGINES + "/")}}
    int8 = _int8_identity(manifest)
    if int8 is not None:
        payload = {**payload, "int8": int8}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _int8_identity(manifest: Manifest) -> dict[str, Any] | None:
    """What a calibrated package adds to its address; None for a package without int8 files.

    As for the float model, how the int8 model was made, not its bytes: model.int8.onnx inherits
    model.onnx's node names, which tf2onnx numbers per process, and heldout.npz holds TensorFlow's
    outputs with golden.npz's last-bit noise. The quantization record (calibration data digest and
    source, split, method, percentile, float layers, onnxruntime version) and the held-out samples'
    digest are stable and change whenever the int8 model or its held-out data would. The source
    counts because an int8 build refuses a package recorded with other data. A package with no
    record of its calibration falls back to the files' digests.
    """
    files = {k: manifest.files[k] for k in (MODEL_INT8_ONNX, HELDOUT) if k in manifest.files}
    if not files:
        return None
    if not manifest.quantization.get("calibration"):
        return {"files": files}
    outcomes = ("check", "coverage")  # measured on the result (TensorFlow noise), not how it was made
    return {
        "quantization": {k: v for k, v in manifest.quantization.items() if k not in outcomes},
        "heldout": manifest.heldout.get("digest") or files.get(HELDOUT),
    }


def engine_file_digests(engine_dir: Path) -> dict[str, str]:
    """sha256 of every engine file (relative path -> digest), the report excluded."""
    return {
        p.relative_to(engine_dir).as_posix(): sha256_file(p)
        for p in sorted(engine_dir.rglob("*"))
        if p.is_file() and p.name not in (REPORT, COMPLETE)
    }


def check_engine_files(engine_dir: Path, report: dict[str, Any], where: str) -> None:
    """Raise StoreError if an engine file is missing, extra or differs from the report's digest."""
    expected: dict[str, str] = report.get("files") or {}
    if not expected:
        raise StoreError(f"{where}: report.json lists no engine files; the engine is incomplete")
    got = engine_file_digests(engine_dir)
    for rel, digest in expected.items():
        if rel not in got:
            raise StoreError(f"{where}: engine file {rel} is missing")
        if got[rel] != digest:
            raise StoreError(
                f"{where}: engine file {rel} digest mismatch (report says {digest}, file has {got[rel]}); "
                "the engine was modified after it was verified"
            )
    extra = sorted(set(got) - set(expected))
    if extra:
        raise StoreError(f"{where}: unexpected files not covered by the verification report: {', '.join(extra)}")


class EngineStore(abc.ABC):
    """A root holding packages and verified engines. Subclasses differ only in transport."""

    uri: str

    def engine_uri(self, digest: str, key: str) -> str:
        return str(self._root().join(digest, key))

    def package_uri(self, digest: str) -> str:
        return str(self._root().join(digest, PACKAGE_DIR))

    @abc.abstractmethod
    def _root(self) -> Uri: ...

    @abc.abstractmethod
    def read_report(self, digest: str, key: str) -> dict[str, Any] | None:
        """The report of a complete engine, or None if there is no complete engine."""

    @abc.abstractmethod
    def list_engines(self, digest: str) -> list[str]:
        """Keys of complete engines for this model digest, sorted."""

    @abc.abstractmethod
    def _write_engine(self, digest: str, key: str, engine_dir: Path, report: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    def fetch_engine(self, digest: str, key: str, dest: str | os.PathLike[str]) -> dict[str, Any]:
        """Copy a complete engine into `dest` (created), check every file digest, return its report."""

    @abc.abstractmethod
    def has_package(self, digest: str) -> bool: ...

    @abc.abstractmethod
    def _write_package(self, digest: str, package_dir: Path) -> None: ...

    @abc.abstractmethod
    def fetch_package(self, digest: str, dest: str | os.PathLike[str]) -> Path:
        """Copy the stored package into `dest` (must not exist) and digest-check it."""

    def has_engine(self, digest: str, key: str) -> bool:
        report = self.read_report(digest, key)
        return bool(report and report.get("passed"))

    def publish_engine(self, digest: str, key: str, engine_dir: str | os.PathLike[str], report: dict[str, Any]) -> Published:
        """Publish a verified engine with its report; a passing engine already stored is reused."""
        if not report.get("passed"):
            raise StoreError(
                f"refusing to publish engine {key}: its verification did not pass "
                f"({report.get('summary', 'no summary')})"
            )
        uri = self.engine_uri(digest, key)
        if self.has_engine(digest, key):
            return Published(uri, key, reused=True)
        engine_dir = Path(engine_dir)
        report = dict(report, key=key, model_digest=digest, files=engine_file_digests(engine_dir))
        report.setdefault("published_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self._write_engine(digest, key, engine_dir, report)
        return Published(uri, key, reused=False)

    def publish_package(self, package_dir: str | os.PathLike[str]) -> str:
        """Store the model package (idempotent) and return its model digest."""
        manifest = open_package(package_dir)
        digest = model_digest(manifest)
        if not self.has_package(digest):
            self._write_package(digest, Path(package_dir))
        return digest


def _package_files(package_dir: Path) -> list[Path]:
    """The package's own files: engines are stored separately, under their own keys."""
    return [
        p
        for p in sorted(package_dir.rglob("*"))
        if p.is_file() and p.relative_to(package_dir).parts[0] != ENGINES
    ]


class LocalStore(EngineStore):
    """A store on a local filesystem or a PVC mount: publish is temp-dir-then-rename."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.uri = str(self.root)

    def _root(self) -> Uri:
        return Uri("file", "", str(self.root))

    def read_report(self, digest: str, key: str) -> dict[str, Any] | None:
        path = self.root / digest / key / REPORT
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(f"{path}: corrupt verification report ({e})") from e

    def list_engines(self, digest: str) -> list[str]:
        base = self.root / digest
        if not base.is_dir():
            return []
        return sorted(
            d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith(".") and (d / REPORT).is_file()
        )

    def _write_engine(self, digest: str, key: str, engine_dir: Path, report: dict[str, Any]) -> None:
        final = self.root / digest / key
        try:
            with staged_dir(final) as tmp:
                _copy_files(engine_dir, tmp, engine_file_digests(engine_dir))
                check_engine_files(tmp, report, str(final))
                (tmp / REPORT).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
                _fsync_tree(tmp)
        except FileExistsError:
            if not self.has_engine(digest, key):  # another writer's engine must be complete and passing
                raise StoreError(f"{final}: exists but is not a verified engine; remove it to republish") from None
        except OSError as e:
            if self.has_engine(digest, key):  # a concurrent publisher won the rename: same content
                return
            raise StoreError(f"{final}: publish failed ({e})") from e

    def fetch_engine(self, digest: str, key: str, dest: str | os.PathLike[str]) -> dict[str, Any]:
        src = self.root / digest / key
        report = self.read_report(digest, key)
        if report is None:
            raise StoreError(f"{src}: no published engine for target key {key}")
        check_engine_files(src, report, str(src))
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        _copy_files(src, dest, report["files"])
        check_engine_files(dest, report, str(src))  # re-check the copy: the source could change mid-copy
        return report

    def has_package(self, digest: str) -> bool:
        return (self.root / digest / PACKAGE_DIR / "manifest.json").is_file()

    def _write_package(self, digest: str, package_dir: Path) -> None:
        final = self.root / digest / PACKAGE_DIR
        try:
            with staged_dir(final) as tmp:
                for p in _package_files(package_dir):
                    target = tmp / p.relative_to(package_dir)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(p, target)
                _fsync_tree(tmp)
        except (FileExistsError, OSError) as e:
            if not self.has_package(digest):
                raise StoreError(f"{final}: publishing the package failed ({e})") from e

    def fetch_package(self, digest: str, dest: str | os.PathLike[str]) -> Path:
        src = self.root / digest / PACKAGE_DIR
        if not self.has_package(digest):
            raise StoreError(f"{src}: no package for model digest {digest}")
        dest = Path(dest)
        shutil.copytree(src, dest)
        open_package(dest)
        return dest


class S3Store(EngineStore):
    """A store under an s3:// prefix: files first, the `_COMPLETE` marker last."""

    def __init__(self, uri: str | Uri, *, endpoint_url: str | None = None, client: Any = None) -> None:
        self.loc = uri if isinstance(uri, Uri) else parse_uri(uri)
        if self.loc.scheme != "s3":
            raise StoreError(f"{uri}: not an s3:// URI")
        self.uri = str(self.loc)
        self.client = client or s3_client(endpoint_url)

    def _root(self) -> Uri:
        return self.loc

    def _get(self, loc: Uri) -> bytes | None:
        from botocore import exceptions as bx

        try:
            return self.client.get_object(Bucket=loc.bucket, Key=loc.path)["Body"].read()
        except bx.ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise s3_error(loc, e, self.client) from e
        except bx.BotoCoreError as e:
            raise s3_error(loc, e, self.client) from e

    def _put(self, loc: Uri, body: bytes) -> None:
        from botocore import exceptions as bx

        try:
            self.client.put_object(Bucket=loc.bucket, Key=loc.path, Body=body)
        except (bx.BotoCoreError, bx.ClientError) as e:
            raise s3_error(loc, e, self.client) from e

    def read_report(self, digest: str, key: str) -> dict[str, Any] | None:
        base = self.loc.join(digest, key)
        marker = self._get(base.join(COMPLETE))
        if marker is None:
            return None  # absent, or a partial upload: invisible either way
        body = self._get(base.join(REPORT))
        if body is None:
            raise StoreError(f"{base}: marked complete but report.json is missing")
        if json.loads(marker).get("report") != "sha256:" + hashlib.sha256(body).hexdigest():
            raise StoreError(f"{base}: report.json does not match its _COMPLETE marker; the engine was modified")
        return json.loads(body)

    def list_engines(self, digest: str) -> list[str]:
        from botocore import exceptions as bx

        prefix = self.loc.join(digest).path + "/"
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.loc.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    parts = obj["Key"][len(prefix):].split("/")
                    if len(parts) == 2 and parts[1] == COMPLETE and parts[0] != PACKAGE_DIR:
                        keys.append(parts[0])
        except (bx.BotoCoreError, bx.ClientError) as e:
            raise s3_error(self.loc.join(digest), e, self.client) from e
        return sorted(keys)

    def _write_engine(self, digest: str, key: str, engine_dir: Path, report: dict[str, Any]) -> None:
        base = self.loc.join(digest, key)
        s3_upload_dir(self.client, engine_dir, base, skip=(REPORT, COMPLETE))
        body = (json.dumps(report, indent=2, sort_keys=True) + "\n").encode()
        self._put(base.join(REPORT), body)
        marker = {"report": "sha256:" + hashlib.sha256(body).hexdigest(), "files": len(report["files"])}
        self._put(base.join(COMPLETE), json.dumps(marker).encode())  # last: makes the engine visible

    def fetch_engine(self, digest: str, key: str, dest: str | os.PathLike[str]) -> dict[str, Any]:
        base = self.loc.join(digest, key)
        report = self.read_report(digest, key)
        if report is None:
            raise StoreError(f"{base}: no published engine for target key {key}")
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        for rel in report["files"]:
            body = self._get(base.join(rel))
            if body is None:
                raise StoreError(f"{base}: engine file {rel} is missing")
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).write_bytes(body)
        check_engine_files(dest, report, str(base))
        return report

    def has_package(self, digest: str) -> bool:
        return self._get(self.loc.join(digest, PACKAGE_DIR, COMPLETE)) is not None

    def _write_package(self, digest: str, package_dir: Path) -> None:
        base = self.loc.join(digest, PACKAGE_DIR)
        for p in _package_files(package_dir):
            rel = p.relative_to(package_dir).as_posix()
            self._put(base.join(rel), p.read_bytes())
        self._put(base.join(COMPLETE), b"{}")

    def fetch_package(self, digest: str, dest: str | os.PathLike[str]) -> Path:
        base = self.loc.join(digest, PACKAGE_DIR)
        if not self.has_package(digest):
            raise StoreError(f"{base}: no package for model digest {digest}")
        dest = Path(dest)
        s3_download_prefix(self.client, base, dest)
        (dest / COMPLETE).unlink(missing_ok=True)
        open_package(dest)
        return dest


def open_store(uri: str | os.PathLike[str], *, s3_endpoint: str | None = None) -> EngineStore:
    """A store for a local path / file:// (LocalStore) or an s3:// prefix (S3Store)."""
    loc = parse_uri(uri)
    if loc.scheme == "file":
        return LocalStore(loc.path)
    if loc.scheme == "s3":
        return S3Store(loc, endpoint_url=s3_endpoint)
    raise StoreError(f"{uri}: engine stores support local paths, file:// and s3://, not {loc.scheme}://")


def fetch_package_uri(uri: str, dest: str | os.PathLike[str], *, s3_endpoint: str | None = None) -> Path:
    """Bring a model package (local dir, file://, s3:// prefix) to `dest`; local dirs are used in place."""
    from kubetrt.pipeline.sources import SourceError, fetch_tree

    loc = parse_uri(uri)
    if loc.scheme == "file":
        path = Path(loc.path)
        if not path.exists():
            raise SourceError(f"{uri}: model package not found (expected a directory with manifest.json)")
    else:
        path = fetch_tree(loc, dest, s3_endpoint=s3_endpoint)
        (path / COMPLETE).unlink(missing_ok=True)
    try:
        open_package(path)
    except PackageError as e:
        raise SourceError(f"{uri}: not a usable model package ({e})") from e
    return path


def _copy_files(src: Path, dest: Path, files: dict[str, str]) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, target)


def _fsync_tree(root: Path) -> None:
    """Flush file contents before the rename makes them visible (crash-consistency on real disks)."""
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def assemble_package(package_dir: str | os.PathLike[str], engines: dict[str, tuple[Path, dict[str, Any]]], dest: str | os.PathLike[str]) -> Path:
    """Copy a package to `dest` with `engines/<key>/` added and listed (digests) in its manifest.

    `engines` maps key -> (engine dir, engine entry for manifest.engines). The runtime's digest
    check on load then also covers the engine files, so tampering is caught at load time too.
    """
    package_dir = Path(package_dir)
    manifest = read_manifest(package_dir)
    dest = Path(dest)
    with staged_dir(dest, overwrite=True) as tmp:
        for p in _package_files(package_dir):
            target = tmp / p.relative_to(package_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, target)
        manifest.files = {k: v for k, v in manifest.files.items() if not k.startswith(ENGINES + "/")}
        manifest.engines = []
        for key, (engine_dir, entry) in sorted(engines.items()):
            files = engine_file_digests(engine_dir)
            _copy_files(engine_dir, tmp / ENGINES / key, files)
            for rel, digest in files.items():
                manifest.files[f"{ENGINES}/{key}/{rel}"] = digest
            manifest.engines.append(dict(entry, key=key, path=f"{ENGINES}/{key}"))
        write_manifest(tmp, manifest)
    return dest
