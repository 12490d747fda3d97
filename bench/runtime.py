"""Host runtime vs TensorFlow (SavedModel signature) vs onnxruntime (CPU), side by side.

    python bench/runtime.py [--models mlp small_cnn mobilenet_v2 resnet50] [--seconds 3] [--baseline DIR] [--int8]

`--int8` adds kubetrt and onnxruntime running the same Q/DQ model (the pipeline's quantize stage
on each model, calibrated with min-max on seeded random inputs: the data changes the scales, not
the speed), beside kubetrt fp32, onnxruntime fp32 and TensorFlow fp32.

`--baseline DIR` adds another checkout of kubetrt (e.g. `git worktree add DIR main`) as one more
engine, `baseline`, taking turns with the others in the same run: a change's before and after,
side by side under the same noise.

Each (engine, model, batch) cell runs in its own subprocess, so one engine's thread pools (TF's
inter-op threads, onnxruntime's spinning workers) never slow another's measurement. Engines are
interleaved over several rounds and the median round is reported, because a shared 2-core VM
has noisy spells that would otherwise land on one engine. Batch 1 is the median latency of
back-to-back calls after warm-up; batch 32 is throughput from the median batch time. The fp32 matmul peak (NumPy sgemm, 4096^3, all cores) is measured in the same run,
and the host runtime's ResNet50 batch-32 FLOP rate is reported as a fraction of it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
ENGINES = ("kubetrt", "tensorflow", "onnxruntime")
INT8_ENGINES = ("kubetrt-int8", "onnxruntime-int8")
BASELINE = "baseline"
CALIBRATION_SAMPLES = 8
MODELS = ("mlp", "small_cnn", "mobilenet_v2", "resnet50")


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def feeds_for(package: Path, batch: int) -> dict[str, np.ndarray]:
    from kubetrt.runtime.package import read_manifest

    rng = np.random.default_rng(batch)
    return {t.name: rng.standard_normal([batch if d == -1 else d for d in t.shape]).astype(t.dtype) for t in read_manifest(package).inputs}


def int8_model(package: Path) -> Path:
    """The package's model quantized by the pipeline's quantize stage, cached beside the package."""
    from kubetrt.pipeline.calibration import CalibrationOptions
    from kubetrt.pipeline.quantize import quantize
    from kubetrt.runtime.package import MODEL_ONNX, read_manifest, sha256_file

    import onnx

    out = package.parent / f"model.int8-{sha256_file(package / MODEL_ONNX)[7:19]}.onnx"
    if not out.exists():
        manifest = read_manifest(package)
        rng = np.random.default_rng(0)
        data = {t.name: rng.standard_normal([CALIBRATION_SAMPLES] + [1 if d == -1 else d for d in t.shape[1:]]).astype(t.dtype)
                for t in manifest.inputs}
        quantized = quantize(onnx.load(str(package / MODEL_ONNX)), data, CalibrationOptions(source="synthetic", method="minmax"))
        tmp = out.with_suffix(".partial")
        onnx.save(quantized.model, str(tmp))
        os.replace(tmp, out)
    return out


def runner(engine: str, package: Path, savedmodel: Path) -> Callable[[dict[str, np.ndarray]], Any]:
    if engine == "kubetrt-int8":
        from kubetrt.runtime.devices.host import RUNTIME
        from kubetrt.runtime.onnx_import import load_onnx

        graph = load_onnx(int8_model(package))
        names = [v.name for v in graph.inputs]
        exe = RUNTIME.prepare(graph, {})
        return lambda feeds: exe.run([feeds[n] for n in names])
    if engine == "onnxruntime-int8":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(int8_model(package)), providers=["CPUExecutionProvider"])
        return lambda feeds: sess.run(None, feeds)
    if engine in ("kubetrt", BASELINE):  # the baseline's process imports kubetrt from its checkout
        from kubetrt.runtime import load_model

        return load_model(package).predict
    if engine == "onnxruntime":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(package / "model.onnx"), providers=["CPUExecutionProvider"])
        return lambda feeds: sess.run(None, feeds)
    if engine == "tensorflow":
        from kubetrt.pipeline.ingest import tensorflow

        tf = tensorflow()
        fn = tf.saved_model.load(str(savedmodel)).signatures["serving_default"]
        return lambda feeds: fn(**{k: tf.constant(v) for k, v in feeds.items()})
    raise ValueError(engine)


def time_calls(run: Callable[[Any], Any], feeds: Any, seconds: float, min_reps: int) -> list[float]:
    for _ in range(3):
        run(feeds)
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - t0)
        if len(times) >= 2000:
            break
    return times


def worker(engine: str, model: str, batch: int, seconds: float, package: Path, savedmodel: Path) -> dict[str, Any]:
    if engine == BASELINE:
        sys.path.insert(0, str(HERE))
        import _bootstrap  # noqa: F401  (reads KUBETRT_BENCH_CHECKOUT before kubetrt is imported)
    run = runner(engine, package, savedmodel)
    times = time_calls(run, feeds_for(package, batch), seconds, min_reps=5 if batch > 1 else 20)
    med = statistics.median(times)
    source = sys.modules["kubetrt.runtime"].__file__ if "kubetrt.runtime" in sys.modules else None
    return {"source": source, "engine": engine, "model": model, "batch": batch, "median_s": med, "reps": len(times), "items_per_s": batch / med}


def bf16_note() -> str:
    """Whether this CPU has the bf16 kernels a bf16 row would measure."""
    from kubetrt.runtime.kernels import onednn

    if not onednn.AVAILABLE:
        return "not measured: the onednn extra is not installed"
    if not onednn.BF16:
        return f"not measured: oneDNN has no bf16 convolutions on this CPU (ISA {onednn.isa_name()})"
    return "available on this CPU but not a kubetrt precision yet"


def matmul_peak() -> float:
    n = 4096
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    a @ a
    best = min(_t(lambda: a @ a) for _ in range(5))
    return 2 * n**3 / best / 1e9


def _t(f: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def model_flops(package: Path) -> float:
    """Multiply-adds x2 of convolutions and matrix products at batch 1, from inferred shapes."""
    from kubetrt.runtime.onnx_import import load_onnx
    from kubetrt.runtime.passes import optimize

    g = optimize(load_onnx(package / "model.onnx"))
    vals, total = g.values, 0.0
    for n in g.nodes:
        out = vals.get(n.outputs[0])
        if out is None or out.shape is None:
            continue
        size = float(np.prod([1 if d == -1 else d for d in out.shape]))
        if n.op in ("Conv", "FusedConv", "FusedConvNHWC"):
            w = g.constants[n.inputs[1]]
            total += 2 * size * np.prod(w.shape[1:])
        elif n.op in ("MatMul", "FusedMatMul", "Gemm"):
            a = vals[n.inputs[0]].shape
            total += 2 * size * (a[-1] if a else 0)
    return total


def spawn(args: list[str], checkout: Path | None = None) -> dict[str, Any]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if checkout is not None:
        env["KUBETRT_BENCH_CHECKOUT"] = str(checkout)
    proc = subprocess.run([sys.executable, str(Path(__file__)), *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"bench worker {args} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES + INT8_ENGINES)
    p.add_argument("--int8", action="store_true", help=f"add {' and '.join(INT8_ENGINES)} (the same Q/DQ model)")
    p.add_argument("--seconds", type=float, default=3.0, help="measuring time per cell, split over the rounds")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell; the median round is reported")
    p.add_argument("--baseline", type=Path, metavar="DIR", help="another kubetrt checkout, measured as engine 'baseline'")
    p.add_argument("--worker", nargs=5, metavar=("ENGINE", "MODEL", "BATCH", "PACKAGE", "SAVEDMODEL"), help=argparse.SUPPRESS)
    p.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        engine, model, batch, package, savedmodel = a.worker
        print(json.dumps(worker(engine, model, int(batch), a.seconds, Path(package), Path(savedmodel))))
        return 0
    if a.peak:
        print(json.dumps({"gflops": matmul_peak()}))
        return 0

    sys.path.insert(0, str(HERE))
    from _zoo import zoo

    z = zoo()
    paths: dict[str, tuple[Path, Path]] = {}
    engines = list(a.engines) + [e for e in INT8_ENGINES if a.int8 and e not in a.engines]
    for m in a.models:  # build/cache outside the timed workers
        _progress(f"preparing {m}")
        paths[m] = (z.package(m), z.savedmodel(m))
        if any(e in INT8_ENGINES for e in engines):
            _progress(f"quantizing {m}")
            int8_model(paths[m][0])
    if a.baseline is not None:
        if not (a.baseline / "pyproject.toml").is_file():
            p.error(f"--baseline {a.baseline}: not a kubetrt checkout (no pyproject.toml)")
        engines.append(BASELINE)
    _progress("measuring fp32 matmul peak")
    peak = spawn(["--peak"])["gflops"]
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    for m in a.models:
        for batch in (1, 32):
            rounds: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
            for r in range(a.rounds):  # engines interleaved, so a noisy spell hits all of them
                for e in engines:
                    _progress(f"{m} batch {batch} {e} (round {r + 1}/{a.rounds})")
                    args = ["--worker", e, m, str(batch), *map(str, paths[m]), "--seconds", str(a.seconds / a.rounds)]
                    rounds[e].append(spawn(args, a.baseline if e == BASELINE else None))
            for e, cells in rounds.items():
                results[(e, m, batch)] = sorted(cells, key=lambda c: c["median_s"])[len(cells) // 2]

    from kubetrt.runtime.kernels import blas, onednn

    print(f"\nfp32 matmul peak (NumPy sgemm 4096^3, {os.cpu_count()} cores): {peak:.1f} GFLOP/s")
    if a.baseline is not None:
        sources = {e: results[(e, a.models[0], 1)]["source"] for e in ("kubetrt", BASELINE) if e in engines}
        print("runtimes measured: " + ", ".join(f"{e} from {src}" for e, src in sources.items()))
    print(f"kubetrt host kernels: convolutions {'oneDNN' if onednn.AVAILABLE else 'im2col + GEMM'}, GEMMs {blas.BACKEND}\n")
    head = f"{'model':<14}{'batch':>6}" + "".join(f"{e:>18}" for e in engines)
    if "kubetrt" in engines:
        head += "".join(f"{'vs ' + e:>21}" for e in engines if e != "kubetrt")
    print(head)
    print("-" * len(head))
    for m in a.models:
        for batch in (1, 32):
            row = f"{m:<14}{batch:>6}"
            cells = {e: results[(e, m, batch)] for e in engines}
            for e in engines:
                r = cells[e]
                row += f"{r['median_s'] * 1e3:>15.2f} ms" if batch == 1 else f"{r['items_per_s']:>14.1f} i/s"
            if "kubetrt" in cells:
                for e in engines:
                    if e != "kubetrt":
                        ratio = cells[e]["median_s"] / cells["kubetrt"]["median_s"]
                        row += f"{ratio:>20.2f}x"
            print(row)
    print("\nratios: >1 means kubetrt is faster (batch 1: latency ratio; batch 32: throughput ratio)")
    if "kubetrt-int8" in engines:
        print("\nkubetrt int8 speed-up (time of the other / time of kubetrt int8):")
        for m in a.models:
            for batch in (1, 32):
                cells = {e: results[(e, m, batch)]["median_s"] for e in engines}
                ratios = ", ".join(f"vs {e} {cells[e] / cells['kubetrt-int8']:.2f}x" for e in engines if e != "kubetrt-int8")
                print(f"  {m:<14} batch {batch:>2}: {ratios}")
        print(f"bf16: {bf16_note()}")
    if "resnet50" in a.models and "kubetrt" in engines:
        flops = model_flops(z.package("resnet50"))
        rate = flops * results[("kubetrt", "resnet50", 32)]["items_per_s"] / 1e9
        print(f"resnet50 batch 32 on kubetrt: {flops / 1e9:.2f} GFLOP/image -> {rate:.1f} GFLOP/s = {100 * rate / peak:.0f}% of the matmul peak")
    return 0


if __name__ == "__main__":
    sys.exit(main())
