"""The model package: the one artifact every stage hands on (see DESIGN.md).

Lives in the runtime (not the pipeline) because serving pods read packages and must not import
TensorFlow. Writing is atomic: build in a sibling temp dir, then rename.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
MODEL_ONNX = "model.onnx"
GOLDEN = "golden.npz"
MODEL_INT8_ONNX = "model.int8.onnx"  # explicitly quantized (Q/DQ) twin of model.onnx, present once calibrated
HELDOUT = "heldout.npz"  # calibration data held out of calibration, with TensorFlow's fp32 outputs
ENGINES = "engines"
HELDOUT_LABELS = "labels"


class PackageError(ValueError):
    """A model package is missing, corrupt, tampered with or of an unknown schema."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: float32, int64, bool, ...
    shape: tuple[int, ...]  # -1 for a dynamic dim

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TensorSpec":
        return cls(str(d["name"]), str(np.dtype(d["dtype"])), tuple(int(s) for s in d["shape"]))


@dataclass
class Manifest:
    name: str
    version: str
    signature: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> "sha256:<hex>"
    source: dict[str, Any] = field(default_factory=dict)  # uri, digest of the SavedModel
    provenance: dict[str, Any] = field(default_factory=dict)
    onnx: dict[str, Any] = field(default_factory=dict)  # opset, ...
    golden: dict[str, Any] = field(default_factory=dict)  # batch_sizes, seed
    engines: list[dict[str, Any]] = field(default_factory=list)  # {key, path, backend, ...}
    quantization: dict[str, Any] = field(default_factory=dict)  # how MODEL_INT8_ONNX was calibrated
    heldout: dict[str, Any] = field(default_factory=dict)  # samples, labels, source of HELDOUT
    schema_version: int = SCHEMA_VERSION

    def engine_entry(self, key: str | None) -> dict[str, Any] | None:
        """The entry listing engine `key` (backend, target, recorded tolerance...), None if absent."""
        return next((e for e in self.engines if e.get("key") == key), None) if key else None

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": {"name": self.name, "version": self.version},
            "signature": self.signature,
            "inputs": [t.to_json() for t in self.inputs],
            "outputs": [t.to_json() for t in self.outputs],
            "files": dict(sorted(self.files.items())),
            "source": self.source,
            "provenance": self.provenance,
            "onnx": self.onnx,
            "golden": self.golden,
            "engines": self.engines,
            **({"quantization": self.quantization} if self.quantization else {}),
            **({"heldout": self.heldout} if self.heldout else {}),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "manifest.json") -> "Manifest":
        try:
            version = int(d["schema_version"])
            if version != SCHEMA_VERSION:
                raise PackageError(
                    f"{where}: schema_version {version} is not supported (expected {SCHEMA_VERSION})"
                )
            return cls(
                name=str(d["model"]["name"]),
                version=str(d["model"]["version"]),
                signature=str(d["signature"]),
                inputs=[TensorSpec.from_json(t) for t in d["inputs"]],
                outputs=[TensorSpec.from_json(t) for t in d["outputs"]],
                files=dict(d.get("files", {})),
                source=dict(d.get("source", {})),
                provenance=dict(d.get("provenance", {})),
                onnx=dict(d.get("onnx", {})),
                golden=dict(d.get("golden", {})),
                engines=list(d.get("engines", [])),
                quantization=dict(d.get("quantization", {})),
                heldout=dict(d.get("heldout", {})),
                schema_version=version,
            )
        except PackageError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise PackageError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def sha256_tree(root: str | os.PathLike[str]) -> str:
    """Digest of a directory tree: relative paths and file contents, order-independent."""
    root = Path(root)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(sha256_file(p).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def read_manifest(package_dir: str | os.PathLike[str]) -> Manifest:
    package_dir = Path(package_dir)
    if not package_dir.is_dir():
        raise PackageError(f"{package_dir}: model package directory does not exist")
    path = package_dir / MANIFEST
    if not path.is_file():
        raise PackageError(f"{package_dir}: not a model package (no {MANIFEST})")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PackageError(f"{path}: corrupt manifest, not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise PackageError(f"{path}: corrupt manifest, expected a JSON object")
    return Manifest.from_json(data, where=str(path))


def verify_files(package_dir: str | os.PathLike[str], manifest: Manifest, only: list[str] | None = None) -> None:
    """Check listed files exist and match their recorded digests (truncation, tampering)."""
    package_dir = Path(package_dir)
    for rel, digest in manifest.files.items():
        if only is not None and rel not in only:
            continue
        p = package_dir / rel
        if not p.is_file():
            raise PackageError(f"{package_dir}: file {rel} listed in the manifest is missing")
        got = sha256_file(p)
        if got != digest:
            raise PackageError(
                f"{p}: digest mismatch (manifest says {digest}, file has {got}); "
                "the package is corrupt or was modified"
            )


def open_package(package_dir: str | os.PathLike[str], verify: bool = True) -> Manifest:
    """Read and (by default) digest-check a package before anything trusts its contents."""
    manifest = read_manifest(package_dir)
    for required in (MODEL_ONNX, GOLDEN):
        if required not in manifest.files:
            raise PackageError(f"{package_dir}: manifest does not list {required}")
    if verify:
        verify_files(package_dir, manifest)
    return manifest


def model_file(manifest: Manifest, precision: str) -> str:
    """The ONNX file an engine of `precision` is built from: the Q/DQ model for int8, else model.onnx."""
    if precision != "int8":
        return MODEL_ONNX
    if MODEL_INT8_ONNX not in manifest.files:
        raise PackageError(
            f"model {manifest.name} v{manifest.version} has no INT8 model: int8 needs calibration data. Lower it "
            "with --calibration DATA (an .npz with one array per model input, a directory of .npy files, or a "
            "directory of images)")
    return MODEL_INT8_ONNX


@dataclass(frozen=True)
class HeldOut:
    """Inputs kept out of calibration, TensorFlow's fp32 outputs for them and, if given, task labels."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    labels: np.ndarray | None = None

    @property
    def samples(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])


def save_heldout(path: str | os.PathLike[str], heldout: HeldOut) -> None:
    arrays = {f"input.{k}": v for k, v in heldout.inputs.items()} | {f"output.{k}": v for k, v in heldout.outputs.items()}
    if heldout.labels is not None:
        arrays[HELDOUT_LABELS] = heldout.labels
    with open(path, "wb") as f:
        np.savez(f, allow_pickle=False, **arrays)


def load_heldout(package_dir: str | os.PathLike[str], manifest: Manifest) -> HeldOut | None:
    """The package's held-out data, None when it was lowered without calibration data."""
    if HELDOUT not in manifest.files:
        return None
    path = Path(package_dir) / HELDOUT
    data = _arrays(path, "held-out")
    try:
        inputs = {t.name: data[f"input.{t.name}"] for t in manifest.inputs}
        outputs = {t.name: data[f"output.{t.name}"] for t in manifest.outputs}
    except KeyError as e:
        raise PackageError(f"{path}: held-out data lacks {e}") from e
    return HeldOut(inputs, outputs, data.get(HELDOUT_LABELS))


def _arrays(path: Path, what: str) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError) as e:
        raise PackageError(f"{path}: corrupt {what} file ({e})") from e


def golden_key(batch: int, kind: str, name: str) -> str:
    return f"batch{batch}.{kind}.{name}"


def save_golden(path: str | os.PathLike[str], batches: dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]) -> None:
    arrays: dict[str, np.ndarray] = {}
    for batch, (ins, outs) in batches.items():
        arrays.update({golden_key(batch, "input", k): v for k, v in ins.items()})
        arrays.update({golden_key(batch, "output", k): v for k, v in outs.items()})
    with open(path, "wb") as f:
        np.savez(f, allow_pickle=False, **arrays)


def load_golden(package_dir: str | os.PathLike[str], manifest: Manifest | None = None) -> dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """{batch: (inputs, tensorflow_outputs)} as recorded at lowering time."""
    manifest = manifest or read_manifest(package_dir)
    path = Path(package_dir) / GOLDEN
    data = _arrays(path, "golden")
    result: dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}
    for batch in manifest.golden.get("batch_sizes", []):
        try:
            ins = {t.name: data[golden_key(batch, "input", t.name)] for t in manifest.inputs}
            outs = {t.name: data[golden_key(batch, "output", t.name)] for t in manifest.outputs}
        except KeyError as e:
            raise PackageError(f"{path}: golden data for batch {batch} lacks {e}") from e
        result[int(batch)] = (ins, outs)
    return result


def write_manifest(package_dir: str | os.PathLike[str], manifest: Manifest) -> None:
    atomic_write_text(Path(package_dir) / MANIFEST, json.dumps(manifest.to_json(), indent=2) + "\n")


def atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; serving pods may run as another user
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staged_dir(final: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside `final`; on success rename it into place, on any failure remove it.

    Readers never observe a half-written directory: it is either absent or complete.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final}: already exists (refusing to overwrite)")
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".partial"))
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the published tree must be readable by others
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
