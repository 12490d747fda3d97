"""`kubetrt lower SAVEDMODEL -o PACKAGE`: SavedModel signature -> verified model package."""
from __future__ import annotations

import argparse
import tempfile
from typing import Any

DEFAULT_OPSET = 17  # mirrors kubetrt.pipeline.lower.DEFAULT_OPSET without importing TensorFlow at --help
# mirror kubetrt.pipeline.calibration's METHODS, DEFAULT_HOLDOUT and PRESETS (kept import-free for --help)
CALIBRATION_METHODS = ("minmax", "percentile", "entropy")
DEFAULT_HOLDOUT = 0.2
PRESETS = ("none", "unit", "tf", "caffe", "torch")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "lower",
        help="lower a TensorFlow SavedModel into a model package (ONNX + golden outputs)",
        description="Lower one SavedModel signature into a model package: manifest.json, model.onnx "
        "(tf2onnx) and golden.npz (TensorFlow's outputs for seeded random inputs at batch 1 and 4). "
        "Fails unless onnxruntime reproduces the golden outputs. With --calibration DATA it also writes "
        "model.int8.onnx (post-training INT8 quantization, calibrated on DATA) and heldout.npz (the samples "
        "kept out of calibration, with TensorFlow's outputs for them).",
    )
    p.add_argument("savedmodel", metavar="SAVEDMODEL", help="SavedModel directory (contains saved_model.pb)")
    p.add_argument("-o", "--output", required=True, metavar="PACKAGE", help="package directory to create (must not exist)")
    p.add_argument("--name", help="model name (default: the SavedModel directory's name)")
    p.add_argument("--signature", default="serving_default", help="signature to lower (default: %(default)s)")
    p.add_argument("--version", default="1", help="model version (default: %(default)s)")
    p.add_argument("--opset", type=int, default=DEFAULT_OPSET, help="ONNX opset (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed for the golden inputs (default: %(default)s)")
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        type=parse_shape,
        metavar="NAME=D0,D1,...",
        help="concrete golden-input shape for an input with dynamic non-batch dims, batch dim -1 "
        "(e.g. --shape tokens=-1,16); repeatable",
    )
    p.add_argument(
        "--allow-fallback",
        action="append",
        default=[],
        choices=["onnxruntime"],
        help="let onnxruntime run nodes kubetrt has no kernel for (serving then needs the kubetrt[fallback] "
        "extra); without it such a node fails the lowering",
    )
    q = p.add_argument_group("INT8 calibration")
    q.add_argument("--calibration", metavar="DATA",
                   help="calibration data for the INT8 model (a path, file://, s3:// or gs:// URI): an .npz with one array per model input (N samples on "
                   "axis 0, optional 'labels'), a directory of .npy files (<input>.npy per input, or one file per "
                   "sample), or a directory of images (one subdirectory per class, or flat)")
    q.add_argument("--calibration-method", choices=CALIBRATION_METHODS, default="minmax",
                   help="how activation ranges are measured (default: %(default)s)")
    q.add_argument("--percentile", type=float, metavar="P",
                   help="with --calibration-method percentile: the percentile of |x| to clip at (default 99.999)")
    q.add_argument("--holdout", type=float, default=DEFAULT_HOLDOUT, metavar="F",
                   help="fraction of the samples kept out of calibration to measure accuracy on "
                   "(default: %(default)s)")
    q.add_argument("--keep-float", nargs="+", action="extend", default=[], metavar="NAME|OP|first|last",
                   help="nodes to leave in float: node names, op types (e.g. Add), or first/last (the first/last "
                   "Conv, MatMul or Gemm). Softmax and LayerNormalization always stay float")
    q.add_argument("--preprocess", metavar="NAME|MODULE:FN",
                   help="image data only: how pixels become model input: none (0..255), unit (/255), tf (-1..1), "
                   "caffe (BGR minus ImageNet means), torch (ImageNet mean/std), or MODULE:FUNCTION (or "
                   "FILE.py:FUNCTION) taking the uint8 NHWC batch and returning the model's input")
    p.set_defaults(func=run)


