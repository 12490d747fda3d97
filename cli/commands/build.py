"""`kubetrt build --package URI --target SPEC --store URI`: build, verify and publish one engine.

This is the EngineBuild Job's command. It prints the engine key on stdout and, for the operator,
writes a JSON result ({"engineKey", "verified", "reused", "uri", "report": {"summary"}}) to the
termination log (/dev/termination-log when it exists, or --termination-log). It exits 0 on a
verified engine, BUILD_REFUSED_EXIT_CODE (3) when it refuses one (verification failed, or the package
was calibrated with other data), which fails the Job without its retries, and 1 on any other error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kubetrt.operators.names import BUILD_REFUSED_EXIT_CODE, TERMINATION_LOG as DEFAULT_TERMINATION_LOG

if TYPE_CHECKING:
    from kubetrt.runtime.package import Manifest
    from kubetrt.runtime.target import Target


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("build", help="build, verify and publish the engine for one target (reuses a verified one)")
    p.add_argument("--package", required=True, metavar="URI", help="model package: directory, file://, or s3:// prefix")
    p.add_argument("--target", required=True, metavar="SPEC",
                   help="target spec, e.g. host or tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64")
    p.add_argument("--store", required=True, metavar="URI", help="engine store: directory, PVC mount path, file:// or s3://")
    p.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--termination-log", default=None, metavar="PATH",
                   help=f"where to write the JSON result (default: {DEFAULT_TERMINATION_LOG} if it exists)")
    p.add_argument("--calibration", default=None, metavar="URI",
                   help="int8 targets: the calibration data the package must have been quantized with "
                        "(refused before building when the package records other data); ignored otherwise")
    p.set_defaults(func=run)


def check_calibration(manifest: Manifest, target: Target, calibration: str | None) -> None:
    """Refuse, before any engine work, an int8 build the package cannot serve: no int8 model, or one
    calibrated with other data than `calibration` (paths and file:// URIs of one file compare equal).

    Raises PackageError; without `calibration` the package's own record says what calibrated it.
    """
    from kubetrt.pipeline.deploy import store_uri_for_cluster
    from kubetrt.runtime.package import PackageError, model_file

    if target.precision != "int8":
        return
    model_file(manifest, target.precision)
    if calibration is None:
        return
    recorded = str((manifest.quantization.get("calibration") or {}).get("source") or "")
    if not recorded or store_uri_for_cluster(recorded).rstrip("/") != store_uri_for_cluster(calibration).rstrip("/"):
        raise PackageError(
            f"model {manifest.name} v{manifest.version} was calibrated with {recorded or 'unrecorded data'}, "
            f"but this build asks for calibration data {calibration}: lower the model again with "
            f"--calibration {calibration}, or set the calibration URI to {recorded or 'the data it was lowered with'}")


def _write_result(path: str | None, result: dict) -> None:
    target = path or (DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None)
    if target:
        Path(target).write_text(json.dumps(result, sort_keys=True) + "\n")


def run(args: argparse.Namespace) -> int:
    import tempfile

    from kubetrt.pipeline.stages import build_verify_publish
    from kubetrt.pipeline.store import fetch_package_uri, open_store
    from kubetrt.pipeline.verify import VerificationError
    from kubetrt.runtime.package import PackageError, read_manifest
    from kubetrt.runtime.target import parse_target

    target = parse_target(args.target)
    store = open_store(args.store, s3_endpoint=args.s3_endpoint)
    with tempfile.TemporaryDirectory(prefix="kubetrt-build-") as tmp:
        package = fetch_package_uri(args.package, Path(tmp) / "package", s3_endpoint=args.s3_endpoint)
        try:
            check_calibration(read_manifest(package), target, args.calibration)
        except PackageError as e:
            _write_result(args.termination_log, {"verified": False, "engineKey": "", "report": {"summary": str(e)}})
            print(f"kubetrt build: {e}", file=sys.stderr)
            return BUILD_REFUSED_EXIT_CODE
        try:
            record = build_verify_publish(package, target, store, tmp, verify=False)  # fetching checked it
        except VerificationError as e:
            _write_result(args.termination_log, {"verified": False, "engineKey": "", "report": {"summary": str(e)}})
            print(f"kubetrt build: verification failed: {e}", file=sys.stderr)
            return BUILD_REFUSED_EXIT_CODE
    _write_result(args.termination_log, {
        "engineKey": record.key, "verified": True, "reused": record.reused, "uri": record.uri,
        "report": {"summary": record.summary},
    })
    print(record.key)
    return 0
