"""Pipeline stages as plain functions: the same code runs in-process, under kfp.local and on Kubeflow.

    ingest -> lower -> (per target) build -> verify -> publish -> deploy

Each stage takes paths/URIs and returns plain data, so the Kubeflow components and the CLI are
thin adapters around them. TensorFlow is imported only by ingest/lower; build and verify run on
GPU nodes that have no TensorFlow and compare against golden outputs recorded at lowering time.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from kubetrt.telemetry import progress
from kubetrt.telemetry.logs import log
from kubetrt.operators.names import GPU_PRODUCT_LABEL
from kubetrt.pipeline.sources import fetch_model
from kubetrt.pipeline.store import (
    EngineStore,
    assemble_package,
    model_digest,
    open_store,
)
from kubetrt.pipeline.verify import VerificationError, verify_predictions
from kubetrt.runtime.package import load_golden, open_package
from kubetrt.runtime.target import Target, TargetError, parse_target

logger = logging.getLogger("kubetrt.pipeline")


# ---------------------------------------------------------------------------------------------
# ingest + lower (TensorFlow)


def ingest_stage(source: str, workdir: str | os.PathLike[str], signature: str = "serving_default", *, s3_endpoint: str | None = None) -> Any:
    """Fetch the SavedModel at `source` (path, file://, s3://, gs://) and validate its signature."""
    from kubetrt.pipeline.ingest import ingest

    with progress.step(f"fetching model {source}"):
        path = fetch_model(source, workdir, s3_endpoint=s3_endpoint)
    with progress.step("checking SavedModel signature"):
        return ingest(path, signature)


def lower_stage(savedmodel: str | os.PathLike[str], out_dir: str | os.PathLike[str], *, name: str | None = None, signature: str = "serving_default", version: str = "1") -> Path:
    """Lower a validated SavedModel into a model package at `out_dir`."""
    from kubetrt.pipeline.lower import lower

    with progress.step("lowering SavedModel to ONNX model package"):
        lower(Path(savedmodel), Path(out_dir), name=name, signature=signature, version=version)
    return Path(out_dir)


# ---------------------------------------------------------------------------------------------
# build (on the node that carries the target's GPU)


@dataclass
class Built:
    """Result of the build stage for one target."""

    key: str
    target: Target  # resolved on this node
    model_digest: str
    engine_dir: Path | None  # None when the store already had a verified engine
    reused: bool
    metadata: dict[str, Any] = field(default_factory=dict)


def node_identity(backend: str) -> tuple[str, str | None, str]:
    """(gpu product or "cpu", compute capability, backend library version) of this node.

    Raises RuntimeError when the backend's device runtime cannot run here (no GPU, no library).
    """
    try:
        from kubetrt.runtime.devices import node_identity as identify
    except ImportError as e:  # the runtime ships it; say so instead of a bare ImportError
        raise RuntimeError(f"kubetrt.runtime.devices.node_identity is not available ({e})") from e
    try:
        ident = identify(backend)
    except (ImportError, RuntimeError) as e:  # DeviceUnavailableError is a RuntimeError
        raise RuntimeError(f"backend {backend} is not usable on this node ({type(e).__name__}: {e})") from e
    if isinstance(ident, tuple):
        return ident  # type: ignore[return-value]
    return ident.gpu_product, ident.compute_capability, ident.backend_version


def gpu_product_here() -> str:
    """This node's GPU product as GPU Feature Discovery would label it, or "cpu"."""
    for backend in ("cuda", "tensorrt"):
        try:
            return node_identity(backend)[0]
        except RuntimeError:
            continue
    return "cpu"


def resolve_on_node(target: Target, identity: tuple[str, str | None, str] | None = None) -> Target:
    """Resolve `target` for this node, or raise TargetError when this node cannot build it.

    An engine is only valid on the GPU product it was built on, so a mismatch is an error,
    never a silent build for the wrong GPU.
    """
    if identity is None:
        try:
            identity = node_identity(target.backend)
        except RuntimeError as e:
            if not target.is_gpu:
                raise
            product = gpu_product_here()
            if product == target.gpu_product:
                raise TargetError(f"cannot build target {target.spec()} here: this node has {product}, but {e}") from e
            identity = (product, None, "")
    product, cc, version = identity
    if product != target.gpu_product:
        have = "no GPU (cpu only)" if product == "cpu" else f"GPU {product}"
        raise TargetError(
            f"cannot build target {target.spec()} here: this node has {have}, the target wants "
            f"{target.gpu_product}; run the build on a node labelled {GPU_PRODUCT_LABEL}={target.gpu_product}"
        )
    return target.resolve(cc, version)


def build_stage(package_dir: str | os.PathLike[str], target: Target | str, store: EngineStore | None, out_dir: str | os.PathLike[str]) -> Built:
    """Build the engine for `target` into `out_dir`, unless `store` already holds a verified one."""
    target = parse_target(target) if isinstance(target, str) else target
    manifest = open_package(package_dir)
    digest = model_digest(manifest)
    resolved = resolve_on_node(target)
    key = resolved.key()
    if store is not None and store.has_engine(digest, key):
        log(logger, logging.INFO, "engine reused", key=key, store=store.uri)
        return Built(key, resolved, digest, None, reused=True)
    try:
        from kubetrt.runtime.devices import build_engine
    except ImportError as e:
        raise RuntimeError(f"kubetrt.runtime.devices.build_engine is not available ({e})") from e
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with progress.step(f"building engine {key}"):
        meta = dict(build_engine(Path(package_dir), resolved, out) or {})
    built_target = meta.get("target")
    if isinstance(built_target, dict):
        built_target = Target.from_json(built_target)
    if isinstance(built_target, Target) and built_target.resolved and built_target.key() != key:
        raise TargetError(f"the runtime built key {built_target.key()} but this node resolved {key}")
    meta["target"] = resolved.to_json()
    log(logger, logging.INFO, "engine built", key=key)
    return Built(key, resolved, digest, out, reused=False, metadata=meta)


# ---------------------------------------------------------------------------------------------
# verify + publish


def load_with_engine(package_dir: str | os.PathLike[str], engine_dir: str | os.PathLike[str], target: Target, key: str, workdir: str | os.PathLike[str]) -> Any:
    """Load the package with this engine the way serving will: engine under engines/<key>/, digests listed."""
    entry = {"backend": target.backend, "target": target.to_json(), "spec": target.spec()}
    assembled = assemble_package(package_dir, {key: (Path(engine_dir), entry)}, Path(workdir) / "package")
    return load_packaged_engine(assembled, target.backend, key)


def load_packaged_engine(package_dir: str | os.PathLike[str], device: str, key: str) -> Any:
    """load_model on a package holding engines/<key>/, digest-checking everything listed."""
    from kubetrt.runtime import load_model

    return load_model(package_dir, device=device, engine_key=key, verify=True)


def verify_stage(package_dir: str | os.PathLike[str], engine_dir: str | os.PathLike[str], target: Target, key: str | None = None) -> dict[str, Any]:
    """Load the package with this engine and compare it with TensorFlow's golden outputs.

    Returns the report (pass or fail); publishing decides what to do with a failure.
    """
    key = key or target.key()
    manifest = open_package(package_dir)
    golden = load_golden(package_dir, manifest)
    with tempfile.TemporaryDirectory(prefix="kubetrt-verify-") as tmp:
        with progress.step(f"verifying engine {key} against TensorFlow outputs"):
            model = load_with_engine(package_dir, engine_dir, target, key, tmp)
            report = verify_predictions(model.predict, golden, target)
    report.update(key=key, target=target.to_json(), spec=target.spec(), model_digest=model_digest(manifest))
    log(logger, logging.INFO, "engine verified", key=key, passed=report["passed"], summary=report["summary"])
    return report


@dataclass
class EngineRecord:
    """A verified engine in the store: what deploy and the ModelDeployment name."""

    key: str
    spec: str
    gpu_product: str
    backend: str
    precision: str
    model_digest: str
    uri: str
    reused: bool
    summary: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "EngineRecord":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def publish_stage(store: EngineStore, built: Built, report: dict[str, Any]) -> EngineRecord:
    """Publish a passing engine; raise VerificationError (and publish nothing) for a failing one."""
    if not report.get("passed"):
        raise VerificationError(
            f"engine {built.key} failed verification and was not published: {report.get('summary')}"
        )
    if built.engine_dir is None:
        raise ValueError(f"engine {built.key}: nothing to publish (it was reused from the store)")
    with progress.step(f"publishing engine {built.key}"):
        pub = store.publish_engine(built.model_digest, built.key, built.engine_dir, dict(report, build=built.metadata))
    return engine_record(store, built, reused=pub.reused)


def engine_record(store: EngineStore, built: Built, reused: bool) -> EngineRecord:
    report = store.read_report(built.model_digest, built.key) or {}
    t = built.target
    return EngineRecord(
        key=built.key,
        spec=t.spec(),
        gpu_product=t.gpu_product,
        backend=t.backend,
        precision=t.precision,
        model_digest=built.model_digest,
        uri=store.engine_uri(built.model_digest, built.key),
        reused=reused,
        summary=str(report.get("summary", "")),
    )


def build_verify_publish(package_dir: str | os.PathLike[str], target: Target | str, store: EngineStore, workdir: str | os.PathLike[str] | None = None) -> EngineRecord:
    """One target end to end (the EngineBuild Job): build, verify, publish; reuse if already stored."""
    target = parse_target(target) if isinstance(target, str) else target
    with tempfile.TemporaryDirectory(prefix="kubetrt-build-", dir=workdir) as tmp:
        built = build_stage(package_dir, target, store, Path(tmp) / "engine")
        if built.reused:
            return engine_record(store, built, reused=True)
        report = verify_stage(package_dir, built.engine_dir, built.target, built.key)  # type: ignore[arg-type]
        return publish_stage(store, built, report)


# ---------------------------------------------------------------------------------------------
# in-process pipeline (the embedded default; no Kubeflow)


@dataclass
class PipelineResult:
    package_dir: Path
    model_digest: str
    package_uri: str
    engines: list[EngineRecord]
    deployment: dict[str, Any]


def run_pipeline(
    source: str,
    store_uri: str,
    targets: Iterable[str | Target],
    workdir: str | os.PathLike[str],
    *,
    name: str | None = None,
    signature: str = "serving_default",
    version: str = "1",
    s3_endpoint: str | None = None,
) -> PipelineResult:
    """Run every stage in this process: what `kubetrt pipeline run --no-kfp` and the demo use."""
    from kubetrt.pipeline.deploy import model_deployment

    parsed = [parse_target(t) if isinstance(t, str) else t for t in targets]
    if not parsed:
        raise TargetError("no targets given; expected at least one, e.g. --target host")
    store = open_store(store_uri, s3_endpoint=s3_endpoint)
    workdir = Path(workdir)
    info = ingest_stage(source, workdir, signature, s3_endpoint=s3_endpoint)
    package_dir = lower_stage(info.path, workdir / "package", name=name, signature=signature, version=version)
    digest = store.publish_package(package_dir)
    records = [build_verify_publish(package_dir, t, store, workdir) for t in parsed]
    manifest = open_package(package_dir)
    deployment = model_deployment(manifest.name, manifest.version, store.package_uri(digest), records)
    return PipelineResult(package_dir, digest, store.package_uri(digest), records, deployment)
