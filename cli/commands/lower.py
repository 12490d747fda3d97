"""`kubetrt lower SAVEDMODEL -o PACKAGE`: SavedModel signature -> verified model package."""
from __future__ import annotations

import argparse
from typing import Any

DEFAULT_OPSET = 17  # mirrors kubetrt.pipeline.lower.DEFAULT_OPSET without importing TensorFlow at --help


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "lower",
        help="lower a TensorFlow SavedModel into a model package (ONNX + golden outputs)",
        description="Lower one SavedModel signature into a model package: manifest.json, model.onnx "
        "(tf2onnx) and golden.npz (TensorFlow's outputs for seeded random inputs at batch 1 and 4). "
        "Fails unless onnxruntime reproduces the golden outputs.",
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
    p.set_defaults(func=run)


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
    from kubetrt.pipeline.lower import lower
    from kubetrt.runtime.coverage import describe

    shapes = dict(args.shape)
    if len(shapes) != len(args.shape):
        raise ValueError("--shape given more than once for the same input; expected one per input")
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
    return 0

