"""`kubetrt pipeline compile|run`: the Kubeflow pipeline, compiled for a cluster or run here."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kubetrt.cli.commands.lower import CALIBRATION_METHODS, PRESETS


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("pipeline", help="compile the Kubeflow pipeline, or run it on this machine")
    sub = p.add_subparsers(dest="pipeline_command", required=True, metavar="ACTION")

    c = sub.add_parser("compile", help="write the kfp v2 pipeline YAML for Kubeflow")
    c.add_argument("-o", "--output", default="pipeline.yaml", help="output YAML path (default: pipeline.yaml)")
    c.add_argument("--target", action="append", default=None, metavar="SPEC",
                   help="default value of the pipeline's targets parameter (repeatable; default: host)")
    c.set_defaults(func=run_compile)

    r = sub.add_parser("run", help="run the pipeline locally (kfp.local subprocesses, or in-process with --no-kfp)")
    r.add_argument("source", metavar="SAVEDMODEL", help="SavedModel: directory, file://, s3:// or gs:// URI")
    r.add_argument("--store", required=True, metavar="URI", help="engine store: directory, file:// or s3://")
    r.add_argument("--target", action="append", default=None, metavar="SPEC", help="target spec (repeatable; default: host)")
    r.add_argument("--name", default="", help="model name (default: from the SavedModel path)")
    r.add_argument("--version", default="1", help="model version")
    r.add_argument("--signature", default="serving_default", help="SavedModel signature to lower")
    r.add_argument("--s3-endpoint", default="", help="S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)")
    r.add_argument("--pipeline-root", default=None, help="kfp.local artifact root (default: a temp directory)")
    r.add_argument("-o", "--output", default=None, help="also write the ModelDeployment YAML here")
    r.add_argument("--no-kfp", action="store_true", help="call the stages in this process instead of kfp.local")
    q = r.add_argument_group("INT8 calibration (int8 targets need it)")
    q.add_argument("--calibration", default="", metavar="DATA",
                   help="calibration data for the package's INT8 model (a path, file://, s3:// or gs:// URI): an .npz "
                   "with one array per model input, a directory of .npy files, or a directory of images")
    q.add_argument("--calibration-method", choices=CALIBRATION_METHODS, default="minmax",
                   help="how activation ranges are measured (default: %(default)s)")
    q.add_argument("--calibration-preprocess", default="", metavar="NAME|MODULE:FN",
                   help=f"image data only: how pixels become model input ({', '.join(PRESETS)}, or MODULE:FUNCTION)")
    r.set_defaults(func=run_local)


def run_compile(args: argparse.Namespace) -> int:
    from kubetrt.pipeline.kfp_pipeline import compile_pipeline

    out = compile_pipeline(args.output, args.target or ["host"])
    print(out)
    return 0


def run_local(args: argparse.Namespace) -> int:
    import tempfile

    targets = args.target or ["host"]
    calibration = dict(calibration=args.calibration, calibration_method=args.calibration_method,
                       calibration_preprocess=args.calibration_preprocess)
    with tempfile.TemporaryDirectory(prefix="kubetrt-pipeline-") as tmp:
        if args.no_kfp:
            from kubetrt.pipeline.deploy import to_yaml
            from kubetrt.pipeline.stages import run_pipeline

            result = run_pipeline(args.source, args.store, targets, tmp, name=args.name or None,
                                  signature=args.signature, version=args.version, s3_endpoint=args.s3_endpoint or None,
                                  **calibration)
            text = to_yaml(result.deployment)
        else:
            from kubetrt.pipeline.kfp_pipeline import run_local as kfp_run

            text = kfp_run(args.source, args.store, targets, args.pipeline_root or Path(tmp) / "kfp",
                           name=args.name, version=args.version, signature=args.signature,
                           s3_endpoint=args.s3_endpoint, verbose=args.verbose > 0, **calibration)
    if args.output:
        Path(args.output).write_text(text)
    sys.stdout.write(text)
    return 0
