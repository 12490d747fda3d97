"""Host runtime vs TensorFlow (SavedModel signature) vs onnxruntime and OpenVINO (CPU), side by side.

    python bench/runtime.py [--models mlp small_cnn mobilenet_v2 resnet50 efficientnet_b0 transformer]
                            [--engines ...] [--seconds 3] [--rounds 3] [--baseline DIR] [--int8]
                            [--isa avx2]

onnxruntime and OpenVINO are the peers a user serving on CPUs compares with: both run the package's
model.onnx, OpenVINO compiled for the cell's exact batch size. The last lines give, per cell, the
best peer's time over kubetrt's (`best-peer/kubetrt  resnet50 b32: 0.83 (openvino)`): 1.0 is
parity, above 1 kubetrt is faster. A cell an engine cannot run (a graph OpenVINO refuses, a model
that does not lower) is reported as failed with the reason; the rest of the run goes on.

`--int8` adds kubetrt and onnxruntime running the same Q/DQ model (the pipeline's quantize stage
on each model, calibrated with min-max on seeded random inputs: the data changes the scales, not
the speed), beside kubetrt fp32, onnxruntime fp32 and TensorFlow fp32.

`--isa avx2` runs every runtime's AVX2 code on an AVX-512 machine, as an AVX2 machine of the same
core would: kubetrt's (bench/_machine.py's isa_cap_env: oneDNN, numba, oneMKL and NumPy capped),
OpenVINO's (onednn_cap_env: its plugin dispatches through the oneDNN it carries) and onnxruntime's
(onnxruntime_cap_env: a copy of the package that reads XCR0 without AVX-512 state); TensorFlow keeps
the CPU's own. The report says which ISA each runtime dispatched.

`--baseline DIR` adds another checkout of kubetrt (e.g. `git worktree add DIR main`) as one more
engine, `baseline`, taking turns with the others in the same run: a change's before and after,
side by side under the same noise.

Each (engine, model, batch) cell runs in its own subprocess, so one engine's thread pools (TF's
inter-op threads, onnxruntime's and OpenVINO's workers) never slow another's measurement. Engines
take turns round by round and each cell reports the median of its rounds' medians, because a
shared 2-core VM has noisy spells that would otherwise land on one engine. Batch 1 is the median
latency of back-to-back calls after warm-up (8 calls, or a second and 3 calls at least); batch 32
is throughput from the median batch time.
The fp32 matmul peak (NumPy sgemm, 4096^3, all cores) is measured in the same run, and the host
runtime's ResNet50 batch-32 FLOP rate is reported as a fraction of it.
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
ENGINES = ("kubetrt", "tensorflow", "onnxruntime", "openvino")
PEERS = ("onnxruntime", "openvino")  # the CPU runtimes kubetrt is held to (best-peer/kubetrt)
INT8_ENGINES = ("kubetrt-int8", "onnxruntime-int8")
BASELINE = "baseline"
KUBETRT_ENGINES = ("kubetrt", "kubetrt-int8", BASELINE)  # the workers that run kubetrt (what an ISA cap applies to)
CALIBRATION_SAMPLES = 8
MODELS = ("mlp", "small_cnn", "mobilenet_v2", "resnet50", "efficientnet_b0", "transformer")
# Models no kernel or heuristic was tuned on, measured to show a gain carries over (--models all)
UNTUNED = ("bn_cnn", "densenet121", "gru_text")
BATCHES = (1, 32)
ERROR_CHARS = 400  # a failed cell's reason, one line


class WorkerFailed(RuntimeError):
    """A measuring subprocess that could not build or run its engine; the message is the reason."""


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def feeds_for(package: Path, batch: int) -> dict[str, np.ndarray]:
    """Seeded inputs as the pipeline draws its golden ones (ints are valid ids: a text model's tokens)."""
    from kubetrt.pipeline.lower import random_inputs
    from kubetrt.runtime.package import read_manifest

    inputs = read_manifest(package).inputs
    return random_inputs(inputs, {t.name: tuple(t.shape[1:]) for t in inputs}, batch, np.random.default_rng(batch))


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


def openvino_compiled(model_path: Path, feeds: dict[str, np.ndarray], perf_count: bool = False) -> Any:
    """OpenVINO's CPU plugin compiled from `model_path` for exactly the feeds' shapes (the cell's batch).

    The LATENCY hint at batch 32 too, not THROUGHPUT: each cell sends one request at a time, like
    every other engine here, and THROUGHPUT's parallel streams only pay off with several requests
    in flight. f32 inference precision, because on CPUs with bf16 units OpenVINO otherwise
    computes in bf16 by default, and the other engines are measured in fp32."""
    import openvino as ov

    core = ov.Core()
    model = core.read_model(str(model_path))
    model.reshape({name: list(x.shape) for name, x in feeds.items()})
    config: dict[str, Any] = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if perf_count:
        config["PERF_COUNT"] = True
    return core.compile_model(model, "CPU", config)


class OpenVINORun:
    """One OpenVINO infer request as a runner, which can say which ISA its kernels were built for."""

    def __init__(self, request: Any) -> None:
        self.request = request

    def __call__(self, feeds: dict[str, np.ndarray]) -> Any:
        # inputs read in place, as onnxruntime does; outputs copied out, as every engine returns fresh arrays
        return self.request.infer(feeds, share_inputs=True)

    def isa(self) -> str:
        from _machine import openvino_isa  # bench/ is on the path: main() put it there

        return openvino_isa(self.request.get_compiled_model())


def runner(engine: str, package: Path, savedmodel: Path, feeds: dict[str, np.ndarray]) -> Callable[[dict[str, np.ndarray]], Any]:
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
    if engine == "openvino":
        return OpenVINORun(openvino_compiled(package / "model.onnx", feeds).create_infer_request())
    if engine == "tensorflow":
        from kubetrt.pipeline.ingest import tensorflow

        tf = tensorflow()
        fn = tf.saved_model.load(str(savedmodel)).signatures["serving_default"]
        return lambda feeds: fn(**{k: tf.constant(v) for k, v in feeds.items()})
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES + INT8_ENGINES + (BASELINE,))}")


