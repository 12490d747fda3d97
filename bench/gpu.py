"""Benchmark: the cuda runtime vs PyTorch eager and torch.compile on the same GPU, side by side in
one run: ResNet-50 and MobileNetV2, batch 1 and 64, fp32 and fp16, device-resident inputs and
outputs, CUDA events after warm-up, the runtimes taking turns round by round.

    PYTHONPATH=. python bench/gpu.py --package resnet50=PKG --package mobilenet_v2=PKG
        [--batches 1 64] [--precision fp32 fp16] [--conv-algos cudnn im2col] [--compile-mode max-autotune] [--rounds 3]

Each kubetrt conv algorithm gets its own CUDA Graph column; the ratios use the fastest of them.

kubetrt runs the lowered Keras package; PyTorch runs torchvision's model of the same architecture
with random weights: this compares runtimes, not numerics (bench/gpu_check.py checks numerics
against TensorFlow's golden outputs). PyTorch's defaults stand: TF32 convolutions in fp32.
Needs numpy, onnx, cupy, torch, torchvision (no TensorFlow).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap
import numpy as np
from kubetrt.runtime.devices.cuda import CudaRuntime
from kubetrt.runtime.devices.cuda_native import MATH_MODES
from kubetrt.runtime.kernels.cuda import CONV_ALGOS
from kubetrt.runtime.onnx_import import load_package_graph
from kubetrt.runtime.package import open_package

TORCHVISION = {"resnet50": "resnet50", "mobilenet_v2": "mobilenet_v2"}


def event_ms(launch: Callable[[], Any], stream: Any, iters: int) -> float:
    """Mean ms per call between two CUDA events on `stream` (CuPy), calls launched back to back."""
    import cupy as cp

    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(iters):
        launch()
    end.record(stream)
    end.synchronize()
    return float(cp.cuda.get_elapsed_time(start, end)) / iters


def kubetrt_runner(package: Path, batch: int, precision: str, options: dict[str, Any]) -> Callable[[int], float]:
    import cupy as cp

    manifest = open_package(package)
    graph = load_package_graph(package, manifest)
    exe = CudaRuntime().prepare(copy.deepcopy(graph), {"precision": precision, "contexts": 1, **options})
    shape = [batch if d < 0 else d for d in manifest.inputs[0].shape]
    x = cp.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
    stream = exe.streams[0]
    for _ in range(3):
        exe.run_device([x])
    stream.synchronize()
    if options.get("cuda_graphs") and exe.capture_failures:
        raise RuntimeError(f"capture refused: {exe.capture_failures}")
    return lambda iters: event_ms(lambda: exe.run_device([x]), stream, iters)


def torch_runner(name: str, batch: int, precision: str, compile_mode: str | None) -> Callable[[int], float]:
    import torch
    import torchvision

    dtype = torch.float16 if precision == "fp16" else torch.float32
    model = getattr(torchvision.models, TORCHVISION[name])(weights=None).cuda().eval().to(dtype)
    if compile_mode:
        model = torch.compile(model, mode=compile_mode)
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)
    with torch.inference_mode():
        for _ in range(3):
            model(x)
    torch.cuda.synchronize()

    def run(iters: int) -> float:
        with torch.inference_mode():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                model(x)
            end.record()
            end.synchronize()
        return float(start.elapsed_time(end)) / iters

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", action="append", required=True, metavar="MODEL=DIR",
                    help=f"a lowered Keras package per model: {', '.join(TORCHVISION)}")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--precision", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"])
    ap.add_argument("--compile-mode", default="max-autotune",
                    help="torch.compile mode; 'none' leaves torch.compile out")
    ap.add_argument("--fp32-math", default="tf32", choices=list(MATH_MODES),
                    help="kubetrt's cuBLAS math for fp32 (PyTorch's convolutions use TF32 by default)")
    ap.add_argument("--conv-algos", nargs="+", default=["im2col"], choices=list(CONV_ALGOS),
                    help="kubetrt conv algorithms, one graph column each (cudnn: where cuDNN loads)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    packages = dict(p.split("=", 1) for p in args.package)
    unknown = set(packages) - set(TORCHVISION)
    if unknown:
        ap.error(f"--package {', '.join(sorted(unknown))}: expected one of {', '.join(TORCHVISION)}")
    rt = _bootstrap.cuda_runtime_or_exit(__file__)
    ident = rt.identity()
    import torch

    compile_mode = None if args.compile_mode == "none" else args.compile_mode
    algos = args.conv_algos
    print(f"# {ident.gpu_product}, cc {ident.compute_capability}, {ident.backend_version}, torch {torch.__version__}; "
          f"ms per call, median of {args.rounds} rounds of {args.iters} calls, runtimes taking turns; "
          f"kubetrt fp32 math: {args.fp32_math}; kubetrt eager runs conv {algos[0]}", flush=True)
    graph_cols = [f"graph {a}" for a in algos]
    cols = ["eager", *graph_cols, "torch", *(["compile"] if compile_mode else [])]
    titles = {"eager": "kubetrt eager", "torch": "torch eager", "compile": "torch.compile",
              **{g: f"kubetrt {g}" for g in graph_cols}}
    head = f"{'model':<13} {'batch':>5} {'prec':<5}" + "".join(f" {titles[c]:>{max(13, len(titles[c]))}}" for c in cols)
    head += f" {'eager/graph':>11}" + (f" {'compile/graph':>13}" if compile_mode else "")
    print(head + "   (graph: kubetrt's best graph column)", flush=True)
    for name, pkg in packages.items():
        for batch in args.batches:
            for precision in args.precision:
                t0 = time.perf_counter()
                math = args.fp32_math if precision == "fp32" else "default"
                def kubetrt(graphs: bool, algo: str) -> Callable[[], Callable[[int], float]]:
                    options = {"cuda_graphs": graphs, "math": math, "conv_algo": algo}
                    return lambda: kubetrt_runner(Path(pkg), batch, precision, options)

                makers = {"eager": kubetrt(False, algos[0]), **{f"graph {a}": kubetrt(True, a) for a in algos},
                          "torch": lambda: torch_runner(name, batch, precision, None)}
                if compile_mode:
                    makers["compile"] = lambda: torch_runner(name, batch, precision, compile_mode)
                runners: dict[str, Callable[[int], float]] = {}
                for label, make in makers.items():
                    try:
                        runners[label] = make()
                    except Exception as e:  # report the cell, keep the others
                        print(f"#   {name} b{batch} {precision} {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                times: dict[str, list[float]] = {k: [] for k in runners}
                for _ in range(args.rounds):
                    for label, run in runners.items():
                        times[label].append(run(args.iters))
                ms = {k: statistics.median(v) for k, v in times.items()}
                nan = float("nan")
                g = min((ms[c] for c in graph_cols if c in ms), default=nan)
                row = f"{name:<13} {batch:>5} {precision:<5}" + "".join(
                    f" {ms.get(c, nan):>{max(13, len(titles[c]))}.3f}" for c in cols)
                row += f" {ms.get('torch', nan) / g:>10.2f}x"
                if compile_mode:
                    row += f" {ms.get('compile', nan) / g:>12.2f}x"
                print(row + f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
