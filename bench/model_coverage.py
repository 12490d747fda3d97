"""Model coverage: every keras.applications model and the common recurrent, transformer and
decoder layers, lowered, checked against TensorFlow and timed beside TensorFlow and onnxruntime.

    python bench/model_coverage.py [--models NAME ...] [--skip NAME ...] [--rounds 3] [--seconds 1]

Per model: build the SavedModel (random weights, the model's smallest allowed input) and lower
it, both cached under .cache/coverage; then three worker processes, one per engine (kubetrt's
host runtime, the TensorFlow signature, onnxruntime on the same model.onnx), load it once and
take turns timing it, round by round, and each cell reports the median of its round medians.
The kubetrt worker also checks every golden batch against TensorFlow's outputs at the fp32 host
tolerance (runtime/accuracy.py) and reports the kernel coverage: ops without a host kernel and
fallback segments. Recurrent models are timed at batch 1 and 32, the rest at batch 1.

The table's columns: lowered? (or why not), no-kernel ops, fallback segments, max abs error,
max relative error (max |kubetrt - TF| over max |TF|, per output), within tolerance?, then ms at
batch 1 (and 32) per engine and TF/kubetrt, ORT/kubetrt ratios (>1: kubetrt faster).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ENGINES = ("kubetrt", "tensorflow", "onnxruntime")
RECURRENT_BATCHES = (1, 32)

# Layer models beyond the test zoo's (tests/model_zoo.py), sized like real text models, so the
# recurrent kernels are measured at a meaningful size.
EXTRA_LAYERS = ("lstm_text", "gru_text", "bilstm_text", "simple_rnn", "conv_lstm")
ZOO_LAYERS = ("transformer", "unet", "resize", "lstm", "gru", "bidirectional", "cumsum", "control_flow")
RECURRENT = {"lstm", "gru", "bidirectional", "lstm_text", "gru_text", "bilstm_text", "simple_rnn", "conv_lstm"}


def _progress(msg: str) -> None:
    print(f"[coverage] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- models


def _keras() -> Any:
    from kubetrt.pipeline.ingest import tensorflow

    tensorflow()
    import keras

    return keras


def application_names() -> list[str]:
    """Every model constructor keras.applications exports."""
    keras = _keras()
    return sorted(n for n in dir(keras.applications) if n[:1].isupper() and callable(getattr(keras.applications, n)))


def build_application(name: str, path: Path) -> dict[str, Any]:
    """`name` at its smallest allowed square input (32, or the minimum its error message names),
    ending in logits rather than softmax, with non-trivial batch-norm statistics: a randomly
    initialised network's softmax is nearly uniform, which any runtime matches within tolerance."""
    import inspect

    keras = _keras()
    ctor = getattr(keras.applications, name)
    extra = {"classifier_activation": None} if "classifier_activation" in inspect.signature(ctor).parameters else {}
    size, model = 32, None
    for _ in range(4):
        keras.utils.set_random_seed(0)
        try:
            model = ctor(input_tensor=keras.Input((size, size, 3), name="image"), weights=None, **extra)
            break
        except ValueError as e:  # the model's own minimum, when its message names it; else a next try
            found = re.search(r"no smaller than (\d+)", str(e)) or re.search(r"at least (\d+)", str(e))
            if not found and "output size would be zero" not in str(e):
                raise
            size = int(found.group(1)) if found else {32: 75, 75: 96, 96: 128}[size]
    if model is None:
        raise ValueError(f"{name}: no input size up to {size} builds")
    _zoo_builders().randomize_batchnorm(model, np.random.default_rng(0), BN_SPREAD.get(name, 1.0))
    model.export(str(path), verbose=False)
    params = int(model.count_params())
    keras.backend.clear_session()
    return {"input": f"{size}x{size}x3", "params": params, "head": "logits" if extra else "softmax"}


