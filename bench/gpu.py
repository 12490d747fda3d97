"""Benchmark: the cuda runtime on the Keras ResNet50 package vs PyTorch eager on torchvision's
resnet50 (random weights), batch 1 and 64, fp32 and fp16, device-resident inputs and outputs,
timed with CUDA events after warm-up.

    PYTHONPATH=. python bench/gpu.py --package /path/to/resnet50/package [--iters 50]

Needs numpy, onnx, cupy, torch, torchvision (no TensorFlow). The two models are the same
architecture, not the same weights: this compares runtimes, not numerics (bench/gpu_check.py
checks numerics against TensorFlow's golden outputs).
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap
import numpy as np
from kubetrt.runtime.devices.cuda import CudaRuntime
from kubetrt.runtime.onnx_import import load_package_graph
from kubetrt.runtime.package import open_package


def time_kubetrt(package: Path, batch: int, precision: str, graphs: bool, iters: int, warmup: int) -> float:
    import cupy as cp

    manifest = open_package(package)
    graph = load_package_graph(package, manifest)
    rt = CudaRuntime()
    exe = rt.prepare(copy.deepcopy(graph), {"precision": precision, "cuda_graphs": graphs, "contexts": 1})
    shape = [batch if d < 0 else d for d in manifest.inputs[0].shape]
    x = cp.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
    stream = exe.streams[0]
    for _ in range(warmup):
        exe.run_device([x])
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(iters):
        exe.run_device([x])
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / iters


def time_torch(batch: int, precision: str, iters: int, warmup: int) -> float:
    import torch
    import torchvision

    model = torchvision.models.resnet50(weights=None).cuda().eval()
    dtype = torch.float16 if precision == "fp16" else torch.float32
    model = model.to(dtype)
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)
    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            model(x)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) / iters


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", required=True, type=Path, help="the lowered Keras ResNet50 model package")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--precision", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args(argv)
    rt = _bootstrap.cuda_runtime_or_exit(__file__)
    ident = rt.identity()
    import torch

    print(f"# {ident.gpu_product}, cc {ident.compute_capability}, {ident.backend_version}, torch {torch.__version__}")
    print(f"{'batch':>5} {'prec':<5} {'kubetrt eager ms':>17} {'kubetrt graph ms':>17} {'torch eager ms':>15} {'torch/graph':>12}")
    for batch in args.batches:
        for precision in args.precision:
            eager = time_kubetrt(args.package, batch, precision, False, args.iters, args.warmup)
            graph = time_kubetrt(args.package, batch, precision, True, args.iters, args.warmup)
            ref = time_torch(batch, precision, args.iters, args.warmup)
            print(f"{batch:>5} {precision:<5} {eager:>17.3f} {graph:>17.3f} {ref:>15.3f} {ref / graph:>11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