WARM_CALLS, WARM_SECONDS = 8, 1.0  # warm-up: this many calls, or this long with 3 calls at least


def time_calls(run: Callable[[Any], Any], feeds: Any, seconds: float, min_reps: int) -> list[float]:
    """Call times after warm-up: a long-running server's, once each engine's first-call work (compiling,
    capturing, timing its choices) is done. Calls go on for all of `seconds`: a cap on their count
    would cut a small model's window to tens of milliseconds, a few of the scheduler's time slices,
    where one stall more or less decides a mean (bench/contention.py)."""
    warm_until = time.perf_counter() + WARM_SECONDS
    for i in range(WARM_CALLS):
        run(feeds)
        if i >= 2 and time.perf_counter() > warm_until:
            break
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        run(feeds)
        times.append(time.perf_counter() - t0)
    return times


NEIGHBOUR_ENV = "KUBETRT_BENCH_NEIGHBOUR"  # "same-process": bench/contention.py's in-process neighbour


def start_neighbour(package: Path, savedmodel: Path, feeds: dict[str, np.ndarray]) -> Callable[[], None]:
    """Another runtime at work in this process (OpenVINO, its own thread pool, on the same model,
    a millisecond's pause between calls): what a pod with a second model or a sidecar runtime has.
    Returns the call that stops it (a native pool still inferring at interpreter exit aborts it)."""
    import threading

    run = runner("openvino", package, savedmodel, feeds)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            run(feeds)
            time.sleep(0.001)

    thread = threading.Thread(target=loop, name="neighbour", daemon=True)
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join()
    return stopped