def build_layer_model(name: str, path: Path) -> dict[str, Any]:
    keras = _keras()
    keras.utils.set_random_seed(13)
    L = keras.layers
    if name == "lstm_text":  # token ids -> embedding -> 2x LSTM 128, dynamic sequence length
        inp = keras.Input((None,), dtype="int32", name="tokens")
        x = L.LSTM(128, return_sequences=True)(L.Embedding(10, 64)(inp))
        out = L.Dense(2)(L.LSTM(128)(x))
    elif name == "gru_text":
        inp = keras.Input((50, 64), name="sequence")
        out = L.Dense(2)(L.GRU(128)(L.GRU(128, return_sequences=True)(inp)))
    elif name == "bilstm_text":
        inp = keras.Input((50, 64), name="sequence")
        out = L.Dense(2)(L.Bidirectional(L.LSTM(64))(inp))
    elif name == "simple_rnn":
        inp = keras.Input((50, 64), name="sequence")
        out = L.Dense(2)(L.SimpleRNN(128)(inp))
    elif name == "conv_lstm":
        inp = keras.Input((6, 16, 16, 3), name="frames")
        out = L.Dense(2)(L.Flatten()(L.ConvLSTM2D(8, 3, padding="same")(inp)))
    else:
        raise KeyError(name)
    model = keras.Model(inp, out, name=name)
    model.export(str(path), verbose=False)
    params = int(model.count_params())
    keras.backend.clear_session()
    return {"input": "x".join(str(-1 if d is None else d) for d in inp.shape[1:]), "params": params}


# The largest applications go last: lowering them needs the most memory and time.
LARGEST = {"ConvNeXtBase", "ConvNeXtLarge", "ConvNeXtXLarge", "EfficientNetB7", "EfficientNetV2L", "NASNetLarge"}
# Random networks this deep are chaotic at the full batch-norm spread: a 1e-6 relative change of
# the input moves EfficientNetV2-M's logits by 1.7 in TensorFlow itself, so no runtime (not even
# onnxruntime, which lowering checks first) can agree with it at the fp32 tolerance.
BN_SPREAD = {"EfficientNetV2M": 0.25, "EfficientNetV2L": 0.25}
LAYER_SHAPES = {"lstm_text": {"tokens": (-1, 50)}}


def _bench_module(name: str) -> Any:
    """bench/<name>.py (this script's directory is first on sys.path)."""
    import importlib

    return importlib.import_module(name)


def _zoo() -> Any:
    return _bench_module("_zoo").zoo()


def _zoo_builders() -> Any:
    """tests/model_zoo.py, the test zoo's builders and helpers."""
    sys.path.insert(0, str(REPO / "tests"))
    import model_zoo

    return model_zoo


