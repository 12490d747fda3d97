"""Carry a large package to a machine with a small transfer limit: its big weight tensors leave
the ONNX file and come back there, either drawn from a seed at each tensor's own mean and spread
(a speed comparison needs the graph and sane magnitudes, not the trained numbers) or rounded to
fp16 (an fp16 run computes with fp16 weights anyway, so its check against the golden outputs still
means something; an fp32 check does not).

    python bench/graph_only.py strip PKG OUT [--weights seed|fp16] [--min-elements 16384]
    python bench/graph_only.py restore OUT        # on the other machine: OUT becomes a package

The restored package's manifest names the rewritten model.onnx's digest; its golden.npz is the
original's, which matches a seeded restore only in shapes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

STRIPPED = "stripped.onnx"
WEIGHTS = "weights.npz"
MODEL = "model.onnx"
MANIFEST = "manifest.json"


def strip(package: Path, out: Path, weights: str, min_elements: int) -> int:
    """Write `out`: the package with its big float32 initializers emptied; returns bytes saved."""
    model = onnx.load(str(package / MODEL))
    kept: dict[str, np.ndarray] = {}
    saved = 0
    for init in model.graph.initializer:
        if init.data_type != onnx.TensorProto.FLOAT or int(np.prod(init.dims)) < min_elements:
            continue
        a = numpy_helper.to_array(init)
        kept[init.name] = (a.astype(np.float16) if weights == "fp16"
                           else np.array([a.mean(), a.std()], dtype=np.float64))
        saved += a.nbytes
        init.ClearField("raw_data")
        init.ClearField("float_data")
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out / STRIPPED))
    np.savez(out / WEIGHTS, **{f"{weights}:{k}": v for k, v in kept.items()})  # type: ignore[arg-type]
    for name in sorted(p.name for p in package.iterdir() if p.is_file() and p.name != MODEL):
        shutil.copy2(package / name, out / name)
    return saved


def restore(out: Path, seed: int = 0) -> None:
    """Turn a stripped folder back into a package: model.onnx refilled, the manifest's digest updated."""
    from kubetrt.runtime.package import atomic_write_text, sha256_file

    model = onnx.load(str(out / STRIPPED))
    stored = np.load(out / WEIGHTS)
    by_name = {key.split(":", 1)[1]: (key.split(":", 1)[0], stored[key]) for key in stored.files}
    rng = np.random.default_rng(seed)
    for init in model.graph.initializer:
        if init.name not in by_name:
            continue
        kind, value = by_name[init.name]
        shape = tuple(init.dims)
        a = (value.astype(np.float32) if kind == "fp16"
             else rng.normal(value[0], value[1], size=shape).astype(np.float32))
        init.CopyFrom(numpy_helper.from_array(a, init.name))
    tmp = out / (MODEL + ".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(out / MODEL)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"][MODEL] = sha256_file(out / MODEL)
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("strip")
    s.add_argument("package", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--weights", choices=["seed", "fp16"], default="seed")
    s.add_argument("--min-elements", type=int, default=16384)
    r = sub.add_parser("restore")
    r.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "strip":
        saved = strip(args.package, args.out, args.weights, args.min_elements)
        print(f"{args.out}: {saved / 1e6:.1f} MB of weights left the graph ({args.weights})")
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import _bootstrap  # noqa: F401  kubetrt importable from this checkout

        restore(args.out)
        print(f"{args.out}: restored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
