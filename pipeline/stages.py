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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from kubetrt.runtime.coverage import describe
from kubetrt.telemetry import progress
from kubetrt.telemetry.logs import log
from kubetrt.pipeline.calibration import DEFAULT_METHOD, FORMATS, CalibrationError, CalibrationOptions, check_source
from kubetrt.pipeline.sources import fetch_model, parse_uri
from kubetrt.pipeline.store import (
    EngineStore,
    assemble_package,
    model_digest,
    open_store,
)
from kubetrt.pipeline.verify import VerificationError, verify_heldout, verify_predictions
from kubetrt.runtime import load_model
from kubetrt.runtime.devices import resolve_target
from kubetrt.runtime.engine import build_engine, manifest_entry
from kubetrt.runtime.accuracy import CALIBRATED_PRECISIONS
from kubetrt.runtime.package import Manifest, load_golden, load_heldout, open_package
from kubetrt.runtime.target import Target, TargetError, parse_target

if TYPE_CHECKING:
    from kubetrt.pipeline.ingest import SavedModelInfo

logger = logging.getLogger("kubetrt.pipeline")


# ---------------------------------------------------------------------------------------------
# ingest + lower (TensorFlow)


def ingest_stage(source: str, workdir: str | os.PathLike[str], signature: str = "serving_default", *, s3_endpoint: str | None = None) -> SavedModelInfo:
    """Fetch the SavedModel at `source` (path, file://, s3://, gs://) and validate its signature."""
    from kubetrt.pipeline.ingest import ingest

    with progress.step(f"fetching model {source}"):
        path = fetch_model(source, workdir, s3_endpoint=s3_endpoint)
    with progress.step("checking SavedModel signature"):
        return ingest(path, signature)


def lower_stage(savedmodel: str | os.PathLike[str] | SavedModelInfo, out_dir: str | os.PathLike[str], *, name: str | None = None, signature: str = "serving_default", version: str = "1",
                calibration: str = "", calibration_method: str = "minmax", calibration_preprocess: str = "",
                s3_endpoint: str | None = None) -> Path:
    """Lower a SavedModel (a path, or what ingest_stage already checked and hashed) into a model
    package at `out_dir`; with `calibration` (a path, file://, s3:// or gs:// URI; empty for none)
    the package also gets the INT8 model calibrated on that data."""
    from kubetrt.pipeline.calibration import CalibrationOptions, fetch_options
    from kubetrt.pipeline.lower import lower

    with tempfile.TemporaryDirectory(prefix="kubetrt-calibration-") as tmp:
        options = None
        if calibration:
            options = CalibrationOptions(calibration, method=calibration_method, preprocess=calibration_preprocess or None)
            with progress.step(f"fetching calibration data {calibration}"):
                options = fetch_options(options, tmp, s3_endpoint=s3_endpoint)
        with progress.step("lowering SavedModel to ONNX model package"):
            lower(savedmodel, Path(out_dir), name=name, signature=signature, version=version, calibration=options)
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


def build_stage(package_dir: str | os.PathLike[str], manifest: Manifest, target: Target, store: EngineStore | None,
                out_dir: str | os.PathLike[str]) -> Built:
    """Build the engine for `target` into `out_dir`, unless `store` already holds a verified one.

    `manifest` is the package's, already digest-checked by the caller."""
    digest = model_digest(manifest)
    resolved = resolve_target(target)
    key = resolved.key()
    if store is not None and store.has_engine(digest, key):
        log(logger, logging.INFO, "engine reused", key=key, store=store.uri)
        return Built(key, resolved, digest, None, reused=True)
    with progress.step(f"building engine {key}"):
        meta = build_engine(package_dir, manifest, resolved, out_dir)
    coverage = meta["coverage"]
    log(logger, logging.INFO, "engine built", key=key, fallback_segments=len(coverage["fallback_segments"]),
        runtimes=sorted(coverage["ops"]))
    for line in describe(coverage):
        progress.note(f"coverage: {line}")
    return Built(key, resolved, digest, Path(out_dir), reused=False, metadata=meta)


# ---------------------------------------------------------------------------------------------
# verify + publish


def verify_stage(package_dir: str | os.PathLike[str], manifest: Manifest, engine_dir: str | os.PathLike[str],
                 target: Target) -> dict[str, Any]:
    """Load the package with this engine the way serving will (engine under engines/<key>/, its
    files listed) and compare it with TensorFlow's golden outputs, and on held-out data by the
    precision's gate where the package has it (an int8 engine always does: calibration made it).

    Returns the report (pass or fail); publishing decides what to do with a failure.
    """
    key = target.key()
    with tempfile.TemporaryDirectory(prefix="kubetrt-verify-") as tmp:
        with progress.step(f"verifying engine {key} against TensorFlow outputs"):
            assembled = assemble_package(package_dir, {key: (Path(engine_dir), manifest_entry(target))}, Path(tmp) / "package")
            model = load_model(assembled, device=target.backend, engine_key=key, verify=False)
            report = verify_predictions(model.predict, load_golden(package_dir, manifest), target)
        heldout = load_heldout(package_dir, manifest)
        if heldout is not None:
            with progress.step(f"checking engine {key} on {heldout.samples} held-out samples against TensorFlow"):
                report["heldout"] = verify_heldout(model.predict, heldout, target)
    report = _with_heldout(report, target)
    report.update(key=key, target=target.to_json(), spec=target.spec(), model_digest=model_digest(manifest))
    log(logger, logging.INFO, "engine verified", key=key, passed=report["passed"], summary=report["summary"])
    return report