def prepare(name: str, cache: Path) -> dict[str, Any]:
    """SavedModel and package for `name` (cached); runs in its own process: TensorFlow's memory goes with it."""
    from kubetrt.pipeline.lower import lower

    if name in ZOO_LAYERS:
        z = _zoo()
        t0 = time.perf_counter()
        package = z.package(name)
        return {"savedmodel": str(z.savedmodel(name)), "package": str(package), "input": z.spec(name).description,
                "lower_s": time.perf_counter() - t0}
    lowering_digest = _zoo_builders().lowering_digest
    root = cache / name
    savedmodel, info_file = root / "savedmodel", root / "info.json"
    if not savedmodel.is_dir():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        tmp = root / "savedmodel.tmp"
        info = build_layer_model(name, tmp) if name in EXTRA_LAYERS else build_application(name, tmp)
        tmp.rename(savedmodel)
        info_file.write_text(json.dumps(info))
    info = json.loads(info_file.read_text())
    package = root / f"package-{lowering_digest()}"
    t0 = time.perf_counter()
    if not package.is_dir():
        for stale in root.glob("package-*"):
            shutil.rmtree(stale, ignore_errors=True)
        lower(savedmodel, package, name=name.lower().replace("_", "-"), shapes=LAYER_SHAPES.get(name),
              allow_fallback=("onnxruntime",))  # the table reports what falls back, and still runs it
    return {**info, "savedmodel": str(savedmodel), "package": str(package), "lower_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------- engine workers


def feeds_for(package: Path, batch: int) -> dict[str, np.ndarray]:
    """Seeded inputs at `batch`, the package's golden sizes for dynamic dims, ids valid for any table."""
    from kubetrt.pipeline.lower import random_inputs
    from kubetrt.runtime.package import read_manifest

    manifest = read_manifest(package)
    tails = {k: tuple(v[1:]) for k, v in manifest.golden["shapes"].items()}
    return random_inputs(manifest.inputs, tails, batch, np.random.default_rng(batch))


def load_engine(engine: str, package: Path, savedmodel: Path) -> tuple[Callable[[dict[str, np.ndarray]], Any], dict[str, Any]]:
    if engine == "kubetrt":
        from kubetrt.runtime import load_model

        model = load_model(package)
        return model.predict, check_kubetrt(model.predict, package)
    if engine == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.log_severity_level = 3
        sess = ort.InferenceSession(str(package / "model.onnx"), options, providers=["CPUExecutionProvider"])
        return (lambda feeds: sess.run(None, feeds)), {}
    if engine == "tensorflow":
        from kubetrt.pipeline.ingest import tensorflow

        tf = tensorflow()
        fn = tf.saved_model.load(str(savedmodel)).signatures["serving_default"]
        return (lambda feeds: fn(**{k: tf.constant(v) for k, v in feeds.items()})), {}
    raise ValueError(engine)


def check_kubetrt(predict: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]], package: Path) -> dict[str, Any]:
    """Golden batches against TensorFlow's outputs at the fp32 host tolerance, and the coverage."""
    from kubetrt.runtime.accuracy import HOST, compare, tolerance_for
    from kubetrt.runtime.coverage import place
    from kubetrt.runtime.onnx_import import load_package_graph
    from kubetrt.runtime.package import load_golden, read_manifest

    manifest = read_manifest(package)
    tol = tolerance_for("fp32", HOST)
    passed, max_abs, max_rel = True, 0.0, 0.0
    for _, (inputs, expected) in sorted(load_golden(package, manifest).items()):
        got = predict(inputs)
        result = compare(got, expected, tol)
        passed &= result.passed
        max_abs = max(max_abs, result.max_abs_error)
        for key, want in expected.items():
            scale = float(np.max(np.abs(want))) if want.size else 0.0
            err = float(np.max(np.abs(got[key].astype(np.float64) - want))) if want.size else 0.0
            max_rel = max(max_rel, err / scale if scale else err)
    cov = place(load_package_graph(package, manifest), "host", allow=("onnxruntime",))  # today's kernels
    no_kernel = sorted({op for seg in cov.segments for op in seg["ops"]})
    return {"passed": passed, "max_abs": max_abs, "max_rel": max_rel, "no_kernel": no_kernel,
            "fallback_segments": len(cov.segments)}


def worker(engine: str, package: Path, savedmodel: Path) -> None:
    """Load once, then answer `BATCH SECONDS` lines with one timing each (JSON lines on stdout)."""
    run, info = load_engine(engine, package, savedmodel)
    print(json.dumps({"ready": True, **info}), flush=True)
    feeds: dict[int, dict[str, np.ndarray]] = {}
    for line in sys.stdin:
        batch, seconds = int(line.split()[0]), float(line.split()[1])
        x = feeds.setdefault(batch, feeds_for(package, batch))
        for _ in range(2):
            run(x)
        times: list[float] = []
        deadline = time.perf_counter() + seconds
        while len(times) < 3 or time.perf_counter() < deadline:
            t0 = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"median_s": statistics.median(times), "reps": len(times)}), flush=True)


