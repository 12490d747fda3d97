"""`kubetrt build --package URI --target SPEC --store URI`: build, verify and publish one engine.

This is the EngineBuild Job's command. It prints the engine key on stdout and, for the operator,
writes a JSON result ({"engineKey", "verified", "reused", "uri", "report": {"summary"}}) to the
termination log (/dev/termination-log when it exists, or --termination-log).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kubetrt.operators.names import TERMINATION_LOG as DEFAULT_TERMINATION_LOG


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("build", help="build, verify and publish the engine for one target (reuses a verified one)")
    p.add_argument("--package", required=True, metavar="URI", help="model package: directory, file://, or s3:// prefix")
    p.add_argument("--target", required=True, metavar="SPEC",
                   help="target spec, e.g. host or tensorrt@NVIDIA-H100-80GB-HBM3:fp16:1/8/64")
    p.add_argument("--store", required=True, metavar="URI", help="engine store: directory, PVC mount path, file:// or s3://")
    p.add_argument("--s3-endpoint", default=None, help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    p.add_argument("--termination-log", default=None, metavar="PATH",
                   help=f"where to write the JSON result (default: {DEFAULT_TERMINATION_LOG} if it exists)")
    p.set_defaults(func=run)


def _write_result(path: str | None, result: dict) -> None:
    target = path or (DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None)
    if target:
        Path(target).write_text(json.dumps(result, sort_keys=True) + "\n")


def run(args: argparse.Namespace) -> int:
    import tempfile

    from kubetrt.pipeline.stages import build_verify_publish
    from kubetrt.pipeline.store import fetch_package_uri, open_store
    from kubetrt.pipeline.verify import VerificationError
    from kubetrt.runtime.target import parse_target

    target = parse_target(args.target)
    store = open_store(args.store, s3_endpoint=args.s3_endpoint)
    with tempfile.TemporaryDirectory(prefix="kubetrt-build-") as tmp:
        package = fetch_package_uri(args.package, Path(tmp) / "package", s3_endpoint=args.s3_endpoint)
        try:
            record = build_verify_publish(package, target, store, tmp, verify=False)  # fetching checked it
        except VerificationError as e:
            _write_result(args.termination_log, {"verified": False, "engineKey": "", "report": {"summary": str(e)}})
            print(f"kubetrt build: verification failed: {e}", file=sys.stderr)
            return 1
    _write_result(args.termination_log, {
        "engineKey": record.key, "verified": True, "reused": record.reused, "uri": record.uri,
        "report": {"summary": record.summary},
    })
    print(record.key)
    return 0