def calibration_options(args: argparse.Namespace) -> Any:
    """CalibrationOptions from the flags; None without --calibration (other INT8 flags then refused)."""
    from kubetrt.pipeline.calibration import CalibrationOptions

    if args.calibration is None:
        given = [flag for flag, value in (("--percentile", args.percentile), ("--keep-float", args.keep_float),
                                          ("--preprocess", args.preprocess)) if value]
        if args.calibration_method != "minmax":
            given.insert(0, "--calibration-method")
        if args.holdout != DEFAULT_HOLDOUT:
            given.append("--holdout")
        if given:
            raise ValueError(f"{', '.join(given)} need --calibration DATA (the data the INT8 model is calibrated on)")
        return None
    return CalibrationOptions(source=args.calibration, holdout=args.holdout, method=args.calibration_method,
                              percentile=args.percentile, keep_float=tuple(args.keep_float),
                              preprocess=args.preprocess)


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """`tokens=-1,16` -> ("tokens", (-1, 16))."""
    name, sep, dims = text.rpartition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME=D0,D1,... with integer dims and -1 for the batch dim, e.g. tokens=-1,16"
        ) from None


def run(args: argparse.Namespace) -> int:
    from kubetrt.pipeline.calibration import fetch_options
    from kubetrt.pipeline.lower import lower
    from kubetrt.runtime.coverage import describe

    shapes = dict(args.shape)
    if len(shapes) != len(args.shape):
        raise ValueError("--shape given more than once for the same input; expected one per input")
    calibration = calibration_options(args)
    with tempfile.TemporaryDirectory(prefix="kubetrt-calibration-") as tmp:
        if calibration is not None:
            calibration = fetch_options(calibration, tmp)
        manifest = lower(
            args.savedmodel,
            args.output,
            name=args.name,
            signature=args.signature,
            version=args.version,
            seed=args.seed,
            opset=args.opset,
            shapes=shapes,
            allow_fallback=tuple(args.allow_fallback),
            calibration=calibration,
        )
    ios = ", ".join(f"{t.name}:{t.dtype}{list(t.shape)}" for t in manifest.inputs)
    outs = ", ".join(f"{t.name}:{t.dtype}{list(t.shape)}" for t in manifest.outputs)
    print(f"lowered {manifest.name} v{manifest.version} -> {args.output}")
    print(f"  inputs:  {ios}")
    print(f"  outputs: {outs}")
    print(f"  onnx opset {manifest.onnx['opset']}, onnxruntime max abs diff vs TensorFlow "
          f"{manifest.onnx['check']['max_abs_diff']:.3g}")
    for device, cov in manifest.onnx["coverage"].items():
        print(f"  kernel coverage, {device}:")
        for line in describe(cov):
            print(f"    {line}")
    if manifest.quantization:
        print_quantization(manifest.quantization, manifest.heldout)
    return 0


def print_quantization(quantization: dict[str, Any], heldout: dict[str, Any]) -> None:
    from kubetrt.runtime.coverage import describe

    cal = quantization["calibration"]
    method = quantization["method"] + (f" {quantization['percentile']}" if "percentile" in quantization else "")
    print(f"  int8: {quantization['file']} calibrated with {method} on {cal['samples']} samples of {cal['kind']} "
          f"data {cal['source']} ({cal['digest'][:19]})")
    kept = quantization["float"]
    print(f"    kept in float: op types {', '.join(kept['op_types'])}"
          + (f"; nodes {', '.join(kept['nodes'])}" if kept["nodes"] else ""))
    diffs = ", ".join(f"{k} {v:.3g}" for k, v in quantization["check"]["max_abs_diff"].items())
    print(f"    held out: {heldout['samples']} samples{' with labels' if heldout['labels'] else ''}; onnxruntime "
          f"int8 max abs diff vs TensorFlow: {diffs}")
    for device, cov in quantization["coverage"].items():
        print(f"    kernel coverage, {device}:")
        for line in describe(cov):
            print(f"      {line}")