class Worker:
    def __init__(self, engine: str, package: str, savedmodel: str) -> None:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", engine, package, savedmodel],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(err.strip().splitlines()[-1] if err.strip() else "worker exited")
        return dict(json.loads(line))

    def time(self, batch: int, seconds: float) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{batch} {seconds}\n")
        self.proc.stdin.flush()
        return float(self._read()["median_s"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def spawn_json(args: list[str]) -> dict[str, Any]:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        raise RuntimeError(next((ln for ln in reversed(tail) if "Error" in ln), tail[-1] if tail else "failed"))
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


# --------------------------------------------------------------------------- driver


def measure(name: str, cache: Path, rounds: int, seconds: float) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name}
    _progress(f"{name}: building and lowering")
    try:
        row.update(spawn_json(["--prepare", name, "--cache", str(cache)]))
    except RuntimeError as e:
        row["error"] = str(e)[:300]
        return row
    batches = RECURRENT_BATCHES if name in RECURRENT else (1,)
    workers: dict[str, Worker] = {}
    try:
        for engine in ENGINES:
            _progress(f"{name}: loading in {engine}")
            workers[engine] = Worker(engine, row["package"], row["savedmodel"])
        row.update(workers["kubetrt"].info)
        for batch in batches:
            medians: dict[str, list[float]] = {e: [] for e in ENGINES}
            for r in range(rounds):
                for engine in ENGINES:  # taking turns: a noisy spell hits every engine alike
                    medians[engine].append(workers[engine].time(batch, seconds / rounds))
            for engine in ENGINES:
                row[f"{engine}_b{batch}_ms"] = statistics.median(medians[engine]) * 1e3
    except RuntimeError as e:
        row["error"] = f"run: {str(e)[:300]}"
    finally:
        for w in workers.values():
            w.close()
    return row


def _ms(row: dict[str, Any], engine: str, batch: int) -> str:
    v = row.get(f"{engine}_b{batch}_ms")
    return "-" if v is None else f"{v:.2f}"


def _ratio(row: dict[str, Any], engine: str, batch: int) -> str:
    k, o = row.get(f"kubetrt_b{batch}_ms"), row.get(f"{engine}_b{batch}_ms")
    return "-" if not k or o is None else f"{o / k:.2f}x"


def table(rows: list[dict[str, Any]]) -> str:
    head = ["model", "input", "lowered", "no-kernel ops", "fallback seg", "max abs err", "max rel err", "within tol",
            "b", "kubetrt ms", "TF ms", "ORT ms", "TF/kubetrt", "ORT/kubetrt"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lowered = "yes" if "package" in r else f"no: {r.get('error', '?')}"
        if "error" in r and "package" in r:
            lowered = f"yes; {r['error']}"
        batches = RECURRENT_BATCHES if r["model"] in RECURRENT else (1,)
        for b in batches:
            cells = [r["model"], str(r.get("input", "")), lowered, ", ".join(r.get("no_kernel", [])) or "none",
                     str(r.get("fallback_segments", "-")),
                     f"{r['max_abs']:.2e}" if "max_abs" in r else "-", f"{r['max_rel']:.2e}" if "max_rel" in r else "-",
                     {True: "yes", False: "NO"}.get(r.get("passed"), "-"), str(b),
                     _ms(r, "kubetrt", b), _ms(r, "tensorflow", b), _ms(r, "onnxruntime", b),
                     _ratio(r, "tensorflow", b), _ratio(r, "onnxruntime", b)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", help="only these (keras.applications names or layer models)")
    p.add_argument("--skip", nargs="+", default=[], help="leave these out")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="timing per engine and cell, split over the rounds")
    p.add_argument("--cache", type=Path, default=REPO / ".cache" / "coverage")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--worker", nargs=3, metavar=("ENGINE", "PACKAGE", "SAVEDMODEL"), help=argparse.SUPPRESS)
    p.add_argument("--prepare", metavar="NAME", help=argparse.SUPPRESS)
    p.add_argument("--list", action="store_true", help="print the model names and exit")
    a = p.parse_args()
    _bench_module("_bootstrap").ensure_kubetrt()
    if a.worker:
        worker(a.worker[0], Path(a.worker[1]), Path(a.worker[2]))
        return 0
    if a.prepare:
        print(json.dumps(prepare(a.prepare, a.cache)))
        return 0
    names = a.models or [*sorted(application_names(), key=lambda n: n in LARGEST), *ZOO_LAYERS, *EXTRA_LAYERS]
    if a.list:
        print("\n".join(names))
        return 0
    names = [n for n in names if n not in a.skip]
    rows = []
    for i, name in enumerate(names, 1):
        _progress(f"[{i}/{len(names)}] {name}")
        rows.append(measure(name, a.cache, a.rounds, a.seconds))
        if a.json:
            a.json.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    lowered = sum("package" in r for r in rows)
    ok = sum(bool(r.get("passed")) and not r.get("no_kernel") for r in rows)
    print(f"\n{lowered}/{len(rows)} lowered; {ok}/{len(rows)} within the fp32 tolerance of TensorFlow with no fallback")
    return 0 if ok == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
