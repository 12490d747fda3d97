"""Where the time goes, per op type: kubetrt's host plan against onnxruntime's and OpenVINO's own profilers.

    python bench/op_profile.py MODEL [--batch N] [--runs R] [--top K] [--isa avx2]

All three run the package's model.onnx on the same feeds (bench/runtime.py's, OpenVINO compiled
the same way), each in its own subprocess so one runtime's thread pools never slow another's.
kubetrt: every step of the host plan that serves the batch (the whole batch's, or a stream's piece's
where the batch runs as streams, one per core) is wrapped in a timer, by the kernel's op (fused
kernels keep their fused names); onnxruntime: `enable_profiling`, node events summed per op type;
OpenVINO: `PERF_COUNT`, per-layer real time by node type, with the implementation it chose
(exec_type) for its top layers, and kubetrt's top kernels beside them.

Per runtime: the plain run time (median, no profiler), the profiled run time and the op times' sum
(both means over the same R runs, after warm-up); the gap between the last two is the runtime's
own overhead per run (for kubetrt, the executor's). A profiler costs time per op too: onnxruntime's
adds microseconds to every node, so on tiny graphs its op times exceed the plain run and only
their shares compare. `--isa avx2` caps kubetrt, onnxruntime and OpenVINO at AVX2 as bench/runtime.py does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
RUNTIMES = ("kubetrt", "onnxruntime", "openvino")
WARMUP = 3


def _bench_runtime() -> Any:
    """bench/runtime.py (this script's folder is first on sys.path): its feeds and OpenVINO compile."""
    import importlib

    return importlib.import_module("runtime")


def _progress(msg: str) -> None:
    print(f"[profile] {msg}", file=sys.stderr, flush=True)


def wall_ms(run: Callable[[], Any], runs: int, warmup: int = WARMUP, after: Callable[[], Any] | None = None) -> list[float]:
    """Wall times of `runs` calls after `warmup` untimed ones, in ms; `after` runs untimed after
    each timed call (reading a profiler's counters)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
        if after is not None:
            after()
    return times


def per_op(events: list[tuple[str, float, int]], runs: int) -> dict[str, dict[str, Any]]:
    """(op type, ms, calls) events over `runs` runs -> per op type: ms per run and calls per run."""
    ops: dict[str, dict[str, Any]] = defaultdict(lambda: {"ms": 0.0, "count": 0.0})
    for op, ms, calls in events:
        ops[op]["ms"] += ms / runs
        ops[op]["count"] += calls / runs
    return dict(ops)


def top_layers(layers: dict[str, dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """A peer's `top` slowest layers (by name: type, ms per run, exec), slowest first, as report() lists them."""
    ranked = sorted(layers.items(), key=lambda kv: -kv[1]["ms"])[:top]
    return [{"name": name, **layer} for name, layer in ranked]


def profile_kubetrt(model: Path, feeds: dict[str, np.ndarray], runs: int, top: int) -> dict[str, Any]:
    """Steps timed in the plan that serves `feeds`: the whole batch's on the team, or, where the
    runtime runs this batch as streams (runtime/batch_streams.py), each stream's piece plan, its
    step times summed over the streams and divided by their number (each core's share of a run)."""
    import threading

    from kubetrt.runtime.batch_streams import BatchStreams, StreamChoice
    from kubetrt.runtime.devices.host import RUNTIME
    from kubetrt.runtime.executor import SequentialPlan
    from kubetrt.runtime.onnx_import import load_onnx
    from kubetrt.runtime.specialize import ShapeSpecializedPlan

    graph = load_onnx(model)
    args = [feeds[v.name] for v in graph.inputs]
    prepared = RUNTIME.prepare(graph, {})
    streams = BatchStreams(prepared)
    for _ in range(StreamChoice.WARM + 2 * StreamChoice.TRIALS + WARMUP):  # the choice of streams settles
        streams.run(args)
    plain = wall_ms(lambda: streams.run(args), runs)
    split = streams.streaming(args)
    shares = 1 if split is None else split.streams
    step_feeds = args if split is None else [x[:split.piece] for x in args]
    plan = prepared.specialized(step_feeds) if isinstance(prepared, ShapeSpecializedPlan) else prepared
    if not isinstance(plan, SequentialPlan):
        raise TypeError(f"{model}: the host runtime planned a {type(plan).__name__}, not a SequentialPlan; "
                        "only a plan of host kernels has steps to time")
    spent = [0.0] * len(plan.prog.kernels)
    lock = threading.Lock()  # streams time their steps from two threads

    def timed(run: Callable[..., Any], kid: int) -> Callable[..., Any]:
        def step(*operands: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return run(*operands)
            finally:
                took = time.perf_counter() - t0
                with lock:
                    spent[kid] += took / shares
        return step

    plan.steps = [(timed(run, kid), ins, outs, frees, kid) for run, ins, outs, frees, kid in plan.steps]
    run_once: Callable[[], Any] = (lambda: plan.run(args)) if split is None else (lambda: streams.streamed(split, args))
    for _ in range(WARMUP):
        run_once()
    spent[:] = [0.0] * len(spent)  # step times and run times from the same `runs` runs
    profiled = wall_ms(run_once, runs, warmup=0)
    kernels = plan.prog.kernels
    events = [(k.op, spent[k.id] * 1e3, runs) for k in kernels]
    values = plan.prog.values
    ranked = sorted(kernels, key=lambda k: -spent[k.id])[:top]
    layers = [{"name": k.name, "type": k.op, "ms": spent[k.id] * 1e3 / runs,
               "exec": "x".join(str(d) for d in values[k.outputs[0]].shape or ()) if k.outputs else ""} for k in ranked]
    return {"plain_ms": statistics.median(plain), "profiled_ms": statistics.fmean(profiled),
            "ops": per_op(events, runs), "steps": len(kernels), "layers": layers,
            "streams": None if split is None else {"streams": split.streams, "piece": split.piece,
                                                   "pieces": split.batch // split.piece // split.streams}}


def profile_onnxruntime(model: Path, feeds: dict[str, np.ndarray], runs: int, top: int) -> dict[str, Any]:
    import onnxruntime as ort

    plain = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    plain_times = wall_ms(lambda: plain.run(None, feeds), runs)
    del plain
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "ort")
        sess = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        profiled = wall_ms(lambda: sess.run(None, feeds), runs)
        trace = json.loads(Path(sess.end_profiling()).read_text())
    model_runs = sorted(e["ts"] for e in trace if e.get("cat") == "Session" and e.get("name") == "model_run")
    if len(model_runs) != WARMUP + runs:
        raise RuntimeError(f"onnxruntime's profile has {len(model_runs)} model_run events, expected {WARMUP + runs}")
    first = model_runs[WARMUP]  # warm-up runs are profiled too: counted from the first timed run
    nodes = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= first]
    events = [(e["args"]["op_name"], e["dur"] / 1e3, 1) for e in nodes]
    layers: dict[str, dict[str, Any]] = {}  # by the ONNX node's name, as kubetrt's kernels are named
    for e in nodes:
        name = e["name"].removesuffix("_kernel_time")
        if name not in layers:
            shape = (e["args"].get("output_type_shape") or [{}])[0].get("float", [])
            layers[name] = {"type": e["args"]["op_name"], "ms": 0.0, "exec": "x".join(str(d) for d in shape)}
        layers[name]["ms"] += e["dur"] / 1e3 / runs
    return {"plain_ms": statistics.median(plain_times), "profiled_ms": statistics.fmean(profiled), "ops": per_op(events, runs),
            "layers": top_layers(layers, top)}


def profile_openvino(model: Path, feeds: dict[str, np.ndarray], runs: int, top: int) -> dict[str, Any]:
    import openvino as ov

    compiled = _bench_runtime().openvino_compiled

    plain = compiled(model, feeds).create_infer_request()
    plain_times = wall_ms(lambda: plain.infer(feeds, share_inputs=True), runs)
    del plain
    request = compiled(model, feeds, perf_count=True).create_infer_request()
    events: list[tuple[str, float, int]] = []
    layers: dict[str, dict[str, Any]] = {}

    def collect() -> None:  # the counters hold the last run only
        for info in request.get_profiling_info():
            if info.status != ov.ProfilingInfo.Status.EXECUTED:  # fused into a neighbour, or a parameter/result
                continue
            ms = info.real_time.total_seconds() * 1e3
            events.append((info.node_type, ms, 1))
            layer = layers.setdefault(info.node_name, {"type": info.node_type, "exec": info.exec_type, "ms": 0.0})
            layer["ms"] += ms / runs

    profiled = wall_ms(lambda: request.infer(feeds, share_inputs=True), runs, after=collect)
    ops = per_op(events, runs)
    for op, v in ops.items():
        v["impl"] = sorted({layer["exec"] for layer in layers.values() if layer["type"] == op})
    return {"plain_ms": statistics.median(plain_times), "profiled_ms": statistics.fmean(profiled), "ops": ops,
            "layers": top_layers(layers, top)}


def worker(runtime: str, package: Path, batch: int, runs: int, top: int) -> dict[str, Any]:
    import _bootstrap  # noqa: F401  (reads KUBETRT_BENCH_CHECKOUT before kubetrt is imported)

    feeds = _bench_runtime().feeds_for(package, batch)
    model = package / "model.onnx"
    if runtime == "kubetrt":
        return profile_kubetrt(model, feeds, runs, top)
    if runtime == "onnxruntime":
        return profile_onnxruntime(model, feeds, runs, top)
    if runtime == "openvino":
        return profile_openvino(model, feeds, runs, top)
    raise ValueError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")


def spawn(runtime: str, model: str, package: Path, batch: int, runs: int, top: int,
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """One runtime's profile from its own process, or {"error": why} when it could not run the model."""
    args = [model, "--worker", runtime, str(package), "--batch", str(batch), "--runs", str(runs), "--top", str(top)]
    proc = subprocess.run([sys.executable, str(Path(__file__)), *args], capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **(env or {})))
    lines = proc.stdout.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        result: dict[str, Any] = json.loads(lines[-1])
        return result
    tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
    return {"error": _bench_runtime().one_line(f"worker exited with {proc.returncode}: {tail[0]}")}


def report(runtime: str, p: dict[str, Any], top: int) -> list[str]:
    """The lines for one runtime's profile."""
    if "error" in p:
        return [f"{runtime}: failed: {p['error']}"]
    ops = sorted(p["ops"].items(), key=lambda kv: -kv[1]["ms"])
    op_sum = sum(v["ms"] for _, v in ops)
    overhead = p["profiled_ms"] - op_sum
    what = "executor" if runtime == "kubetrt" else "runtime"
    lines = [f"{runtime}: {p['plain_ms']:.3f} ms per run (median); profiled {p['profiled_ms']:.3f} ms (mean) = ops {op_sum:.3f} ms"
             + (f" + {what} overhead {overhead:.3f} ms" if overhead >= 0 else
                f", {-overhead:.3f} ms over the run: its counters overlap, no {what} overhead to see")]
    if runtime == "kubetrt":
        streams = p.get("streams")
        steps = p["steps"] * (streams["pieces"] if streams else 1)  # steps each core runs per run
        lines[0] += f" ({steps} steps, {1e3 * overhead / max(steps, 1):.1f} us per step)"
        if streams:
            lines.append(f"  the batch runs as {streams['streams']} streams, one per core, each {streams['pieces']} pieces of "
                         f"{streams['piece']} samples: the steps are a piece's, their times each core's share of a run")
    impl = runtime == "openvino"
    lines.append(f"  {'op type':<28}{'ms/run':>9}{'share':>7}{'count':>7}" + ("  implementations" if impl else ""))
    for op, v in ops[:top]:
        row = f"  {op:<28}{v['ms']:>9.3f}{100 * v['ms'] / max(op_sum, 1e-12):>6.0f}%{v['count']:>7.0f}"
        lines.append(row + (f"  {', '.join(v['impl'])}" if impl else ""))
    if len(ops) > top:
        rest = sum(v["ms"] for _, v in ops[top:])
        lines.append(f"  {f'({len(ops) - top} more op types)':<28}{rest:>9.3f}")
    if p.get("layers"):
        lines.append({"openvino": "  top layers (exec_type = the kernel OpenVINO chose):",
                      "onnxruntime": "  top nodes (with the shape they write):"}.get(runtime, "  top kernels (with the shape they write, as planned):"))
        for layer in p["layers"]:
            name = layer["name"].replace("StatefulPartitionedCall/", "")  # tf2onnx's scope on every node
            name = name if len(name) <= 60 else "..." + name[-57:]
            lines.append(f"    {layer['ms']:>8.3f} ms  {layer['type']:<18} {layer['exec']:<24} {name}")
    return lines


def main() -> int:
    from _machine import ISA_CAPS, cap_envs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="a zoo model (tests/model_zoo.py), e.g. small_cnn, resnet50")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--runs", type=int, default=20, help="profiled runs per runtime, after warm-up")
    p.add_argument("--top", type=int, default=10, help="op types and layers (kernels) shown per runtime")
    p.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    p.add_argument("--isa", choices=ISA_CAPS, default="native", help="avx2: kubetrt, onnxruntime and OpenVINO run their AVX2 code")
    p.add_argument("--worker", nargs=2, metavar=("RUNTIME", "PACKAGE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.batch < 1 or a.runs < 1 or a.top < 1:
        p.error(f"--batch, --runs and --top must be at least 1 (got {a.batch}, {a.runs}, {a.top})")
    if a.worker:
        runtime, package = a.worker
        try:
            result = worker(runtime, Path(package), a.batch, a.runs, a.top)
        except Exception as err:  # noqa: BLE001 - a runtime refusing the model is reported beside the others
            print(json.dumps({"error": _bench_runtime().one_line(f"{type(err).__name__}: {err}")}))
            return 1
        print(json.dumps(result))
        return 0

    from _zoo import zoo

    z = zoo()
    if a.model not in z.names:
        p.error(f"no zoo model {a.model!r}; available: {', '.join(z.names)}")
    _progress(f"preparing {a.model}")
    package = z.package(a.model)
    envs = cap_envs(a.isa, a.runtimes)
    profiles = {}
    for runtime in a.runtimes:  # one after another: the machine's cores go to one runtime at a time
        _progress(f"profiling {runtime}")
        profiles[runtime] = spawn(runtime, a.model, package, a.batch, a.runs, a.top, envs.get(runtime))
    print(f"\n{a.model} batch {a.batch}: {a.runs} runs per runtime after {WARMUP} warm-up; ms per run, "
          "op times from each runtime's own profiler" + (f"; {', '.join(a.runtimes)} capped at {a.isa.upper()}" if a.isa != "native" else ""))
    for runtime, prof in profiles.items():
        print()
        print("\n".join(report(runtime, prof, a.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