def worker(engine: str, model: str, batch: int, seconds: float, package: Path, savedmodel: Path) -> dict[str, Any]:
    if engine == BASELINE:
        sys.path.insert(0, str(HERE))
        import _bootstrap  # noqa: F401  (reads KUBETRT_BENCH_CHECKOUT before kubetrt is imported)
    feeds = feeds_for(package, batch)
    run = runner(engine, package, savedmodel, feeds)
    neighbour = start_neighbour(package, savedmodel, feeds) if os.environ.get(NEIGHBOUR_ENV) == "same-process" else None
    try:
        times = time_calls(run, feeds, seconds, min_reps=5 if batch > 1 else 20)
    finally:
        if neighbour is not None:
            neighbour()
    med = statistics.median(times)
    source = sys.modules["kubetrt.runtime"].__file__ if "kubetrt.runtime" in sys.modules else None
    from _machine import ISA_CAP_MARK, ONNXRUNTIME_RUNTIMES  # bench/ is on the path: the worker runs this script

    isa: str | None = None  # what the engine's kernels were built for, where it says
    if isinstance(run, OpenVINORun):
        isa = run.isa()
    elif engine in KUBETRT_ENGINES and "kubetrt.runtime.kernels.onednn" in sys.modules:
        isa = sys.modules["kubetrt.runtime.kernels.onednn"].isa_name()
    elif engine in ONNXRUNTIME_RUNTIMES:  # a capped copy says so; the package as installed does not
        mark = Path(sys.modules["onnxruntime"].__file__ or "").parent / ISA_CAP_MARK
        isa = mark.read_text() if mark.is_file() else None
    return {"source": source, "isa": isa, "engine": engine, "model": model, "batch": batch, "median_s": med, "mean_s": statistics.fmean(times),
            "p99_s": float(np.percentile(times, 99)), "reps": len(times), "items_per_s": batch / med}


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
        elif n.op == "DenseChain":  # each layer's rows x K x N: the rows are the output's
            rows = size / out.shape[-1]
            total += sum(2 * rows * g.constants[w].size for w in n.inputs[1::2])
        elif n.op == "FusedAttention":  # per head, S x T scores of depth D, then S x E sums over T
            (s, d), (_, t), e = n.attrs["shapes"][0][-2:], n.attrs["shapes"][1][-2:], n.attrs["shapes"][2][-1]
            heads = float(np.prod(n.attrs["shapes"][0][:-2]))
            total += 2 * heads * s * t * (d + e)
    return total


def one_line(text: str) -> str:
    """A reason fit for one line of the report: whitespace collapsed, cut at ERROR_CHARS."""
    flat = " ".join(text.split())
    return flat if len(flat) <= ERROR_CHARS else flat[: ERROR_CHARS - 3] + "..."