def _with_heldout(report: dict[str, Any], target: Target) -> dict[str, Any]:
    """The verdict: golden and held-out gates, or for calibrated precisions the held-out gate with
    the golden run only required to produce well-formed outputs (see CALIBRATED_PRECISIONS)."""
    heldout = report.get("heldout")
    if heldout is None:
        if target.precision in CALIBRATED_PRECISIONS:
            report["passed"] = False
            report["summary"] = f"FAILED: a {target.precision} engine needs the package's held-out data, and it has none"
        return report
    golden_ok = report["passed"]
    if target.precision in CALIBRATED_PRECISIONS:
        report["golden_gating"] = False
        golden_ok = all(o.get("max_abs_error") is not None for b in report["batches"] for o in b["outputs"])
    report["passed"] = bool(golden_ok and heldout["passed"])
    verdict = "passed" if report["passed"] else "FAILED"
    golden = report["summary"].split(": ", 1)[-1]
    report["summary"] = (f"{verdict}: held-out ({heldout['samples']} samples): {heldout['summary']}; golden "
                         f"{'(recorded, not gating) ' if report.get('golden_gating') is False else ''}{golden}")
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


def build_verify_publish(package_dir: str | os.PathLike[str], target: Target | str, store: EngineStore,
                         workdir: str | os.PathLike[str] | None = None, *, verify: bool = True) -> EngineRecord:
    """One target end to end (the EngineBuild Job): build, verify, publish; reuse if already stored.

    The package's digests are checked once, here, unless the caller just checked them (`verify`)."""
    target = parse_target(target) if isinstance(target, str) else target
    manifest = open_package(package_dir, verify=verify)
    with tempfile.TemporaryDirectory(prefix="kubetrt-build-", dir=workdir) as tmp:
        built = build_stage(package_dir, manifest, target, store, Path(tmp) / "engine")
        if built.engine_dir is None:
            return engine_record(store, built, reused=True)
        report = verify_stage(package_dir, manifest, built.engine_dir, built.target)
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


def check_calibration_request(targets: Iterable[Target], calibration: str, method: str = DEFAULT_METHOD,
                              preprocess: str = "") -> None:
    """Refuse at the start of a pipeline run what would otherwise fail after ingest and lowering:
    int8 targets without calibration data, calibration options without data, a bad method or
    preprocessing, local data that is not there. Raises CalibrationError saying what to give."""
    calibrated = sorted({t.spec() for t in targets if t.precision in CALIBRATED_PRECISIONS})
    if not calibration:
        if calibrated:
            raise CalibrationError(f"target(s) {', '.join(calibrated)} build int8 engines, which need calibration "
                                   f"data: give --calibration DATA ({FORMATS})")
        given = [flag for flag, on in (("--calibration-method", method != DEFAULT_METHOD),
                                       ("--calibration-preprocess", bool(preprocess))) if on]
        if given:
            raise CalibrationError(f"{', '.join(given)} need --calibration DATA (the data the INT8 model is "
                                   "calibrated on)")
        return
    options = CalibrationOptions(calibration, method=method, preprocess=preprocess or None)  # checks the options
    loc = parse_uri(calibration)
    if loc.scheme == "file":
        check_source(replace(options, source=loc.path))


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
    calibration: str = "",
    calibration_method: str = DEFAULT_METHOD,
    calibration_preprocess: str = "",
) -> PipelineResult:
    """Run every stage in this process: what `kubetrt pipeline run --no-kfp` and the demo use.

    `calibration` (a path, file://, s3:// or gs:// URI) gives the package its INT8 model; int8
    targets need it, and are refused before anything is fetched when it is missing."""
    from kubetrt.pipeline.deploy import model_deployment

    parsed = [parse_target(t) if isinstance(t, str) else t for t in targets]
    if not parsed:
        raise TargetError("no targets given; expected at least one, e.g. --target host")
    check_calibration_request(parsed, calibration, calibration_method, calibration_preprocess)
    store = open_store(store_uri, s3_endpoint=s3_endpoint)
    workdir = Path(workdir)
    info = ingest_stage(source, workdir, signature, s3_endpoint=s3_endpoint)
    package_dir = lower_stage(info, workdir / "package", name=name, signature=signature, version=version,
                              calibration=calibration, calibration_method=calibration_method,
                              calibration_preprocess=calibration_preprocess, s3_endpoint=s3_endpoint)
    digest = store.publish_package(package_dir)
    records = [build_verify_publish(package_dir, t, store, workdir) for t in parsed]
    manifest = open_package(package_dir)
    deployment = model_deployment(manifest.name, manifest.version, store.package_uri(digest), records,
                                  quantization=manifest.quantization)
    return PipelineResult(package_dir, digest, store.package_uri(digest), records, deployment)
