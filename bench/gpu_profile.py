"""Where the cuda runtime's time goes on one model: GPU time per op and per kernel kind, measured
with CUDA events around every plan step and every GEMM, cuDNN convolution, im2col, depthwise,
pool and bias pass, eagerly (a CUDA Graph replay runs the same kernels without the launch gaps).

    PYTHONPATH=. python bench/gpu_profile.py PKG [--batch 64] [--precision fp16] [--math default] [--top 12]

The step totals include the gaps between launches inside a step; when the GPU waits on Python,
the eager total exceeds the graph replay time, and the difference is launch overhead.
"""
from __future__ import annotations

import argparse
import collections
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap
import numpy as np
from kubetrt.runtime.devices import cudnn
from kubetrt.runtime.devices.cuda_native import MATH_MODES
from kubetrt.runtime.kernels.cuda import CONV_ALGOS
from kubetrt.runtime.onnx_import import load_package_graph
from kubetrt.runtime.package import open_package

NATIVE = ("im2col", "bias_act", "depthwise", "pool")


class Timeline:
    """Event pairs on the current stream, labelled; read once the stream is done."""

    def __init__(self, cp: Any) -> None:
        self.cp = cp
        self.marks: list[tuple[str, str, Any, Any]] = []  # (level, label, start, end)

    def wrap(self, level: str, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        cp = self.cp

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.marks.append((level, label, start, end))
            return out

        return timed

    def totals(self, level: str) -> dict[str, tuple[float, int]]:
        self.cp.cuda.get_current_stream().synchronize()
        acc: dict[str, list[float]] = collections.defaultdict(list)
        for lv, label, s, e in self.marks:
            if lv == level:
                acc[label].append(float(self.cp.cuda.get_elapsed_time(s, e)))
        return {k: (sum(v), len(v)) for k, v in acc.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", type=Path)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--precision", default="fp16", choices=["fp32", "fp16"])
    ap.add_argument("--math", default="default", choices=list(MATH_MODES))
    ap.add_argument("--conv-algo", default="im2col", choices=list(CONV_ALGOS))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    rt = _bootstrap.cuda_runtime_or_exit(__file__)
    import cupy as cp

    manifest = open_package(args.package)
    graph = load_package_graph(args.package, manifest)
    exe = rt.prepare(copy.deepcopy(graph), {"precision": args.precision, "math": args.math, "cuda_graphs": False,
                                            "conv_algo": args.conv_algo, "contexts": 1})
    plan, ctx = exe.plan, exe.plan.ctx
    shape = [args.batch if d < 0 else d for d in manifest.inputs[0].shape]
    x = cp.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
    stream = exe.streams[0]
    with exe.backend.on(stream):
        for _ in range(3):
            plan.run_device([x])
        exe.backend.synchronize()
        whole = Timeline(cp)
        run_whole = whole.wrap("run", "run", plan.run_device)
        for _ in range(args.runs):
            run_whole([x])
        run_ms = whole.totals("run")["run"][0] / args.runs
        tl = Timeline(cp)
        for st in plan.steps:
            st.run = tl.wrap("step", f"{st.op} ({st.kind})", st.run)
        if ctx.gemm is not None:
            ctx.gemm = tl.wrap("kernel", "gemm (cuBLAS)", ctx.gemm)
        if ctx.dnn is not None:
            # its forward alone: a layer whose choice is the GEMM path shows up as gemm and im2col
            setattr(cudnn.CudnnConv, "_forward", tl.wrap("kernel", "conv (cuDNN)", cudnn.CudnnConv._forward))
        if ctx.native is not None:
            for name in NATIVE:
                setattr(ctx.native, name, tl.wrap("kernel", name, getattr(ctx.native, name)))
        for _ in range(args.runs):
            plan.run_device([x])
        steps, kernels = tl.totals("step"), tl.totals("kernel")
    ident = rt.identity()
    total = sum(ms for ms, _ in steps.values()) / args.runs
    print(f"# {ident.gpu_product}, {ident.backend_version}; {manifest.name} batch {args.batch} {args.precision} "
          f"math {args.math} conv {args.conv_algo}: eager run {run_ms:.3f} ms (events around the whole run), "
          f"steps sum {total:.3f} ms a run, mean of {args.runs} runs")
    print(f"{'op (where it ran)':<34} {'ms/run':>8} {'share':>6} {'calls/run':>9}")
    for label, (ms, n) in sorted(steps.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{label:<34} {ms / args.runs:>8.3f} {ms / args.runs / total:>6.1%} {n // args.runs:>9}")
    print(f"{'kernel kind':<34} {'ms/run':>8} {'share':>6} {'calls/run':>9}")
    for label, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0]):
        print(f"{label:<34} {ms / args.runs:>8.3f} {ms / args.runs / total:>6.1%} {n // args.runs:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