def spawn(args: list[str], checkout: Path | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The worker's JSON result, or WorkerFailed with its reason (its own error line, else how it died)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    if checkout is not None:
        env["KUBETRT_BENCH_CHECKOUT"] = str(checkout)
    proc = subprocess.run([sys.executable, str(Path(__file__)), *args], capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if proc.returncode == 0 and isinstance(result, dict) and "error" not in result:
        return result
    if isinstance(result, dict) and "error" in result:
        raise WorkerFailed(str(result["error"]))
    died = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exited with {proc.returncode}"
    tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
    raise WorkerFailed(one_line(f"worker {died}: {tail[0]}"))


def measure(models: list[str], engines: list[str], paths: dict[str, tuple[Path, Path]], seconds: float, rounds: int,
            baseline: Path | None, envs: dict[str, dict[str, str]] | None = None
            ) -> tuple[dict[tuple[str, str, int], dict[str, Any]], dict[tuple[str, str, int], str]]:
    """Per cell, the median of the rounds' medians, engines taking turns round by round so a noisy
    spell hits all of them alike; and, per failed cell, its reason (a failed engine sits out the
    cell's later rounds: what failed to build once fails again). `envs` holds each engine's
    own environment, where it has one: an ISA cap (_machine.cap_envs)."""
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    failures: dict[tuple[str, str, int], str] = {}
    for m in models:
        for batch in BATCHES:
            cells: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
            for r in range(rounds):
                for e in engines:
                    if (e, m, batch) in failures:
                        continue
                    _progress(f"{m} batch {batch} {e} (round {r + 1}/{rounds})")
                    args = ["--worker", e, m, str(batch), *map(str, paths[m]), "--seconds", str(seconds / rounds)]
                    try:
                        cells[e].append(spawn(args, baseline if e == BASELINE else None,
                                              (envs or {}).get(e)))
                    except WorkerFailed as err:
                        failures[(e, m, batch)] = str(err)
                        _progress(f"{m} batch {batch} {e} failed: {err}")
            for e, runs in cells.items():
                if (e, m, batch) not in failures:
                    results[(e, m, batch)] = sorted(runs, key=lambda c: c["median_s"])[len(runs) // 2]
    return results, failures


def dispatched(results: dict[tuple[str, str, int], dict[str, Any]]) -> dict[str, list[str]]:
    """Per engine that says, the ISAs its kernels were built for over the run's cells."""
    found: dict[str, set[str]] = {}
    for (e, _, _), r in results.items():
        if r.get("isa"):
            found.setdefault(e, set()).add(r["isa"])
    return {e: sorted(isas) for e, isas in found.items()}


def best_peer_lines(times: dict[tuple[str, str, int], float], models: list[str], engines: list[str]) -> list[str]:
    """Per cell, the faster peer's time over kubetrt's (fp32 only); `times` lacks failed cells."""
    peers = [e for e in PEERS if e in engines]
    if "kubetrt" not in engines or not peers:
        return []
    lines = []
    for m in models:
        for batch in BATCHES:
            head = f"best-peer/kubetrt  {m} b{batch}:"
            ran = [(times[(e, m, batch)], e) for e in peers if (e, m, batch) in times]
            if ("kubetrt", m, batch) not in times:
                lines.append(f"{head} n/a (kubetrt failed)")
            elif not ran:
                lines.append(f"{head} n/a ({' and '.join(peers)} failed)")
            else:
                best, peer = min(ran)
                lines.append(f"{head} {best / times[('kubetrt', m, batch)]:.2f} ({peer})")
    return lines


def main() -> int:
    sys.path.insert(0, str(HERE))
    from _machine import ISA_CAPS, cap_envs, cpu_line, cpu_tag

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS + UNTUNED + ("all",),
                   help=f"'all' adds the models nothing was tuned on: {', '.join(UNTUNED)}")
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES + INT8_ENGINES)
    p.add_argument("--int8", action="store_true", help=f"add {' and '.join(INT8_ENGINES)} (the same Q/DQ model)")
    p.add_argument("--seconds", type=float, default=3.0, help="measuring time per cell, split over the rounds")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per cell; the median round is reported")
    p.add_argument("--baseline", type=Path, metavar="DIR", help="another kubetrt checkout, measured as engine 'baseline'")
    p.add_argument("--isa", choices=ISA_CAPS, default="native",
                   help="avx2: kubetrt (and the baseline), onnxruntime and OpenVINO run their AVX2 code on this CPU")
    p.add_argument("--worker", nargs=5, metavar=("ENGINE", "MODEL", "BATCH", "PACKAGE", "SAVEDMODEL"), help=argparse.SUPPRESS)
    p.add_argument("--peak", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        engine, model, batch, package, savedmodel = a.worker
        try:
            result = worker(engine, model, int(batch), a.seconds, Path(package), Path(savedmodel))
        except Exception as err:  # noqa: BLE001 - any engine's refusal is this cell's reason, reported, not raised
            print(json.dumps({"error": one_line(f"{type(err).__name__}: {err}")}))
            return 1
        print(json.dumps(result))
        return 0
    if a.peak:
        print(json.dumps({"gflops": matmul_peak()}))
        return 0

    from _zoo import zoo

    if "all" in a.models:
        a.models = list(dict.fromkeys(m for m in (*MODELS, *UNTUNED, *a.models) if m != "all"))
    print(cpu_line(), flush=True)
    z = zoo()
    paths: dict[str, tuple[Path, Path]] = {}
    unprepared: dict[str, str] = {}  # model -> why it could not be lowered (or quantized)
    engines = list(a.engines) + [e for e in INT8_ENGINES if a.int8 and e not in a.engines]
    for m in a.models:  # build/cache outside the timed workers
        _progress(f"preparing {m}")
        try:
            paths[m] = (z.package(m), z.savedmodel(m))
            if any(e in INT8_ENGINES for e in engines):
                _progress(f"quantizing {m}")
                int8_model(paths[m][0])
        except Exception as err:  # noqa: BLE001 - a model that does not lower is reported, the others still run
            paths.pop(m, None)
            unprepared[m] = one_line(f"{type(err).__name__}: {err}")
            _progress(f"{m} left out: {unprepared[m]}")
    models = [m for m in a.models if m in paths]
    if a.baseline is not None:
        if not (a.baseline / "pyproject.toml").is_file():
            p.error(f"--baseline {a.baseline}: not a kubetrt checkout (no pyproject.toml)")
        engines.append(BASELINE)
    _progress("measuring fp32 matmul peak")
    peak = spawn(["--peak"])["gflops"]
    capped = cap_envs(a.isa, engines, KUBETRT_ENGINES)
    results, failures = measure(models, engines, paths, a.seconds, a.rounds, a.baseline, capped)

    from kubetrt.runtime.kernels import blas, onednn

    times = {cell: r["median_s"] for cell, r in results.items()}
    print(f"\n{cpu_line()}")
    print(f"fp32 matmul peak (NumPy sgemm 4096^3, {os.cpu_count()} cores): {peak:.1f} GFLOP/s")
    if a.baseline is not None:
        sources: dict[str, str] = {}
        for (e, _, _), r in results.items():
            if e in ("kubetrt", BASELINE):
                sources.setdefault(e, r["source"])
        print("runtimes measured: " + ", ".join(f"{e} from {src}" for e, src in sources.items()))
    print(f"kubetrt host kernels: convolutions {'oneDNN' if onednn.AVAILABLE else 'im2col + GEMM'}, GEMMs {blas.BACKEND}")
    tag = cpu_tag(f"{', '.join(capped)} at {a.isa}" if a.isa != "native" else "")
    if a.isa != "native":
        print(f"capped at {a.isa.upper()}: kubetrt (its own kernels, oneMKL and NumPy too), OpenVINO (its oneDNN) and "
              "onnxruntime (a copy that reads XCR0 without AVX-512 state); TensorFlow at this CPU's own ISA")
    print("ISA dispatched: " + "; ".join(f"{e} {', '.join(isas)}" for e, isas in dispatched(results).items()))
    print()
    head = f"{'model':<16}{'batch':>6}" + "".join(f"{e:>18}" for e in engines)
    if "kubetrt" in engines:
        head += "".join(f"{'vs ' + e:>21}" for e in engines if e != "kubetrt")
    print(head)
    print("-" * len(head))
    for m in models:
        for batch in BATCHES:
            row = f"{m:<16}{batch:>6}"
            for e in engines:
                cell = results.get((e, m, batch))
                if cell is None:
                    row += f"{'failed':>18}"
                else:
                    row += f"{cell['median_s'] * 1e3:>15.2f} ms" if batch == 1 else f"{cell['items_per_s']:>14.1f} i/s"
            if "kubetrt" in engines:
                mine = times.get(("kubetrt", m, batch))
                for e in engines:
                    if e != "kubetrt":
                        other = times.get((e, m, batch))
                        row += f"{other / mine:>20.2f}x" if other is not None and mine is not None else f"{'-':>21}"
            print(f"{row}  {tag}")
    print("\nratios: >1 means kubetrt is faster (batch 1: latency ratio; batch 32: throughput ratio)")
    if "kubetrt-int8" in engines:
        print("\nkubetrt int8 speed-up (time of the other / time of kubetrt int8):")
        for m in models:
            for batch in BATCHES:
                int8 = times.get(("kubetrt-int8", m, batch))
                ratios = ", ".join(f"vs {e} {times[(e, m, batch)] / int8:.2f}x" for e in engines
                                   if e != "kubetrt-int8" and int8 is not None and (e, m, batch) in times)
                print(f"  {m:<16} batch {batch:>2}: {ratios or 'n/a (kubetrt-int8 failed)'}  {tag}")
        print(f"bf16: {bf16_note()}")
    if ("kubetrt", "resnet50", 32) in results:
        flops = model_flops(paths["resnet50"][0])
        rate = flops * results[("kubetrt", "resnet50", 32)]["items_per_s"] / 1e9
        print(f"resnet50 batch 32 on kubetrt: {flops / 1e9:.2f} GFLOP/image -> {rate:.1f} GFLOP/s = {100 * rate / peak:.0f}% of the matmul peak")
    if unprepared or failures:
        print("\nnot measured:")
        for m, why in unprepared.items():
            print(f"  {m}: could not be prepared: {why}")
        for (e, m, batch), why in failures.items():
            print(f"  {m} batch {batch} on {e}: {why}")
    lines = best_peer_lines(times, models, engines)
    if lines:
        print(f"\nbest peer ({' or '.join(e for e in PEERS if e in engines)}) time / kubetrt time, fp32; 1.0 = parity, >1 kubetrt is faster:")
        print("\n".join(f"{line}  {tag}" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
