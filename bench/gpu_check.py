"""GPU check: the cuda runtime on model packages vs TensorFlow's golden outputs (golden.npz).

    PYTHONPATH=. python bench/gpu_check.py PKG_DIR [PKG_DIR ...] [--precision fp32 fp16]

Runs each package at every golden batch size, eager and with CUDA Graph replay; outputs must match
at the gpu tolerance for the precision that verification uses (kubetrt.runtime.accuracy). Prints a
table; exits 1 if any check fails. Needs only numpy, onnx and cupy (no TensorFlow).
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bootstrap
from kubetrt.runtime.accuracy import GPU, compare, tolerance_for
from kubetrt.runtime.devices.cuda import CudaRuntime
from kubetrt.runtime.devices.cuda_native import MATH_MODES
from kubetrt.runtime.kernels.cuda import CONV_ALGOS
from kubetrt.runtime.onnx_import import load_package_graph
from kubetrt.runtime.package import load_golden, open_package


def check(package: Path, precision: str, graphs: bool, rt: CudaRuntime, math: str = "default",
          conv_algo: str = "im2col") -> list[dict]:
    manifest = open_package(package)
    graph = load_package_graph(package, manifest)
    golden = load_golden(package, manifest)
    exe = rt.prepare(copy.deepcopy(graph), {"precision": precision, "cuda_graphs": graphs, "math": math, "contexts": 1,
                                            "conv_algo": conv_algo})
    rows = []
    for batch, (ins, outs) in sorted(golden.items()):
        feeds = [ins[v.name] for v in graph.inputs]
        exe.run(feeds)  # capture (if graphs) happens here
        t0 = time.perf_counter()
        got = exe.run(feeds)
        ms = (time.perf_counter() - t0) * 1e3
        result = compare(dict(zip([o.name for o in graph.outputs], got)), outs, tolerance_for(precision, GPU))
        refused = exe.capture_failures.get(tuple((f.shape, f.dtype.str) for f in feeds)) if graphs else None
        error = result.reason() or ""
        if graphs and refused is not None:
            error = f"ran eagerly: the CUDA Graph capture was refused ({refused}) {error}"
        note = f"not capturable: {exe.plan.sync_reasons[0]}" if graphs and not exe.cuda_graphs else ""
        rows.append({"model": manifest.name, "precision": precision, "math": math, "note": note, "conv": conv_algo,
                     "mode": "graph" if exe.cuda_graphs and refused is None else "eager",
                     "batch": batch, "abs_err": result.max_abs_error, "ok": result.passed and not error, "ms": ms,
                     "error": error})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="+", type=Path)
    ap.add_argument("--precision", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16"])
    ap.add_argument("--math", nargs="+", default=["default", "tf32"], choices=list(MATH_MODES),
                    help="cuBLAS math modes to check fp32 under (tf32: TensorFloat-32 tensor cores)")
    ap.add_argument("--conv-algos", nargs="+", default=["im2col"], choices=list(CONV_ALGOS),
                    help="convolution algorithms to check (cudnn: where cuDNN loads)")
    args = ap.parse_args(argv)
    rt = _bootstrap.cuda_runtime_or_exit(__file__)
    ident = rt.identity()
    print(f"# {ident.gpu_product}, compute capability {ident.compute_capability}, {ident.backend_version}")
    rows = []
    configs = [(p, m, a) for p in args.precision for m in args.math for a in args.conv_algos if p == "fp32" or m == "default"]
    for pkg in args.packages:
        for precision, math, algo in configs:
            for graphs in (False, True):
                try:
                    rows += check(pkg, precision, graphs, rt, math, algo)
                except Exception as e:  # report and keep checking the others
                    traceback.print_exc()
                    rows.append({"model": pkg.name, "precision": precision, "math": math, "conv": algo,
                                 "mode": "graph" if graphs else "eager",
                                 "batch": "-", "abs_err": float("nan"), "ok": False, "ms": 0.0, "error": f"{type(e).__name__}: {e}"})
    print(f"{'model':<16} {'prec':<10} {'conv':<7} {'mode':<6} {'batch':>5} {'abs_err':>10} {'tol':>7} {'ms':>9}  result")
    for r in rows:
        label = r["precision"] if r["math"] == "default" else f"{r['precision']}/{r['math']}"
        print(f"{r['model']:<16} {label:<10} {r['conv']:<7} {r['mode']:<6} {r['batch']!s:>5} {r['abs_err']:>10.2e} "
              f"{tolerance_for(r['precision'], GPU).atol:>7.0e} {r['ms']:>9.3f}  {'ok' if r['ok'] else 'FAIL ' + r.get('error', '')}  {r.get('note', '')}")
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
